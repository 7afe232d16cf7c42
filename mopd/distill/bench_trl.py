"""Pair mode side by side with TRL's `DistillationTrainer` (issue #33 item 5).

    python -m mopd.distill.bench_trl --student runs/tiny/base --teacher runs/tiny/teachers/general-high \\
        --out runs/bench/trl.json [--seeds 0,1,2] [--steps 8] [--trl-hf] [--no-async-row] [--preset-small]

Both trainers distil the same teacher into the same student on the general-high cell: 16 train-split
prompts a step, one sample each, at most 162 new tokens (the high effort's limit), temperature 1,
exact reverse KL over the vocabulary (ours: `full_vocab_kl`, the default; TRL: `beta=1`), the
recipe's learning rate with a constant schedule, fp32 on the CPU, one torch thread. Ours samples
with vLLM, synchronously (`ours_vllm`) and one step off (`ours_vllm_async`, `distill.max_staleness`
1); TRL generates with its vLLM colocate mode (our plugin serves the K3 hybrid), or with HF
`generate` under `--trl-hf`.
Each (trainer, seed) runs in a fresh process. A step is timed end to end (sampling, scoring,
training, weight sync); the first step is warm-up and not timed when there are more. Rows give the
median seconds per step, completion tokens per second (the timed steps' tokens over their seconds)
and the held-out KL after the last step: the mean over tokens of KL(student ‖ teacher) over the
whole vocabulary, on one completion per prompt that the trained student samples (HF, temperature 1,
fixed seed) for the same `--eval-tasks` prompts of the cell's test split in every row. Over seeds:
the mean and mean ± 1.96 standard errors (normal approximation). `ours_over_trl` holds the ratios.

`--preset-small` is the speed-only comparison at ~27M parameters: the `small` preset randomly
initialised as the student and a differently seeded copy as the teacher, no held-out KL.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

from mopd.artifacts import MetricsLog, write_json_atomic
from mopd.distill.bench_scoring import in_fresh_process
from mopd.envs.effort import default_effort_specs
from mopd.machine import describe_machine
from mopd.recipe import DistillSpec

CELL = "general-high"
PROMPTS_PER_STEP = 16
Z95 = 1.959964


# ----------------------------------------------------------------------------- the held-out KL
def reverse_kl(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """Per position, KL(student ‖ teacher) = Σ_v p_s(v) (log p_s(v) − log p_t(v)) over the vocabulary."""
    return (student_logprobs.exp() * (student_logprobs - teacher_logprobs)).sum(-1)


def held_out_tasks(n: int, seed: int = 0) -> list:
    from mopd.envs import get_env

    domain, effort = CELL.split("-")
    return get_env(domain).sample(n, seed, "test", effort)


def held_out_kl(student_dir: Path, teacher_dir: Path, tasks: list, seed: int = 0) -> float:
    """Token-mean KL(student ‖ teacher) on one completion per task sampled by the student (HF, temperature 1)."""
    from transformers import AutoTokenizer

    from mopd.distill.routing import build_route_table
    from mopd.distill.scorer import TeacherScorer
    from mopd.distill.trainer import envs_for
    from mopd.rollout.engine import create_engine
    from mopd.rollout.episodes import run_rollouts

    engine = create_engine(student_dir, backend="hf")
    try:
        envs = envs_for(build_route_table({CELL: 1.0}, {CELL: ""}), {}, tasks)
        groups = run_rollouts(engine, AutoTokenizer.from_pretrained(student_dir), envs, tasks,
                              default_effort_specs(), n=1, temperature=1.0, seed=seed)  # fmt: skip
    finally:
        engine.close()
    rollouts = [group[0] for group in groups]
    prompts, completions = [r.prompt_ids for r in rollouts], [r.token_ids for r in rollouts]
    student = TeacherScorer(student_dir).score(prompts, completions, full=True)
    teacher = TeacherScorer(teacher_dir).score(prompts, completions, full=True)
    total = sum(reverse_kl(s.full_logprobs, t.full_logprobs).sum().item() for s, t in zip(student, teacher))
    return total / sum(len(c) for c in completions)


# ----------------------------------------------------------------------------- one run of each trainer
def pinned(threads: int) -> None:
    torch.set_num_threads(threads)


def run_ours(
    student: Path, teacher: Path, out: Path, seed: int, steps: int, threads: int, max_staleness: int
) -> dict:
    from mopd.distill.trainer import train_mopd

    pinned(threads)
    spec = DistillSpec(mix={CELL: 1.0}, steps=steps, prompts_per_step=PROMPTS_PER_STEP, teacher_actors=False,
                       checkpoint_every=steps, max_staleness=max_staleness)  # fmt: skip
    final = train_mopd(student, {CELL: teacher}, spec, out, efforts=default_effort_specs(), backend="vllm",
                       seed=seed, progress=False)  # fmt: skip
    records = MetricsLog(out / "metrics.jsonl").records()
    phases = {
        p: [r[f"time/{p}"] for r in records]
        for p in ("sample", "score", "train", "rollout_wait", "weight_sync")
    }
    return {"step_seconds": [r["time/step"] for r in records], "tokens": [r["tokens"] for r in records],
            "phase_seconds": phases, "model": str(final)}  # fmt: skip


def run_trl(
    student: Path, teacher: Path, out: Path, seed: int, steps: int, threads: int, use_vllm: bool
) -> dict:
    """TRL's DistillationTrainer on the same cell, prompts, token limit, loss and optimiser settings."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DistillationConfig, DistillationTrainer

    import mopd.model  # noqa: F401  (registers the K3 hybrid)
    from mopd.envs import get_env
    from mopd.envs.chat import END, EOS, render_task_prompt

    pinned(threads)
    recipe, effort = DistillSpec(), default_effort_specs()[CELL.split("-")[1]]
    tokenizer = AutoTokenizer.from_pretrained(student, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids([END, EOS])  # our rollouts' stops
    domain, level = CELL.split("-")
    tasks = get_env(domain).sample(PROMPTS_PER_STEP * steps, seed, "train", level)
    config = DistillationConfig(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=PROMPTS_PER_STEP, gradient_accumulation_steps=1,
        learning_rate=recipe.learning_rate, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=recipe.max_grad_norm, beta=1.0, temperature=recipe.temperature,
        max_completion_length=effort.max_new_tokens, bf16=False, gradient_checkpointing=False, use_cpu=True,
        shuffle_dataset=False, seed=seed, logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
        use_vllm=use_vllm, vllm_mode="colocate",
    )  # fmt: skip
    step_seconds: list[float] = []
    tokens: list[int] = []

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            step_seconds.append(time.perf_counter() - self.start)

    class CountingTrainer(DistillationTrainer):
        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            tokens.append(int(output["completion_mask"].sum()))
            return output

    trainer = CountingTrainer(
        model=model, teacher_model=AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32), args=config, processing_class=tokenizer,
        train_dataset=Dataset.from_list([{"prompt": render_task_prompt(t)} for t in tasks]), callbacks=[StepClock()],
    )  # fmt: skip
    trainer.train()
    trainer.save_model(out / "model")
    tokenizer.save_pretrained(out / "model")
    return {"step_seconds": step_seconds, "tokens": tokens, "model": str(out / "model")}


def measure_kl(student: Path, teacher: Path, eval_tasks: int, threads: int) -> float:
    pinned(threads)
    return held_out_kl(student, teacher, held_out_tasks(eval_tasks))


# ----------------------------------------------------------------------------- summary
def speed(run: dict) -> dict:
    timed = slice(1, None) if len(run["step_seconds"]) > 1 else slice(None)  # the first step warms up
    seconds, tokens = run["step_seconds"][timed], run["tokens"][timed]
    return {
        "step_seconds_median": statistics.median(seconds),
        "completion_tokens_per_s": sum(tokens) / sum(seconds),
    }


def mean_interval(values: list[float]) -> dict:
    mean = statistics.fmean(values)
    half = Z95 * statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None
    return {
        "mean": mean,
        "low": None if half is None else mean - half,
        "high": None if half is None else mean + half,
    }


def summarise(runs: list[dict]) -> dict:
    speeds = [speed(r) for r in runs]
    row = {
        "step_seconds_median": statistics.median(s["step_seconds_median"] for s in speeds),
        "completion_tokens_per_s": mean_interval([s["completion_tokens_per_s"] for s in speeds]),
        "runs": runs,
    }
    if all("held_out_kl" in r for r in runs):
        row["held_out_kl"] = mean_interval([r["held_out_kl"] for r in runs])
    return row


def ratios(ours: dict, trl: dict) -> dict:
    out = {
        "completion_tokens_per_s": ours["completion_tokens_per_s"]["mean"]
        / trl["completion_tokens_per_s"]["mean"],
        "step_seconds": ours["step_seconds_median"] / trl["step_seconds_median"],
    }
    if "held_out_kl" in ours and "held_out_kl" in trl:
        out["held_out_kl"] = ours["held_out_kl"]["mean"] / trl["held_out_kl"]["mean"]
    return out


# ----------------------------------------------------------------------------- the pair
def small_pair(student: Path, work: Path) -> tuple[Path, Path]:
    """The `small` preset, randomly initialised, with the student's tokenizer; a seeded copy as teacher."""
    from transformers import AutoTokenizer

    from mopd.distill.fakes import seeded_copy
    from mopd.model import K3HybridForCausalLM, preset_config

    tokenizer = AutoTokenizer.from_pretrained(student)
    torch.manual_seed(0)
    K3HybridForCausalLM(preset_config("small", vocab_size=len(tokenizer))).save_pretrained(
        work / "small-student"
    )
    tokenizer.save_pretrained(work / "small-student")
    return work / "small-student", seeded_copy(work / "small-student", work / "small-teacher", seed=1)


def bench(student: Path, teacher: Path, work: Path, args: argparse.Namespace) -> dict:
    trl_generation = "hf generate" if args.trl_hf else "vllm colocate"
    trainers = {
        "ours_vllm": (run_ours, 0, "vllm"),
        "trl_distillation": (run_trl, not args.trl_hf, trl_generation),
    }
    if args.async_row:
        trainers["ours_vllm_async"] = (run_ours, 1, "vllm, one step off")
    rows = {}
    for name, (run, option, generation) in trainers.items():
        runs = []
        for seed in args.seeds:
            out = work / f"{name}-{seed}"
            result = in_fresh_process(run, student, teacher, out, seed, args.steps, args.threads, option)
            if args.kl:
                result["held_out_kl"] = in_fresh_process(
                    measure_kl, Path(result["model"]), teacher, args.eval_tasks, args.threads
                )
            runs.append({"seed": seed, **result})
        rows[name] = {"generation": generation, **summarise(runs)}
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--student",
        type=Path,
        required=True,
        help="student K3 checkpoint (with --preset-small: its tokenizer only)",
    )
    parser.add_argument(
        "--teacher", type=Path, help="teacher checkpoint sharing the tokenizer (not with --preset-small)"
    )
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument(
        "--seeds", default="0,1,2", help="comma-separated seeds, one run of each trainer per seed"
    )
    parser.add_argument(
        "--steps", type=int, help="distillation steps per run (default 8; 3 with --preset-small)"
    )
    parser.add_argument(
        "--eval-tasks", type=int, default=32, help="held-out test-split prompts the KL is measured on"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every run")
    parser.add_argument(
        "--trl-hf", action="store_true", help="TRL generates with HF generate, not vLLM colocate"
    )
    parser.add_argument(
        "--async-row", action=argparse.BooleanOptionalAction, default=True,
        help="also run ours one step off (distill.max_staleness 1)",
    )  # fmt: skip
    parser.add_argument(
        "--preset-small", action="store_true", help="speed only, ~27M random-init small preset pair"
    )
    parser.add_argument("--work", type=Path, help="keep the runs here (default: a temporary directory)")
    args = parser.parse_args(argv)
    try:
        args.seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds {args.seeds!r}: give comma-separated integers")
    args.steps = args.steps or (3 if args.preset_small else 8)
    args.kl = not args.preset_small
    if min(args.steps, args.eval_tasks, args.threads) < 1:
        parser.error("--steps, --eval-tasks and --threads must be positive")
    if (args.teacher is None) != args.preset_small:
        parser.error("give --teacher, or --preset-small (which builds its own teacher)")
    for path in filter(None, [args.student, args.teacher]):
        if not (path / "config.json").is_file():
            parser.error(f"{path}: no config.json, not a checkpoint")

    with tempfile.TemporaryDirectory(prefix="mopd-bench-trl-") as tmp:
        work = args.work or Path(tmp)
        student, teacher = (
            small_pair(args.student, work) if args.preset_small else (args.student, args.teacher)
        )
        rows = bench(student, teacher, work, args)
        result = {
            "benchmark": "pair-mode distillation, ours vs TRL DistillationTrainer" + (" (small preset, speed only)" if args.preset_small else ""),
            "machine": describe_machine() | {"torch_threads": args.threads},
            "setup": {"student": str(args.student), "teacher": str(args.teacher), "preset": "small" if args.preset_small else "checkpoint",
                      "cell": CELL, "prompts_per_step": PROMPTS_PER_STEP, "samples_per_prompt": 1,
                      "max_new_tokens": default_effort_specs()["high"].max_new_tokens, "dtype": "float32",
                      "steps": args.steps, "seeds": args.seeds, "eval_tasks": args.eval_tasks if args.kl else 0},
            "rows": rows,
            "ours_over_trl": {name: ratios(row, rows["trl_distillation"]) for name, row in rows.items() if name.startswith("ours")},
        }  # fmt: skip
    write_json_atomic(args.out, result)
    print(
        json.dumps(
            {k: v for k, v in result.items() if k != "rows"}
            | {"rows": {n: {k: v for k, v in r.items() if k != "runs"} for n, r in rows.items()}},
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
