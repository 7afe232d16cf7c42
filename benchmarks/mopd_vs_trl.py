"""Pair mode against TRL at its best (issue #42 item 5; first issue #33 item 5).

    python -m benchmarks.mopd_vs_trl --student runs/tiny/base --teacher runs/tiny/teachers/general-high \\
        --out runs/bench/trl.json [--seeds 0,1,2] [--steps 8] [--configs ours,trl_hf,...] [--preset-small]
    python -m benchmarks.mopd_vs_trl --student /tmp/bench-students/same-15 --teacher /tmp/smolhf \\
        --cell general-low --steps 6 --prompts-per-step 8 --eval-tasks 16 --out runs/bench/real_pair.json

Rows (`--configs`, default all):
  ours        our `train_mopd` (what `mopd distill` runs), vLLM, synchronous
  ours_async  the same one step off (`distill.max_staleness` 1), the sampler a thread of this process
  ours_actor  the same one step off, the sampler in a Ray actor process of its own (`distill.sampler_actor`)
  ours_actor_vllm  ours_actor with the teacher scoring by a prefill in vLLM (`distill.scoring: vllm`): the
              loss is then the sampled-token reverse KL, not the full vocabulary's (judge it by the held-out columns)
  trl_hf      TRL `DistillationTrainer`, HF `generate`
  trl_vllm    TRL `DistillationTrainer`, vLLM colocate (our plugin serves the K3 hybrid)
  gkd         TRL `GKDTrainer` (trl.experimental), HF `generate`, fully on-policy (lmbda 1)
  trl_async   TRL `AsyncDistillationTrainer` (trl.experimental), the peer of ours_async: it samples from a
              student `vllm serve` and scores with a teacher one (`--trl-async-servers`), sparse top-k
              teacher log-probs; TRL loads it with FlashAttention kernels and syncs weights over NCCL

Every trainer distils the same teacher into the same student (any HF causal LM pair sharing a tokenizer:
our K3 models, or a stock model such as SmolLM2 and a student from `mopd init-student`) on one `--cell`
(default general-high): `--prompts-per-step` (16) prompts a step, one sample each, at most the cell's
effort's `max_new_tokens` new tokens (high: 162, low: 82), reverse KL (ours: `full_vocab_kl`, except ours_actor_vllm; TRL:
`beta=1`; trl_async over its sparse support), the recipe's learning rate, constant, on the CPU, at
`--precision`: fp32 throughout (default), or bf16 where the CPU has it (AVX-512 BF16 or AMX): autocast to
bfloat16 with fp32 weights and optimizer state (ours: `distill.precision: bf16`; TRL: `bf16=True`, accelerate's
autocast) and bfloat16 vLLM engines.
Each (row, seed) runs in a fresh process (the held-out KL in another). A run that raises is recorded with
its exception (`Type: message`) and the benchmark goes on; a row with a failed seed holds the first
error and no summary, and is left out of the comparisons.
Three changes to TRL, where its defaults would break the shared inputs or the loss: trl_vllm's colocated
vLLM engine is built with the precision's dtype (TRL passes none, and vLLM's CPU default for a float32
checkpoint is bfloat16); gkd's loss is the mean over its generated tokens (HF's Trainer counts
`num_items_in_batch` from the collated labels, which GKD then replaces with its samples: 0 for prompts, an
infinite loss); at bf16, DistillationTrainer's `compute_loss` runs under bf16 autocast (its loss calls the
models through `_forward_redirection`, which swaps out the `forward` accelerate wrapped in autocast, so with
`bf16=True` alone the student's and teacher's loss forwards ran in fp32 on the CPU; only generation was bf16).

Enforced; a run that breaks one is recorded as failed, with the reason:
- prompts: per seed the parent draws each step's prompts with our trainer's `task_source` (train split)
  and tokenizes them as our rollouts do (`mopd.envs.chat.chat_format`: our markup for a tokenizer with
  our effort tokens, else the model's own chat template with the effort as a system line).
  DistillationTrainer and GKD are handed those token ids in that order (their own tokenization is
  bypassed); trl_async's worker applies the chat template itself to the same messages (the effort line,
  the task). Every run records the prompt ids its generation calls received (ours: `run_rollouts`;
  DistillationTrainer: `_tokenize_prompts`; GKD: its prompt batch; trl_async: each sample's prompt),
  and their digest (sha256, in order) must equal the parent's.
- sampling: temperature 1, top_p 1.0, top_k off, set explicitly and read back from each trainer (ours:
  the arguments of its `run_rollouts` calls; trl_async: its config).
- stop tokens: the chat format's (`<|end|>`/`<|eos|>`, or the tokenizer's EOS such as `<|im_end|>`), given
  to TRL as the student's `generation_config.eos_token_id`, read back (ours: its engine's `generate` calls).
- precision: the trained model's weights float32; each vLLM engine's dtype (ours' sampler and vLLM scorer,
  trl_vllm) float32 or, at bf16, bfloat16; the autocast state of every forward of the student and the HF
  teacher, read on entering their body (decoder): off or, at bf16, bfloat16 and nothing else.
- steps: the number of steps each run timed.
- CPU budget: every run's threads are confined (`sched_setaffinity`) to the same `--threads` CPUs.
  Torch threads per computing thread: `--threads`, except ours_async and ours_actor, whose two computing
  threads (the trainer and the sampler: a thread, or the actor's process) get max(1, threads // 2) each;
  set in each thread and read back (the actor's from the actor, with its CPUs).

Speed. Each run records its steps' spans (ours: `mopd_step`; TRL: `on_step_begin`..`on_step_end`) and
its sampled batches' spans with their completion tokens (ours: `run_rollouts`; DistillationTrainer:
`_generate_and_score_completions`; GKD: `generate_on_policy_outputs`; trl_async: each sample, at the
time its worker enqueued it). The first step warms up (unless it is the only one); the timed window runs
from the start of the next step to the end of the last. tokens/s = the completion tokens of the batches
sampled wholly inside the window over the window's seconds (one step off, the batch a step trains on
was sampled during the step before, so the warm-up step's prefetch is not counted and the last step
samples nothing); s/step = the median timed step. Phases a step: ours, `mopd_step`'s own times; TRL, its
sampled batches' time (sample), its teacher's forwards (score), the rest of the step (train). Held-out KL
(always in fp32, so every row is judged alike) after the last step: the mean over tokens
of KL(student ‖ teacher) over the whole vocabulary, on one completion per prompt that the trained
student samples (HF, temperature 1, fixed seed) for the same `--eval-tasks` prompts of the cell's test
split in every row (default 32; `--eval-tasks 0`: none). Greedy agreement after the last step: over
the tokens of the teacher's greedy completions of those test prompts (HF, computed once per benchmark),
the fraction of positions where the trained student's argmax next token equals the teacher's.
Both are measured once more on the untrained student (`untrained_student`): where every row starts.

Summary: per row, the mean over seeds and its 95% interval (Student t, df = seeds − 1; `mopd.stats`) of
tokens/s, s/step, held-out KL and greedy agreement. The best TRL row has the highest mean tokens/s
among the TRL rows that ran. `ours_over_trl`: per seed ratios (tokens/s, s/step, KL, agreement), then
their mean and t interval, for ours ÷ the best synchronous TRL row (trl_hf, trl_vllm, gkd), ours_async and
ours_actor ÷ trl_async and ÷ the best TRL row; a comparison whose TRL row did not run holds why. A held-out ratio is
undefined where a TRL run scored 0 (agreement can); the paired differences ours − TRL of the held-out KL and
agreement are given beside the ratios. Each finished (row, seed) run is written to OUT.partial.json as it
ends, so a crash loses none; `--resume` reruns only the runs missing there.

`--preset-small` is the speed-only comparison at ~27M parameters: the `small` preset randomly
initialised as the student and a differently seeded copy as the teacher, no held-out KL.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import inspect
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from benchmarks.common import in_fresh_process
from mopd.artifacts import MetricsLog, write_json_atomic, write_text_atomic
from mopd.distill.loss import reverse_kl
from mopd.envs.base import DOMAINS
from mopd.envs.effort import default_effort_specs
from mopd.machine import describe_machine, keep_freed_memory
from mopd.precision import PrecisionError, autocast, check_precision
from mopd.recipe import DistillSpec
from mopd.stats import mean_interval

DEFAULT_CELL = "general-high"
PROMPTS_PER_STEP = 16
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
OURS = ("ours", "ours_async", "ours_actor", "ours_actor_vllm")
PHASES = ("sample", "score", "train", "rollout_wait", "weight_sync")  # our step's phases (`mopd_step`'s time/*)
ONE_STEP_OFF = ("ours_async", "ours_actor", "ours_actor_vllm")  # two computing threads: the trainer and the sampler
SYNC_TRL = ("trl_hf", "trl_vllm", "gkd")
TRL = (*SYNC_TRL, "trl_async")
CONFIGS = (*OURS, *TRL)
PRECISIONS = ("fp32", "bf16")  # ours: `distill.precision`; TRL: TrainingArguments' bf16
ENGINE_DTYPE = {"fp32": "float32", "bf16": "bfloat16"}  # a vLLM engine's dtype at each precision
AUTOCAST = {"fp32": "off", "bf16": "bfloat16"}  # the autocast state every watched HF forward runs under
HELD_OUT = ("held_out_kl", "greedy_agreement")  # measured after the last step, per run
DEFAULT_SERVERS = "http://localhost:8000,http://localhost:8001"
# vLLM's CPU worker replaces torch.set_num_threads with a no-op when its engine starts; this is the real one,
# taken when a run's process imports this module (before any engine).
SET_NUM_THREADS = torch.set_num_threads


# ----------------------------------------------------------------------------- the held-out KL and agreement
def max_new_tokens(cell: str) -> int:
    """A turn's token limit at the cell's effort (what our rollouts sample with)."""
    return default_effort_specs()[cell.split("-")[1]].max_new_tokens


def held_out_tasks(n: int, seed: int = 0, cell: str = DEFAULT_CELL) -> list:
    """`n` tasks of the cell's test split, drawn with `seed` (never the train split the runs draw from)."""
    from mopd.envs import get_env

    domain, effort = cell.split("-")
    return get_env(domain).sample(n, seed, "test", effort)


def held_out_rollouts(model_dir: Path, tasks: list, cell: str, temperature: float, seed: int = 0) -> tuple[list, list]:
    """(prompt ids, completion ids): one completion per task from `model_dir` (HF), in its chat format."""
    from transformers import AutoTokenizer

    from mopd.distill.routing import build_route_table
    from mopd.distill.trainer import envs_for
    from mopd.rollout.engine import create_engine
    from mopd.rollout.episodes import run_rollouts

    engine = create_engine(model_dir, backend="hf")
    try:
        envs = envs_for(build_route_table({cell: 1.0}, {cell: ""}), {}, tasks)
        groups = run_rollouts(engine, AutoTokenizer.from_pretrained(model_dir), envs, tasks,
                              default_effort_specs(), n=1, temperature=temperature, seed=seed)  # fmt: skip
    finally:
        engine.close()
    rollouts = [group[0] for group in groups]
    return [r.prompt_ids for r in rollouts], [r.token_ids for r in rollouts]


def teacher_greedy(teacher: Path, cell: str, eval_tasks: int, budget: dict) -> dict:
    """The reference of the greedy agreement: the teacher's greedy completion of each held-out task."""
    pin(budget)
    prompts, completions = held_out_rollouts(teacher, held_out_tasks(eval_tasks, cell=cell), cell, temperature=0.0)
    return {"prompts": prompts, "completions": completions}


def held_out_kl(student_dir: Path, teacher_dir: Path, tasks: list, seed: int = 0, cell: str = DEFAULT_CELL) -> float:
    """Token-mean KL(student ‖ teacher) on one completion per task sampled by the student (HF, temperature 1)."""
    from mopd.distill.scorer import TeacherScorer

    prompts, completions = held_out_rollouts(student_dir, tasks, cell, temperature=1.0, seed=seed)
    student = TeacherScorer(student_dir).score(prompts, completions, full=True)
    teacher = TeacherScorer(teacher_dir).score(prompts, completions, full=True)
    total = sum(reverse_kl(s.full_logprobs, t.full_logprobs).sum().item() for s, t in zip(student, teacher, strict=True))
    return total / sum(len(c) for c in completions)


def greedy_agreement(student_dir: Path, teacher_dir: Path, reference: dict) -> float:
    """The share of the reference's completion tokens (the teacher's greedy completions) at which the
    student's greedy next token (argmax, teacher forcing) is the teacher's."""
    from mopd.distill.scorer import TeacherScorer

    prompts, completions = reference["prompts"], reference["completions"]
    student = TeacherScorer(student_dir).score(prompts, completions, top_k=1)
    teacher = TeacherScorer(teacher_dir).score(prompts, completions, top_k=1)
    same = sum((s.topk_ids[:, 0] == t.topk_ids[:, 0]).sum().item() for s, t in zip(student, teacher, strict=True))
    return same / sum(len(c) for c in completions)


def measure_eval(student: Path, teacher: Path, cell: str, eval_tasks: int, budget: dict, reference: dict) -> dict:
    """The trained student's held-out KL and greedy agreement with the teacher."""
    pin(budget)
    return {
        "held_out_kl": held_out_kl(student, teacher, held_out_tasks(eval_tasks, cell=cell), cell=cell),
        "greedy_agreement": greedy_agreement(student, teacher, reference),
    }


# ----------------------------------------------------------------------------- the same inputs for every row
def step_prompts(student: Path, seed: int, steps: int, prompts_per_step: int, cell: str = DEFAULT_CELL) -> list[list[dict]]:
    """Each step's prompts as our trainer draws them (`task_source`, train split), tokenized as our
    rollouts tokenize them (`chat_format`): [step][prompt] → {"text", "ids", "messages"}."""
    from transformers import AutoTokenizer

    from mopd.distill.routing import build_route_table
    from mopd.distill.trainer import task_source

    tokenizer = AutoTokenizer.from_pretrained(student)
    spec = DistillSpec(mix={cell: 1.0}, prompts_per_step=prompts_per_step, teacher_actors=False)
    source = task_source(build_route_table(spec.mix, {cell: ""}), spec, seed, {}, None)
    return [[shared_prompt(tokenizer, task) for task in source(step)] for step in range(1, steps + 1)]


def shared_prompt(tokenizer, task) -> dict:
    """A task's prompt ids as `run_rollouts` writes them; their text (the TRL datasets' key, decoded from
    the ids); the chat messages trl_async's worker renders with the tokenizer's template."""
    from mopd.envs.chat import TemplateChat, chat_format, messages_for

    chat = chat_format(tokenizer)
    ids = chat.prompt_ids(task, default_effort_specs()[task.effort].budget_tokens)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    if isinstance(chat, TemplateChat):  # TemplateChat.prompt_ids' messages: the effort line, then any system prompt
        system = chat.system_line(task.effort, default_effort_specs()[task.effort].budget_tokens)
        system = f"{system}\n\n{task.meta['system']}" if task.meta.get("system") else system
        messages = messages_for(task.prompt, system=system)
    else:
        messages = [{"role": "user", "content": text}]
    return {"text": text, "ids": ids, "messages": messages}


def chat_format_name(student: Path) -> str:
    """`NativeChat` (our markup) or `TemplateChat` (the model's own chat template)."""
    from transformers import AutoTokenizer

    from mopd.envs.chat import chat_format

    return type(chat_format(AutoTokenizer.from_pretrained(student))).__name__


def stop_ids_of(student: Path) -> list[int]:
    """The tokens that end a turn in the student's chat format (every row must stop on exactly these)."""
    from transformers import AutoTokenizer

    from mopd.envs.chat import chat_format

    return sorted(chat_format(AutoTokenizer.from_pretrained(student)).stop_ids)


def prompts_digest(prompt_ids: list[list[int]]) -> str:
    """sha256 of a run's prompt token ids, in the order it sampled them."""
    return hashlib.sha256(json.dumps([list(map(int, ids)) for ids in prompt_ids]).encode()).hexdigest()


def thread_budget(config: str, threads: int, cpus: list[int]) -> dict:
    """The CPUs a run is confined to and the torch threads of each of its computing threads."""
    if threads > len(cpus):
        raise ValueError(f"--threads {threads}: this process may use only {len(cpus)} CPUs ({cpus})")
    computing = 2 if config in ONE_STEP_OFF else 1  # the trainer and, one step off, the rollout producer
    return {
        "cpus": sorted(cpus)[:threads],
        "torch_threads": max(1, threads // computing),
        "computing_threads": computing,
    }


def pin(budget: dict) -> None:
    """Confine every thread of this process (and the threads and processes it starts) to the budget's
    CPUs, and set this thread's torch threads. Every row's process keeps its freed memory for reuse
    (`keep_freed_memory`, which `mopd distill` does itself): the allocator is the machine's, not a trainer's."""
    keep_freed_memory()
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task), budget["cpus"])
    SET_NUM_THREADS(budget["torch_threads"])


def affinity() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def check_run(
    run: dict, steps: int, digest: str, budget: dict, stop_ids: list[int] | None = None, precision: str = "fp32"
) -> str | None:
    """Why a finished run broke the benchmark's shared inputs (with `stop_ids`: its stop tokens too), or None."""
    if len(run["steps"]) != steps:
        return f"timed {len(run['steps'])} steps, not {steps}"
    if run["prompts_sha256"] != digest:
        return "sampled from other prompt token ids than the shared ones (or in another order)"
    sampling = {k: (0 if k == "top_k" and v in (None, -1) else float(v)) for k, v in run["sampling"].items()}
    if sampling != SAMPLING:
        return f"sampled with {run['sampling']}, not {SAMPLING}"
    reason = precision_broken(run, precision)
    if reason is not None:
        return reason
    if stop_ids is not None and sorted(set(run.get("stop_ids") or [])) != sorted(stop_ids):
        return f"stopped on tokens {run.get('stop_ids')}, not {stop_ids}"
    for cpus in (run["cpus"], run.get("sampler_cpus", run["cpus"])):
        if cpus != budget["cpus"]:
            return f"ran on CPUs {cpus}, not {budget['cpus']}"
    if set(run["torch_threads"].values()) != {budget["torch_threads"]}:
        return f"torch threads {run['torch_threads']}, not {budget['torch_threads']} per computing thread"
    return None


def precision_broken(run: dict, precision: str) -> str | None:
    """Why a run did not compute at `precision`, or None. Both precisions keep fp32 weights in the trained model;
    bf16 is autocast to bfloat16 around every HF forward that was watched and a bfloat16 vLLM engine, fp32 is no
    autocast and a float32 engine."""
    dtypes = {name: str(d).removeprefix("torch.") for name, d in run["dtypes"].items()}
    engine = ENGINE_DTYPE[precision]
    wanted = {name: "float32" if name == "trained" else engine for name in dtypes}
    if dtypes != wanted:
        return f"dtypes {dtypes}, not {wanted} (--precision {precision})"
    autocast = AUTOCAST[precision]
    broken = {name: seen for name, seen in run.get("autocast", {}).items() if seen != [autocast]}
    if broken or not run.get("autocast"):
        return f"forwards under autocast {run.get('autocast')}, not {autocast} only (--precision {precision})"
    return None


# ----------------------------------------------------------------------------- the runs
class Recorder:
    """What a run's trainer did: step spans, sampled batches, prompt ids, sampling, dtypes, threads."""

    def __init__(self):
        self.steps: list[tuple[float, float]] = []
        self.batches: list[dict] = []
        self.prompt_ids: list[list[int]] = []
        self.sampling: dict = {}
        self.dtypes: dict[str, str] = {}
        self.torch_threads: dict[str, int] = {}
        self.stop_ids: list[int] = []
        self.autocast: dict[str, list[str]] = {}  # model → the autocast states its body ran under
        self.clock = {"sample": 0.0, "score": 0.0}  # this step's seconds so far (TRL's phases)
        self.phases: dict[str, list[float]] = {"sample": [], "score": [], "train": []}

    def thread(self) -> None:
        self.torch_threads[threading.current_thread().name] = torch.get_num_threads()

    def watch_autocast(self, name: str, model) -> None:
        """Record the autocast state each forward of `model`'s body (its decoder, which every trainer calls: TRL's
        loss runs the body alone and projects its hidden states itself) computes under, read on entering the body:
        inside any wrapper of the model's `forward` (accelerate enters its autocast there)."""
        seen = self.autocast.setdefault(name, [])

        def record(module, args):
            state = str(torch.get_autocast_dtype("cpu")).removeprefix("torch.") if torch.is_autocast_enabled("cpu") else "off"
            if state not in seen:
                seen.append(state)

        model.get_decoder().register_forward_pre_hook(record)

    def time_scoring(self, teacher) -> None:
        """Count the teacher's forwards as the step's scoring (TRL scores inside its loss)."""

        def begin(module, args):
            self.scoring_since = time.perf_counter()

        def end(module, args, output):
            self.clock["score"] += time.perf_counter() - self.scoring_since

        teacher.register_forward_pre_hook(begin)
        teacher.register_forward_hook(end)

    def step_begins(self) -> None:
        self.clock = dict.fromkeys(self.clock, 0.0)

    def step_ends(self, start: float, end: float) -> None:
        """A TRL step's span and its phases: sampling (its batches), scoring (the teacher's forwards), and the
        rest, training (the student's forward and backward, the loss, the optimizer)."""
        self.steps.append((start, end))
        for phase, seconds in self.clock.items():
            self.phases[phase].append(seconds)
        self.phases["train"].append(end - start - sum(self.clock.values()))

    def batch(self, start: float, tokens: int, prompt_ids: list[list[int]], end: float | None = None) -> None:
        end = time.perf_counter() if end is None else end
        self.clock["sample"] += end - start
        self.batches.append({"start": start, "end": end, "tokens": int(tokens)})
        self.prompt_ids += [list(map(int, ids)) for ids in prompt_ids]

    def result(self, **extra) -> dict:
        return {
            "steps": self.steps, "batches": self.batches, "prompts_sha256": prompts_digest(self.prompt_ids),
            "sampling": self.sampling, "dtypes": self.dtypes, "autocast": self.autocast, "torch_threads": self.torch_threads,
            "stop_ids": sorted(set(map(int, self.stop_ids))), "cpus": affinity(), **extra,
        }  # fmt: skip


def step_clock(recorder: Recorder):
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()
            recorder.thread()
            recorder.step_begins()

        def on_step_end(self, args, state, control, **kwargs):
            recorder.step_ends(self.start, time.perf_counter())

    return StepClock()


def run_ours(
    student: Path, teacher: Path, out: Path, seed: int, steps: int, budget: dict, prompts: list, extra: dict
) -> dict:
    """Our trainer, observed through wrappers of `mopd.distill.trainer`'s functions (in this process only)."""
    import mopd.distill.scorer as scorer
    import mopd.distill.trainer as trainer

    pin(budget)
    rec = Recorder()
    mopd_step, run_rollouts, create_engine, load_student = (
        trainer.mopd_step, trainer.run_rollouts, trainer.create_engine, trainer.load_student
    )  # fmt: skip
    read_checkpoint, load_vllm_teacher = scorer.TeacherScorer.read_checkpoint, scorer.VllmTeacherScorer.load

    def timed_step(*args, **kwargs):
        start = time.perf_counter()
        rec.thread()
        metrics = mopd_step(*args, **kwargs)
        rec.steps.append((start, time.perf_counter()))
        return metrics

    def observed_rollouts(*args, **kwargs):
        SET_NUM_THREADS(
            budget["torch_threads"]
        )  # the producer thread too (its own pool initializer is vLLM's no-op)
        rec.thread()
        call = inspect.signature(run_rollouts).bind(*args, **kwargs)
        call.apply_defaults()
        rec.sampling = {
            "temperature": call.arguments["temperature"],
            "top_p": call.arguments["top_p"],
            "top_k": 0,
        }
        start = time.perf_counter()
        groups = run_rollouts(*args, **kwargs)
        rollouts = [r for group in groups for r in group]
        rec.batch(start, sum(sum(r.loss_mask) for r in rollouts), [r.prompt_ids for r in rollouts])
        return groups

    def observed_engine(*args, **kwargs):
        engine = create_engine(*args, **kwargs)
        llm = getattr(engine, "llm", None)
        rec.dtypes["vllm"] = str(llm.llm_engine.model_config.dtype) if llm is not None else "not vLLM"
        generate = engine.generate

        def observed_generate(*args, **kwargs):
            rec.stop_ids = list(inspect.signature(generate).bind(*args, **kwargs).arguments["sampling"].stop_token_ids)
            return generate(*args, **kwargs)

        engine.generate = observed_generate
        return engine

    def observed_student(*args, **kwargs):
        student_ = load_student(*args, **kwargs)
        rec.dtypes["trained"] = str(student_.model.dtype)
        rec.watch_autocast("student", student_.model)
        return student_

    def observed_hf_teacher(self):
        read_checkpoint(self)
        rec.watch_autocast("teacher", self.model)

    def observed_vllm_teacher(self):
        load_vllm_teacher(self)
        rec.dtypes["teacher vllm"] = str(self.engine.llm.llm_engine.model_config.dtype)

    class ObservedRemote(trainer.RemoteEngine):
        """The sampler actor (ours_actor): its dtype, threads and CPUs read back from its process."""

        def __init__(self, actor):
            import ray

            super().__init__(actor)
            info = ray.get(actor.describe.remote())
            rec.dtypes["vllm"], rec.torch_threads["sampler actor"] = info["dtype"], info["torch_threads"]
            rec.sampler_cpus = info["cpus"]

        def generate(self, prompt_ids, n=1, sampling=None):
            rec.stop_ids = list(sampling.stop_token_ids)
            return super().generate(prompt_ids, n, sampling)

    trainer.mopd_step, trainer.run_rollouts, trainer.create_engine, trainer.load_student, trainer.RemoteEngine = (
        timed_step, observed_rollouts, observed_engine, observed_student, ObservedRemote
    )  # fmt: skip
    scorer.TeacherScorer.read_checkpoint, scorer.VllmTeacherScorer.load = observed_hf_teacher, observed_vllm_teacher
    cell = extra["cell"]
    spec = DistillSpec(mix={cell: 1.0}, steps=steps, prompts_per_step=len(prompts[0]), teacher_actors=False,
                       checkpoint_every=steps, max_staleness=extra["max_staleness"], temperature=SAMPLING["temperature"],
                       sampler_actor=extra.get("sampler_actor", False), sampler_num_cpus=budget["torch_threads"],
                       scoring=extra.get("scoring", "hf"), full_vocab_kl=extra.get("full_vocab_kl", True),
                       precision=extra["precision"])  # fmt: skip
    final = trainer.train_mopd(student, {cell: teacher}, spec, out, efforts=default_effort_specs(), backend="vllm",
                               seed=seed, progress=False)  # fmt: skip
    records = MetricsLog(out / "metrics.jsonl").records()
    phases = {
        p: [r[f"time/{p}"] for r in records]
        for p in PHASES
    }
    actor = {"sampler_cpus": rec.sampler_cpus} if hasattr(rec, "sampler_cpus") else {}
    return rec.result(phase_seconds=phases, model=str(final), **actor)


def trl_common(out: Path, seed: int, steps: int, prompts: list, precision: str) -> dict:
    """TrainingArguments shared by the TRL rows: the recipe's optimiser settings on the CPU, bf16 mixed precision
    (accelerate's autocast around the student's and teacher's forwards) at --precision bf16."""
    recipe = DistillSpec()
    return dict(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=len(prompts[0]), gradient_accumulation_steps=1,
        learning_rate=recipe.learning_rate, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=recipe.max_grad_norm, bf16=precision == "bf16", gradient_checkpointing=False, use_cpu=True, seed=seed,
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
    )  # fmt: skip


def load_pair(student: Path, teacher: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import mopd.model  # noqa: F401  (registers the K3 hybrid)
    from mopd.envs.chat import chat_format

    tokenizer = AutoTokenizer.from_pretrained(student, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32)
    model.generation_config.eos_token_id = chat_format(tokenizer).stop_ids  # our rollouts' stops
    return tokenizer, model, AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32)


def run_trl(
    student: Path, teacher: Path, out: Path, seed: int, steps: int, budget: dict, prompts: list, extra: dict
) -> dict:
    """TRL's DistillationTrainer, with HF generate or vLLM colocate (`extra["use_vllm"]`)."""
    from datasets import Dataset
    from trl import DistillationConfig, DistillationTrainer

    pin(budget)
    rec = Recorder()
    if extra["use_vllm"]:  # TRL passes vLLM no dtype; vLLM's CPU default for a float32 checkpoint is bfloat16
        import trl.generation.vllm_generation as vllm_generation

        vllm_generation.LLM = functools.partial(vllm_generation.LLM, dtype=ENGINE_DTYPE[extra["precision"]])
    tokenizer, model, teacher_model = load_pair(student, teacher)
    ids_of = {p["text"]: p["ids"] for step in prompts for p in step}
    config = DistillationConfig(
        **trl_common(out, seed, steps, prompts, extra["precision"]), beta=1.0, max_completion_length=max_new_tokens(extra["cell"]),
        shuffle_dataset=False, use_vllm=extra["use_vllm"], vllm_mode="colocate", **SAMPLING, min_p=None, repetition_penalty=1.0,
    )  # fmt: skip

    class ObservedTrainer(DistillationTrainer):
        def compute_loss(self, *args, **kwargs):
            # bf16=True as TRL means it: its loss runs the models through `_forward_redirection`, which replaces
            # the `forward` that accelerate wrapped in autocast, so on the CPU the loss ran in fp32 regardless
            with autocast("cpu", extra["precision"]):
                return super().compute_loss(*args, **kwargs)

        def _tokenize_prompts(self, texts):
            self.prompt_ids = [ids_of[t] for t in texts]  # the shared token ids, not TRL's own tokenization
            return self.prompt_ids, None, {}

        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            output = super()._generate_and_score_completions(inputs)
            rec.batch(start, output["completion_mask"].sum(), self.prompt_ids)
            return output

    trainer = ObservedTrainer(
        model=model, teacher_model=teacher_model, args=config, processing_class=tokenizer, callbacks=[step_clock(rec)],
        train_dataset=Dataset.from_list([{"prompt": p["text"]} for step in prompts for p in step]),
    )  # fmt: skip
    sampler = trainer.vllm_generation if extra["use_vllm"] else trainer.generation_config
    rec.sampling = {k: getattr(sampler, k) for k in SAMPLING}
    rec.stop_ids = trainer.eos_token_ids  # HF generate's eos_token_id and the completion mask (vLLM: the mask)
    rec.dtypes["trained"] = str(trainer.model.dtype)
    rec.watch_autocast("student", trainer.model)
    rec.watch_autocast("teacher", teacher_model)
    rec.time_scoring(teacher_model)
    if extra["use_vllm"]:
        rec.dtypes["vllm"] = str(trainer.vllm_generation.llm.llm_engine.model_config.dtype)
    return train_and_save(trainer, tokenizer, out, rec)


def train_and_save(trainer, tokenizer, out: Path, rec) -> dict:
    """Run a TRL trainer's steps, save the student beside its tokenizer, and return the run's record."""
    trainer.train()
    trainer.save_model(out / "model")
    tokenizer.save_pretrained(out / "model")
    return rec.result(model=str(out / "model"), phase_seconds=rec.phases)


def run_gkd(
    student: Path, teacher: Path, out: Path, seed: int, steps: int, budget: dict, prompts: list, extra: dict
) -> dict:
    """TRL's GKDTrainer, fully on-policy (lmbda 1), reverse KL (beta 1), HF generate."""
    from datasets import Dataset
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    pin(budget)
    rec = Recorder()
    tokenizer, model, teacher_model = load_pair(student, teacher)
    config = GKDConfig(
        **trl_common(out, seed, steps, prompts, extra["precision"]), lmbda=1.0, beta=1.0, temperature=SAMPLING["temperature"],
        max_new_tokens=max_new_tokens(extra["cell"]), train_sampling_strategy="sequential",
        remove_unused_columns=False, dataset_kwargs={"skip_prepare_dataset": True},
    )  # fmt: skip
    pad_id = tokenizer.pad_token_id

    def collate(rows: list[dict]) -> dict:
        """The shared prompt ids, left-padded (GKD generates from `prompts`; with lmbda 1 the rest is replaced)."""
        width = max(len(r["ids"]) for r in rows)
        ids = torch.tensor([[pad_id] * (width - len(r["ids"])) + r["ids"] for r in rows])
        mask = torch.tensor([[0] * (width - len(r["ids"])) + [1] * len(r["ids"]) for r in rows])
        return {"prompts": ids, "prompt_attention_mask": mask, "input_ids": ids, "attention_mask": mask,
                "labels": torch.full_like(ids, -100)}  # fmt: skip

    class ObservedGKD(GKDTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            # the mean over the generated tokens: HF's Trainer counts `num_items_in_batch` from the collated
            # labels, before GKD replaces them with its samples (prompts only: 0, and the loss divides by it)
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch=None)

        def generate_on_policy_outputs(self, model, inputs, generation_config):
            start = time.perf_counter()
            output = GKDTrainer.generate_on_policy_outputs(model, inputs, generation_config)
            rows = [
                ids[m.bool()].tolist() for ids, m in zip(inputs["prompts"], inputs["prompt_attention_mask"], strict=True)
            ]
            rec.batch(start, (output[2] != -100).sum(), rows)
            return output

    trainer = ObservedGKD(
        model=model, teacher_model=teacher_model, args=config, processing_class=tokenizer, data_collator=collate,
        train_dataset=Dataset.from_list([{"ids": p["ids"]} for step in prompts for p in step]), callbacks=[step_clock(rec)],
    )  # fmt: skip
    rec.sampling = {k: getattr(trainer.generation_config, k) for k in SAMPLING}
    eos = trainer.generation_config.eos_token_id
    rec.stop_ids = [eos] if isinstance(eos, int) else list(eos or [])
    rec.dtypes["trained"] = str(trainer.model.dtype)
    rec.watch_autocast("student", trainer.model)
    rec.watch_autocast("teacher", teacher_model)
    rec.time_scoring(teacher_model)
    return train_and_save(trainer, tokenizer, out, rec)


def run_trl_async(
    student: Path, teacher: Path, out: Path, seed: int, steps: int, budget: dict, prompts: list, extra: dict
) -> dict:
    """TRL's AsyncDistillationTrainer with its defaults, against the `vllm serve` servers in `extra["servers"]`
    (student: `VLLM_SERVER_DEV_MODE=1 --weight-transfer-config '{"backend":"nccl"}'`; teacher:
    `--logprobs-mode processed_logprobs`). One step off like ours_async: max_staleness 1, weights synced every step."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.experimental.async_distillation import AsyncDistillationConfig, AsyncDistillationTrainer

    import mopd.model  # noqa: F401  (registers the K3 hybrid)

    pin(budget)
    rec = Recorder()
    student_url, teacher_url = extra["servers"]
    config = AsyncDistillationConfig(
        **trl_common(out, seed, steps, prompts, extra["precision"]), beta=1.0, max_completion_length=max_new_tokens(extra["cell"]),
        dtype="float32", vllm_server_base_url=student_url, teacher_server_urls={"default": teacher_url},
        max_staleness=1, weight_sync_steps=1, **SAMPLING,
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(student, padding_side="left")
    wall_offset = time.time() - time.perf_counter()  # the worker stamps samples with time.time()

    class RecordingQueue:
        """The trainer's rollout queue, noting each sample as it is handed over."""

        def __init__(self, queue):
            self.queue = queue

        def get(self, *args, **kwargs):
            sample = self.queue.get(*args, **kwargs)
            mask = list(map(int, sample.completion_mask))
            first = mask.index(1) if 1 in mask else len(mask)
            end = sample.enqueued_at - wall_offset  # its sampling start is not sent: counted at its end
            rec.batch(end, sum(mask), [list(sample.input_ids[:first])], end=end)
            return sample

        def __getattr__(self, name):
            return getattr(self.queue, name)

    trainer = AsyncDistillationTrainer(
        model=str(student), args=config, processing_class=tokenizer, callbacks=[step_clock(rec)],
        train_dataset=Dataset.from_list([{"prompt": p["messages"]} for step in prompts for p in step]),
    )  # fmt: skip
    trainer.rollout_queue = RecordingQueue(trainer.rollout_queue)
    rec.sampling = {k: getattr(config, k) for k in SAMPLING}
    rec.stop_ids = trainer.eos_token_ids
    rec.dtypes["trained"] = str(trainer.model.dtype)
    rec.watch_autocast("student", trainer.model)
    return train_and_save(trainer, tokenizer, out, rec)


RUNNERS = {
    "ours": (run_ours, {"max_staleness": 0}, "our train_mopd, vLLM, synchronous"),
    "ours_async": (run_ours, {"max_staleness": 1}, "our train_mopd, vLLM, one step off (max_staleness 1)"),
    "ours_actor": (run_ours, {"max_staleness": 1, "sampler_actor": True},
                   "our train_mopd, vLLM, one step off, the sampler in its own Ray actor process"),
    "ours_actor_vllm": (run_ours, {"max_staleness": 1, "sampler_actor": True, "scoring": "vllm", "full_vocab_kl": False},
                        "ours_actor, the teacher scoring by a vLLM prefill, the sampled-token reverse KL"),
    "trl_hf": (run_trl, {"use_vllm": False}, "TRL DistillationTrainer, HF generate"),
    "trl_vllm": (run_trl, {"use_vllm": True}, "TRL DistillationTrainer, vLLM colocate"),
    "gkd": (run_gkd, {}, "TRL GKDTrainer (lmbda 1, beta 1), HF generate"),
    "trl_async": (run_trl_async, {}, "TRL AsyncDistillationTrainer (max_staleness 1), vLLM servers"),
}


# ----------------------------------------------------------------------------- summary
def timed_window(steps: list, batches: list[dict]) -> dict:
    """Speed over the timed window: from the start of the first step after the warm-up one (of the only
    step, if there is one) to the end of the last. Its tokens are those of the batches sampled wholly
    inside it; s/step is the median of its steps."""
    timed = steps[1:] if len(steps) > 1 else steps
    start, end = timed[0][0], timed[-1][1]
    inside = [b for b in batches if b["start"] >= start and b["end"] <= end]
    tokens = sum(b["tokens"] for b in inside)
    return {
        "step_seconds_median": statistics.median(e - s for s, e in timed),
        "window_seconds": end - start,
        "window_tokens": tokens,
        "window_batches": len(inside),
        "completion_tokens_per_s": tokens / (end - start),
    }


def summarise(runs: list[dict]) -> dict:
    """A row over its seeds, or its first failure."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return {"error": f"seed {failed[0]['seed']}: {failed[0]['error']}", "runs": runs}
    row = {
        "completion_tokens_per_s": mean_interval([r["speed"]["completion_tokens_per_s"] for r in runs]),
        "step_seconds": mean_interval([r["speed"]["step_seconds_median"] for r in runs]),
    }
    for key in HELD_OUT:
        if all(key in r for r in runs):
            row[key] = mean_interval([r[key] for r in runs])
    return row | {"runs": runs}


def best_row(rows: dict, names) -> str | None:
    """The row among `names` that ran with the highest mean tokens/s."""
    ran = [n for n in names if n in rows and "error" not in rows[n]]
    return max(ran, key=lambda n: rows[n]["completion_tokens_per_s"]["mean"], default=None)


def ratios(ours: dict, trl: dict) -> dict:
    """Per seed ours ÷ TRL (the same seed: the same prompts), then the mean and t interval over seeds."""
    by_seed = {r["seed"]: r for r in trl["runs"]}
    pairs = [(r, by_seed[r["seed"]]) for r in ours["runs"]]
    out = {
        "completion_tokens_per_s": mean_interval([o["speed"]["completion_tokens_per_s"] / t["speed"]["completion_tokens_per_s"] for o, t in pairs]),
        "step_seconds": mean_interval([o["speed"]["step_seconds_median"] / t["speed"]["step_seconds_median"] for o, t in pairs]),
    }  # fmt: skip
    for key in HELD_OUT:
        if not all(key in o and key in t for o, t in pairs):
            continue
        if any(t[key] == 0 for _, t in pairs):  # an agreement of 0: no ratio; the difference below still holds
            out[key] = {"mean": None, "low": None, "high": None, "undefined": f"a TRL run's {key} is 0"}
        else:
            out[key] = mean_interval([o[key] / t[key] for o, t in pairs])
        out[f"{key}_difference"] = mean_interval([o[key] - t[key] for o, t in pairs])  # ours − TRL, paired by seed
    return out


def comparisons(rows: dict) -> dict:
    """ours ÷ the best synchronous TRL row, each one-step-off row of ours ÷ trl_async and ÷ the best TRL row
    (those selected)."""
    wanted = [("ours", best_row(rows, SYNC_TRL), "best synchronous TRL row"),
              *((row, "trl_async", "AsyncDistillationTrainer") for row in ONE_STEP_OFF),
              *((row, best_row(rows, TRL), "best TRL row") for row in ONE_STEP_OFF)]  # fmt: skip
    out = {}
    for ours, trl, label in wanted:
        if ours not in rows:
            continue
        key = f"{ours} / {label}"
        if trl is None or trl not in rows:
            out[key] = {"error": f"no {label} ran" if trl is None else f"{trl} was not selected (--configs)"}
        elif "error" in rows[trl]:
            out[key] = {"trl": trl, "error": f"{trl} did not run: {rows[trl]['error']}"}
        elif "error" in rows[ours]:
            out[key] = {"trl": trl, "error": f"{ours} did not run: {rows[ours]['error']}"}
        else:
            out[key] = {"trl": trl, **ratios(rows[ours], rows[trl])}
    return out


# ----------------------------------------------------------------------------- the pair
def small_pair(student: Path, work: Path) -> tuple[Path, Path]:
    """The `small` preset, randomly initialised, with the student's tokenizer; a seeded copy as teacher."""
    from transformers import AutoTokenizer

    from mopd.model import K3HybridForCausalLM, preset_config
    from tests.fakes import seeded_copy

    tokenizer = AutoTokenizer.from_pretrained(student)
    torch.manual_seed(0)
    K3HybridForCausalLM(preset_config("small", vocab_size=len(tokenizer))).save_pretrained(
        work / "small-student"
    )
    tokenizer.save_pretrained(work / "small-student")
    return work / "small-student", seeded_copy(work / "small-student", work / "small-teacher", seed=1)


def one_run(
    config: str, student: Path, teacher: Path, work: Path, seed: int, args, prompts: list, digest: str,
    stop_ids: list[int] | None = None, reference: dict | None = None,
) -> dict:
    """One (row, seed) in a fresh process: its record, or the exception or broken input that failed it."""
    run, options, _ = RUNNERS[config]
    cell = getattr(args, "cell", DEFAULT_CELL)
    precision = getattr(args, "precision", "fp32")
    extra = options | {"cell": cell, "precision": precision} | ({"servers": args.trl_async_servers} if config == "trl_async" else {})
    budget = thread_budget(config, args.threads, args.cpus)
    try:
        result = in_fresh_process(
            run, student, teacher, work / f"{config}-{seed}", seed, args.steps, budget, prompts, extra
        )
    except Exception as err:  # the process's exception (or its death), recorded: the other rows go on
        return {"seed": seed, "error": f"{type(err).__name__}: {err}"}
    reason = check_run(result, args.steps, digest, budget, stop_ids, precision)
    if reason is not None:
        return {"seed": seed, "error": f"broke the shared inputs: {reason}", **result}
    result["speed"] = timed_window(result["steps"], result["batches"])
    if not result["speed"]["window_batches"]:
        return {
            "seed": seed,
            "error": "no batch was sampled inside the timed window (one step off: --steps >= 3)",
            **result,
        }
    if args.eval_tasks:
        try:
            result |= in_fresh_process(
                measure_eval, Path(result["model"]), teacher, cell, args.eval_tasks, budget, reference
            )
        except Exception as err:
            return {"seed": seed, "error": f"held-out KL / agreement: {type(err).__name__}: {err}", **result}
    return {"seed": seed, **result}


def bench(student: Path, teacher: Path, work: Path, args: argparse.Namespace) -> tuple[dict, dict]:
    cell = getattr(args, "cell", DEFAULT_CELL)
    prompts = {seed: step_prompts(student, seed, args.steps, args.prompts_per_step, cell) for seed in args.seeds}
    digests = {
        seed: prompts_digest([p["ids"] for step in prompts[seed] for p in step]) for seed in args.seeds
    }
    stop_ids = getattr(args, "stop_ids", None)
    reference = None
    if args.eval_tasks:  # the teacher's greedy completions, once: every row's agreement is on the same tokens
        budget = thread_budget("ours", args.threads, args.cpus)
        reference = in_fresh_process(teacher_greedy, teacher, cell, args.eval_tasks, budget)
        args.reference_tokens = sum(len(c) for c in reference["completions"])
        try:  # where the runs start from: the untrained student's KL and agreement
            args.untrained = in_fresh_process(measure_eval, student, teacher, cell, args.eval_tasks, budget, reference)
        except Exception as err:
            args.untrained = {"error": f"{type(err).__name__}: {err}"}
    rows, done = {}, getattr(args, "done", {})
    for config in args.configs:
        runs = []
        for seed in args.seeds:
            run = done.get((config, seed)) or one_run(
                config, student, teacher, work, seed, args, prompts[seed], digests[seed], stop_ids, reference
            )
            runs.append(run)
            if getattr(args, "out", None) is not None:
                save_partial(args.out, config, run)
        rows[config] = {
            "trainer": RUNNERS[config][2],
            "budget": thread_budget(config, args.threads, args.cpus),
            **summarise(runs),
        }
    return rows, digests


def partial_path(out: Path) -> Path:
    return out.with_suffix(".partial.json")


def save_partial(out: Path, config: str, run: dict) -> None:
    """Each finished (row, seed) run as it ends, so that a crash loses none of them (`--resume` reuses them)."""
    path = partial_path(out)
    saved = json.loads(path.read_text()) if path.is_file() else {}
    runs = [r for r in saved.get(config, []) if r["seed"] != run["seed"]]
    write_json_atomic(path, saved | {config: [*runs, run]})


def finished_runs(out: Path) -> dict[tuple[str, int], dict]:
    """The runs `save_partial` kept that did not fail, by (row, seed)."""
    path = partial_path(out)
    saved = json.loads(path.read_text()) if path.is_file() else {}
    return {(config, r["seed"]): r for config, runs in saved.items() for r in runs if "error" not in r}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--student",
        type=Path,
        help="student K3 checkpoint (with --preset-small: its tokenizer only)",
    )
    parser.add_argument(
        "--render", type=Path, metavar="JSON", help="only write JSON's markdown summary (JSON with .md) from a finished run"
    )
    parser.add_argument(
        "--teacher", type=Path, help="teacher checkpoint sharing the tokenizer (not with --preset-small)"
    )
    parser.add_argument("--out", type=Path, help="JSON file to write (its markdown summary beside it, .md)")
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma-separated rows to run (default all: {','.join(CONFIGS)})",
    )
    parser.add_argument(
        "--seeds", default="0,1,2", help="comma-separated seeds, one run of each row per seed"
    )
    parser.add_argument(
        "--steps", type=int, help="distillation steps per run (default 8; 3 with --preset-small)"
    )
    parser.add_argument(
        "--cell", default=DEFAULT_CELL,
        help=f"the domain-effort cell the prompts (train split) and held-out tasks (test split) come from (default {DEFAULT_CELL})",
    )
    parser.add_argument(
        "--prompts-per-step", type=int, default=PROMPTS_PER_STEP, help="prompts (one sample each) a step"
    )
    parser.add_argument(
        "--eval-tasks",
        type=int,
        help="held-out test-split prompts the KL and agreement are measured on (default 32; 0 with --preset-small)",
    )
    parser.add_argument("--threads", type=int, default=1, help="CPUs (and torch threads) of every run")
    parser.add_argument(
        "--precision", choices=PRECISIONS, default="fp32",
        help="every row's training and scoring: fp32, or bf16 autocast with fp32 weights (ours: distill.precision; "
        "TRL: bf16=True) and bf16 vLLM engines; bf16 needs a CPU with AVX-512 BF16 or AMX",
    )
    parser.add_argument(
        "--trl-async-servers",
        default=DEFAULT_SERVERS,
        help="trl_async's student and teacher `vllm serve` URLs",
    )
    parser.add_argument(
        "--preset-small", action="store_true", help="speed only, ~27M random-init small preset pair"
    )
    parser.add_argument("--work", type=Path, help="keep the runs here (default: a temporary directory)")
    parser.add_argument(
        "--resume", action="store_true",
        help="reuse the finished runs of an earlier invocation with the same --out (OUT.partial.json, written as "
        "each run ends); only the missing or failed (row, seed) runs are run",
    )
    args = parser.parse_args(argv)
    if args.render is not None:
        write_markdown(args.render, json.loads(args.render.read_text()))
        return
    if args.student is None or args.out is None:
        parser.error("give --student and --out (or --render JSON)")
    try:
        args.seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds {args.seeds!r}: give comma-separated integers")
    args.configs = list(dict.fromkeys(c for c in args.configs.split(",") if c))
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown or not args.configs:
        parser.error(f"--configs {','.join(args.configs) or 'empty'}: rows are {', '.join(CONFIGS)}")
    args.trl_async_servers = args.trl_async_servers.split(",")
    if len(args.trl_async_servers) != 2:
        parser.error("--trl-async-servers: give STUDENT_URL,TEACHER_URL")
    args.steps = args.steps or (3 if args.preset_small else 8)
    args.eval_tasks = (0 if args.preset_small else 32) if args.eval_tasks is None else args.eval_tasks
    if min(args.steps, args.prompts_per_step, args.threads) < 1 or args.eval_tasks < 0:
        parser.error("--steps, --prompts-per-step and --threads must be positive, --eval-tasks not negative")
    if args.preset_small and args.eval_tasks:
        parser.error("--preset-small is speed only: no held-out KL (--eval-tasks 0)")
    args.cpus = affinity()
    if args.threads > len(args.cpus):
        parser.error(f"--threads {args.threads}: only {len(args.cpus)} CPUs are available here ({args.cpus})")
    try:
        check_precision(args.precision, "cpu", "--precision")
    except PrecisionError as err:
        parser.error(str(err))
    if (args.teacher is None) != args.preset_small:
        parser.error("give --teacher, or --preset-small (which builds its own teacher)")
    for path in filter(None, [args.student, args.teacher]):
        if not (path / "config.json").is_file():
            parser.error(f"{path}: no config.json, not a checkpoint")
    domain, _, effort = args.cell.partition("-")
    if domain not in DOMAINS or effort not in default_effort_specs():
        parser.error(f"--cell {args.cell!r}: give DOMAIN-EFFORT, of {', '.join(DOMAINS)} and {', '.join(default_effort_specs())}")
    args.stop_ids = stop_ids_of(args.student)
    if not args.resume and partial_path(args.out).is_file():
        partial_path(args.out).unlink()  # a fresh benchmark: no runs of an earlier one mixed in
    args.done = finished_runs(args.out) if args.resume else {}

    with tempfile.TemporaryDirectory(prefix="mopd-bench-trl-") as tmp:
        work = args.work or Path(tmp)
        student, teacher = (
            small_pair(args.student, work) if args.preset_small else (args.student, args.teacher)
        )
        rows, digests = bench(student, teacher, work, args)
        result = {
            "benchmark": "pair-mode distillation, ours vs TRL's trainers" + (" (small preset, speed only)" if args.preset_small else ""),
            "machine": describe_machine() | {"cpus_per_run": args.threads, "cpus": thread_budget("ours", args.threads, args.cpus)["cpus"]},
            "setup": {"student": str(args.student), "teacher": str(args.teacher), "preset": "small" if args.preset_small else "checkpoint",
                      "cell": args.cell, "prompts_per_step": args.prompts_per_step, "samples_per_prompt": 1,
                      "max_new_tokens": max_new_tokens(args.cell), "precision": args.precision, "sampling": SAMPLING,
                      "chat_format": chat_format_name(args.student), "stop_ids": args.stop_ids,
                      "greedy_reference_tokens": getattr(args, "reference_tokens", 0),
                      "steps": args.steps, "seeds": args.seeds, "eval_tasks": args.eval_tasks, "configs": args.configs,
                      "prompts_sha256": digests, "interval": "95%, Student t, df = seeds - 1"},
            "untrained_student": getattr(args, "untrained", None),
            "rows": rows,
            "best_trl": {"synchronous": best_row(rows, SYNC_TRL), "any": best_row(rows, TRL)},
            "ours_over_trl": comparisons(rows),
        }  # fmt: skip
    write_json_atomic(args.out, result)
    write_markdown(args.out, result)
    partial_path(args.out).unlink(missing_ok=True)
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}
                     | {"rows": {n: {k: v for k, v in r.items() if k != "runs"} for n, r in rows.items()}}, indent=2))  # fmt: skip


def write_markdown(out: Path, result: dict) -> None:
    """`out` with .md: the rows, the ratios and our phases, as the README quotes them."""
    write_text_atomic(out.with_suffix(".md"), render(result, out))


def render(result: dict, out: Path) -> str:
    setup, machine = result["setup"], result["machine"]
    command = (f"python -m benchmarks.mopd_vs_trl --student {setup['student']} --teacher {setup['teacher']} "
               f"--cell {setup['cell']} --configs {','.join(setup['configs'])} --threads {machine['cpus_per_run']} "
               f"--seeds {','.join(map(str, setup['seeds']))} --steps {setup['steps']} "
               f"--prompts-per-step {setup['prompts_per_step']} --eval-tasks {setup['eval_tasks']}"
               + (f" --precision {setup['precision']}" if setup.get("precision", "fp32") != "fp32" else "") + f" --out {out}")  # fmt: skip
    lines = [f"# {result['benchmark']}", "", f"Command: `{command}`", "",
             f"Cell {setup['cell']}, {setup['prompts_per_step']} prompts a step, {setup['steps']} steps, "
             f"at most {setup['max_new_tokens']} new tokens, {setup.get('precision', setup.get('dtype'))}, {machine['cpus_per_run']} CPUs a run; "
             f"seeds {', '.join(map(str, setup['seeds']))}; [{setup['interval']}].", "",
             "| row | trainer | tokens/s | s/step | held-out KL | greedy agreement |", "|---|---|---:|---:|---:|---:|"]  # fmt: skip
    metrics = ("completion_tokens_per_s", "step_seconds", "held_out_kl", "greedy_agreement")
    for name, row in result["rows"].items():
        cells = [f"error: {row['error']}"] if "error" in row else [interval_text(row.get(m)) for m in metrics]
        lines.append(f"| {name} | {row.get('trainer', '')} | " + " | ".join(cells) + " |")
    untrained = result.get("untrained_student") or {}
    if "held_out_kl" in untrained:
        lines += ["", f"Untrained student: held-out KL {untrained['held_out_kl']:.3f}, greedy agreement "
                      f"{untrained['greedy_agreement']:.3f}."]  # fmt: skip
    lines += ["", "Ratios, per seed then mean [interval]:", "", "| ours ÷ TRL | tokens/s | s/step | held-out KL | greedy agreement |",
              "|---|---:|---:|---:|---:|"]  # fmt: skip
    for name, ratio in result["ours_over_trl"].items():
        if "error" in ratio:
            lines.append(f"| {name} | {ratio['error']} | | | |")
        else:
            lines.append(f"| {name} ({ratio['trl']}) | " + " | ".join(interval_text(ratio.get(m)) for m in metrics) + " |")
    differences = {name: r for name, r in result["ours_over_trl"].items() if "held_out_kl_difference" in r}
    if differences:
        lines += ["", "Held-out, ours − TRL, per seed then mean [interval]:", "", "| ours − TRL | held-out KL | greedy agreement |",
                  "|---|---:|---:|"]  # fmt: skip
        for name, r in differences.items():
            lines.append(f"| {name} ({r['trl']}) | " + " | ".join(interval_text(r.get(f"{m}_difference")) for m in HELD_OUT) + " |")
    lines += ["", "Phases, median seconds a step after the warm-up step, over seeds (TRL: sample = its generation, "
              "score = its teacher's forwards, train = the rest of its step):", "",
              "| row | " + " | ".join(PHASES) + " |", "|---|" + "---:|" * len(PHASES)]  # fmt: skip
    for name, row in result["rows"].items():
        runs = [r for r in row.get("runs", []) if "phase_seconds" in r]
        if runs:
            medians = [phase_median(runs, p) for p in PHASES]
            lines.append(f"| {name} | " + " | ".join("—" if m is None else f"{m:.3f}" for m in medians) + " |")
    lines += ["", "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()), ""]
    return "\n".join(lines)


def phase_median(runs: list[dict], phase: str) -> float | None:
    """The median of a phase's seconds over the runs' steps after the first, or None where no run times it."""
    seconds = [t for r in runs for t in r["phase_seconds"].get(phase, [])[1:]]
    return statistics.median(seconds) if seconds else None


def interval_text(x: dict | None) -> str:
    if not x or x.get("mean") is None:
        return "—"
    if x.get("low") is None:
        return f"{x['mean']:.3f}"
    return f"{x['mean']:.3f} [{x['low']:.3f}, {x['high']:.3f}]"


if __name__ == "__main__":
    main()
