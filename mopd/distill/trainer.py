"""MOPD: the student samples on-policy from a mix of cells; each sample is scored by its own teacher.

    check routes        every cell of the mix has a teacher sharing the student's tokenizer
    for each step:
        tasks    ← cells by the allocation (the mix, or the student's gap to each teacher), a task from each cell's environment
        rollouts ← run_rollouts(student engine, distill.temperature)  token ids + sampler log-probs
        scores   ← each rollout's teacher scores its exact token ids  (prefill only)
        loss     ← mopd_loss(trainer's recomputed log πθ, sampler log-probs, teacher log-probs)
        optimizer step, MoE bias update, engine.update_weights       the next batch is on-policy
        metrics per cell; a checkpoint every N steps (resume continues from the last one)
        a learning-curve snapshot every `curve_every` steps (`curve/step-N/`, for the `curves` stage)

With `distill.max_staleness` ≥ 1 sampling runs one step off (`mopd.distill.async_rollouts`): while
step n scores and trains, a background thread samples step n+1 from the weights before step n's
update, so those rollouts lag one policy version (the first step after a start or resume has no
batch in flight and lags 0). The importance weights (`distill.importance`, IcePop/TIS) correct that
gap, on every token of the sampled-token loss (`full_vocab_kl: false`), whose advantage log πT − log πθ
takes log πθ from this step's forward of the current student, not the sampler's (a lagged sample is
rescored; its teacher's scores are kept; `distill.rescore: false` keeps the sampler's, to measure it); with the exact full-vocabulary
KL (`full_vocab_kl: true`) the KL term is computed under the trainer's policy and the importance
weights touch only the ORM term. Each step logs `lag/<k>` (rollouts k versions behind the trainer)
and `is_out_of_bounds` (the share of tokens IcePop masks). `max_staleness: 0` is the synchronous loop.
With `distill.sampler_actor` the sampling engine runs in a Ray actor of its own (`RemoteEngine`): the
producer thread only waits on it, so generation and this process's scoring and training use separate cores.

The stage (`run_distill`) reads the base and the nine teachers of a recipe run and writes the
student to `<run>/distill/model`, with `metrics.jsonl`, `checkpoints/` and `trained_on.txt` (the
content keys of every step's prompts, updated before the step runs) and `allocation.png` (each step's
share of prompts per cell, `mopd.distill.allocation`) beside it. With
`distill.trainer_workers` > 1 the student trains sharded with FSDP2 across Ray workers
(`mopd.distill.sharded`): the same step, the same checkpoints.
"""

from __future__ import annotations

import itertools
import random
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from tqdm import tqdm

from mopd.artifacts import MetricsLog, atomic_dir, checkpoint_in, curve_snapshot, read_json, write_json_atomic
from mopd.compute import checkpoint_active_parameters, cpu_seconds, steps_compute
from mopd.distill.allocation import Allocation, step_allocation, write_allocation_plot
from mopd.distill.async_rollouts import RolloutProducer
from mopd.distill.routing import RouteTable, build_route_table, cell_of, check_teachers
from mopd.distill.scorer import TeacherPool
from mopd.distill.student import Student, scheduled_learning_rate
from mopd.envs import get_env, prompt_contents
from mopd.envs.base import DOMAINS, Task
from mopd.envs.effort import EffortSpec
from mopd.envs.splits import TRAINED_TEXT, read_trained_on, task_keys, write_trained_on
from mopd.machine import keep_freed_memory, resolve_device
from mopd.model.export import qat_start
from mopd.precision import check_precision
from mopd.recipe import DistillSpec, sampler_dtype
from mopd.rollout.engine import create_engine
from mopd.rollout.episodes import Rollout, run_rollouts
from mopd.rollout.interface import RolloutEngine
from mopd.rollout.ray_actor import RemoteEngine, rollout_actor

TaskSource = Callable[[int], list[Task]]  # step → the step's prompts


class StalenessError(RuntimeError):
    """A sample came from a policy older than `distill.max_staleness` allows."""


# ----------------------------------------------------------------------------- the stage
def run_distill(ctx) -> dict:
    """Pipeline stage: the recipe's student (the base by default) distilled from its teachers and, with
    `distill.eval_tasks` > 0, scored on every cell's held-out tasks beside its teacher (`eval.json`);
    returns its compute."""
    recipe, spec = ctx.recipe, ctx.recipe.distill
    (ctx.dir / "eval.json").unlink(missing_ok=True)  # never left from an earlier run beside this one's student
    student, teachers = distill_models(recipe, ctx.run_dir, ctx.inputs)
    final = train_mopd(
        student, teachers, spec, ctx.dir,
        efforts=recipe.efforts, env_options={d: recipe.env_options(d) for d in DOMAINS}, backend=recipe.rollout,
        seed=recipe.seed, device=recipe.device, ray_address=recipe.ray.address, max_model_len=recipe.max_model_len,
    )  # fmt: skip
    if spec.eval_tasks:
        write_json_atomic(ctx.dir / "eval.json", held_out_comparison(recipe, final, teachers))
    records = MetricsLog(ctx.dir / "metrics.jsonl").records()
    return distill_compute(records, student, teachers, reference_scores=spec.scores_a_reference)


def distill_models(recipe, run_dir: Path, inputs: Mapping[str, Path]) -> tuple[Path, dict[str, Path]]:
    """The checkpoint a run's MOPD starts from, and the teacher of each cell of its mix."""
    spec = recipe.distill
    base = recipe.base.as_is or inputs.get("base", run_dir / "base")
    teachers_dir = Path(inputs.get("teachers", run_dir / "teachers"))
    teachers = {cell: Path(spec.teachers.get(cell) or checkpoint_in(teachers_dir / cell)) for cell in spec.mix if spec.mix[cell] > 0}
    return Path(spec.student or checkpoint_in(base)), teachers


def distill_compute(
    records: list[dict], student: Path, teachers: Mapping[str, str | Path], reference_scores: bool = False
) -> dict:
    """The stage's compute (`mopd.compute`) from its steps: each cell's scored tokens at its teacher's N, and
    with `reference_scores` (ExOPD) the frozen initial student's forward over every trained sequence."""
    teacher_params = {cell: checkpoint_active_parameters(path) for cell, path in teachers.items()}
    compute = steps_compute(records, checkpoint_active_parameters(student), wall_keys=("time/step",))
    scored = {cell: sum(r.get(f"{cell}/tokens_scored", 0) for r in records) for cell in teachers}
    compute["flops"] += sum(2 * teacher_params[cell] * tokens for cell, tokens in scored.items())
    if reference_scores:
        compute["reference_tokens_scored"] = compute["tokens_trained"]
        compute["flops"] += 2 * compute["active_params"] * compute["tokens_trained"]
    distinct = set(teacher_params.values())
    compute["teacher_active_params"] = distinct.pop() if len(distinct) == 1 else teacher_params
    return compute


def held_out_comparison(recipe, student: Path, teachers: Mapping[str, str | Path]) -> dict:
    """Per cell: the student's held-out reward and thinking tokens beside its teacher's."""
    from mopd.recipe import TeacherSpec
    from mopd.rl.evaluate import evaluate_cell

    spec, out = recipe.distill, {}
    envs = {d: get_env(d, **recipe.env_options(d)) for d in {cell.split("-")[0] for cell in teachers}}
    for cell, teacher in teachers.items():
        domain, effort = cell.split("-")
        cell_spec = TeacherSpec(domain=domain, effort=effort, eval_tasks=spec.eval_tasks, eval_samples=1)
        scores = {
            name: evaluate_cell(Path(path), cell_spec, recipe, envs[domain], recipe.efforts[effort], recipe.rollout)
            for name, path in (("student", student), ("teacher", teacher))
        }
        scores["student_over_teacher"] = scores["student"]["reward"] / max(scores["teacher"]["reward"], 1e-9)
        out[cell] = scores
    return out


# ----------------------------------------------------------------------------- the loop
def train_mopd(
    student_dir: str | Path,
    teacher_dirs: Mapping[str, str | Path],
    spec: DistillSpec,
    out_dir: str | Path,
    *,
    efforts: Mapping[str, EffortSpec],
    env_options: Mapping[str, dict] | None = None,
    tasks: list[Task] | None = None,
    backend: str = "vllm",
    seed: int = 0,
    device: str = "auto",
    ray_address: str | None = None,
    progress: bool = True,
    max_model_len: int = 2048,
) -> Path:
    """Distil the teachers into the student; returns the final student checkpoint (`out_dir/model`).
    `max_model_len`: the sampling engine's tokens per sequence (the recipe's)."""
    out_dir = Path(out_dir)
    table = build_route_table(spec.mix, dict(teacher_dirs))
    check_teachers(table, student_dir)
    student_dir = qat_start(student_dir, spec.qat and spec.qat.routed_expert_mx, out_dir, "distill.qat")

    start_step, start_dir = last_checkpoint(out_dir)
    device = resolve_device(device)
    keep_freed_memory()  # each step allocates the same large tensors again: reuse them, do not page them in anew
    teacher_gpus = spec.teacher_num_gpus if device == "cuda" else 0.0
    for where in sorted({device, "cuda" if teacher_gpus else "cpu"}):  # the student's device and the teachers'
        check_precision(spec.precision, where, "distill.precision")
    student = load_student(start_dir or Path(student_dir), spec, Path(student_dir), device, ray_address)
    engine = sampling_engine(start_dir or Path(student_dir), spec, backend, max_model_len, ray_address)
    teachers = TeacherPool(
        table, spec.teacher_actors, spec.teacher_num_cpus, teacher_gpus,
        ray_address=ray_address, max_resident=spec.max_resident_teachers, precision=spec.precision,
        scoring=spec.scoring, packing=spec.packing, max_model_len=max_model_len,
    )  # fmt: skip
    log = MetricsLog(out_dir / "metrics.jsonl")
    log.resume_after(start_step)
    allocation = Allocation(table, spec, log.records())
    source = task_source(table, spec, seed, env_options or {}, tasks, allocation)
    envs = envs_for(table, env_options or {}, tasks)
    trained_on = (read_trained_on(out_dir) or set()) if start_step else set()
    trained_text = (read_trained_on(out_dir, TRAINED_TEXT) or set()) if start_step else set()

    def rollouts_of(step: int) -> list[Rollout]:
        prompts = source(step)
        trained_on.update(task_keys(prompts))
        trained_text.update(prompt_contents(prompts))
        write_trained_on(out_dir, trained_on)
        write_trained_on(out_dir, trained_text, TRAINED_TEXT)
        groups = run_rollouts(
            engine, student.tokenizer, envs, prompts, efforts,
            n=spec.samples_per_prompt, temperature=spec.temperature, seed=seed * 1_000_003 + step,
        )  # fmt: skip
        return [r for group in groups for r in group]

    producer = RolloutProducer(rollouts_of, overlap=spec.max_staleness > 0)
    bar = tqdm(total=spec.steps, initial=start_step, desc="mopd", disable=not progress, dynamic_ncols=True)
    try:
        for step in range(start_step + 1, spec.steps + 1):
            metrics = mopd_step(step, student, engine, teachers, producer, spec, version_offset=start_step)
            log.log(step, **metrics)
            allocation.observe(step, metrics)
            bar.update(1)
            bar.set_postfix(kl=f"{metrics['reverse_kl']:.3f}", reward=f"{metrics['reward']:.2f}")
            # the snapshot before the checkpoint: a run killed between them resumes after this step
            if spec.curve_every and step % spec.curve_every == 0 and step < spec.steps:  # the last is model/
                with atomic_dir(curve_snapshot(out_dir, step)) as tmp:
                    student.save(tmp)
            if step % spec.checkpoint_every == 0 or step == spec.steps:
                save_checkpoint(out_dir, step, student)
    finally:
        producer.close()
        engine.close()  # now, not by the garbage collector under the next engine of this process
        bar.close()
        teachers.close()
        student.close()
    final = out_dir / "model"
    with atomic_dir(final) as tmp:
        student.save(tmp)
    if spec.steps:
        write_allocation_plot(log.records(), list(table.weights), out_dir / "allocation.png")
    return final


def sampling_engine(model_dir: Path, spec: DistillSpec, backend: str, max_model_len: int, ray_address: str | None) -> RolloutEngine:
    """The student's sampler: in this process, or (`sampler_actor`) in a Ray actor of its own, where the
    one-step-off batch generates on another core while this process scores and trains."""
    # a bf16 sampler's gap to the trainer is corrected as any other (`importance`)
    options = {"backend": backend, "max_model_len": max_model_len, "dtype": sampler_dtype(spec.precision)}
    if not spec.sampler_actor:
        return create_engine(model_dir, **options)
    from mopd.cluster import connect_ray

    connect_ray(ray_address)
    return RemoteEngine(rollout_actor(model_dir, num_cpus=spec.sampler_num_cpus, **options))


def mopd_step(step, student, engine, teachers, producer: RolloutProducer, spec, version_offset) -> dict:
    clock, cpu_start = [time.perf_counter()], cpu_seconds()
    rollouts = producer.take(step)
    if step < spec.steps:
        producer.start(step + 1)  # with overlap: sampled from the current weights while this step trains
    # Too stale is refused, not re-sampled: the producer runs at most one step ahead, so a larger lag
    # means the engine was updated behind the loop's back, which a re-sample would hide.
    check_staleness(rollouts, engine.policy_version, spec.max_staleness)
    lags = [engine.policy_version - r.policy_version for r in rollouts]
    clock.append(time.perf_counter())

    cells = [cell_of(r.task) for r in rollouts]
    scores = teachers.score(cells, [r.prompt_ids for r in rollouts], [r.token_ids for r in rollouts], full=spec.full_vocab_kl)
    clock.append(time.perf_counter())

    learning_rate = scheduled_learning_rate(spec, step)
    student.set_learning_rate(learning_rate)
    metrics = student.train_step(rollouts, scores, cells)
    clock.append(time.perf_counter())

    producer.wait()  # the engine must not be generating while its weights are replaced
    clock.append(time.perf_counter())
    engine.update_weights(student.model.state_dict())
    clock.append(time.perf_counter())
    names = ("sample", "score", "train", "rollout_wait", "weight_sync")
    phases = dict(zip(names, (b - a for a, b in itertools.pairwise(clock)), strict=True))
    return {
        **metrics,
        "learning_rate": learning_rate,
        **step_tokens(rollouts, cells),
        "cpu_s": cpu_seconds() - cpu_start,
        **{f"time/{name}": seconds for name, seconds in phases.items()},
        "time/step": clock[-1] - clock[0],
        "teacher_tokens_per_s": metrics["tokens"] / max(phases["score"], 1e-9),
        "policy_version": version_offset + min(r.policy_version for r in rollouts),
        **{f"lag/{lag}": lags.count(lag) for lag in range(max(lags) + 1)},
        **step_allocation(cells, [cell for cell, weight in spec.mix.items() if weight > 0]),
    }


def step_tokens(rollouts: list[Rollout], cells: list[str]) -> dict[str, int]:
    """What the step sampled, trained on and had its teachers score (`mopd.compute`), and each cell's scored."""
    lengths = [len(r.prompt_ids) + len(r.token_ids) for r in rollouts]
    scored = {f"{cell}/tokens_scored": 0 for cell in cells}
    for cell, length in zip(cells, lengths, strict=True):
        scored[f"{cell}/tokens_scored"] += length
    sampled = sum(sum(r.loss_mask) for r in rollouts)
    return {"tokens_sampled": sampled, "tokens_trained": sum(lengths), "tokens_scored": sum(lengths), **scored}


def check_staleness(rollouts: list[Rollout], current_version: int, max_staleness: int) -> None:
    for rollout in rollouts:
        lag = current_version - rollout.policy_version
        if lag > max_staleness:
            raise StalenessError(
                f"sample of task {rollout.task.id} came from policy version {rollout.policy_version}, "
                f"{lag} behind the current {current_version}; distill.max_staleness is {max_staleness}"
            )


# ----------------------------------------------------------------------------- prompts
def task_source(
    table: RouteTable, spec: DistillSpec, seed: int, env_options, tasks: list[Task] | None,
    allocation: Allocation | None = None,
) -> TaskSource:
    """The prompts of each step: a fixed task list cycled, or cells drawn by the allocation (default: the mix's)."""
    if tasks is not None:
        if not tasks:
            raise ValueError("distill: the task list is empty")
        return lambda step: [tasks[(step * spec.prompts_per_step + i) % len(tasks)] for i in range(spec.prompts_per_step)]
    domains = {cell.split("-")[0] for cell in table.routes}
    envs = {domain: get_env(domain, **env_options.get(domain, {})) for domain in domains}
    allocation = allocation or Allocation(table, spec)

    def draw(step: int) -> list[Task]:
        rng = random.Random(seed * 1_000_003 + step)
        cells = allocation.cells(step, rng)
        out = []
        for cell in sorted(set(cells)):
            domain, effort = cell.split("-")
            out += envs[domain].sample(cells.count(cell), seed=rng.randrange(2**31), split="train", effort=effort)
        rng.shuffle(out)
        return out

    return draw


class TaskFileEnv:
    """Verifies a user's task-file rows with the verifier each row names. A domain's own verifier
    ("code", "general") is that domain's env built with the run's options, so code rows are judged in
    the sandbox the run asked for (`allow_degraded` included)."""

    def __init__(self, env_options: dict[str, dict]):
        self.env_options, self.domain_envs = env_options, {}

    def verify(self, task: Task, completion):
        from mopd.envs.data import verify_task

        verifier = task.meta.get("verifier", task.domain)
        if verifier not in DOMAINS:
            return verify_task(task, completion)
        if verifier not in self.domain_envs:
            self.domain_envs[verifier] = get_env(verifier, **self.env_options.get(verifier, {}))
        return self.domain_envs[verifier].verify(task, completion)


def envs_for(table: RouteTable, env_options, tasks: list[Task] | None) -> dict:
    domains = {cell.split("-")[0] for cell in table.routes}
    if tasks is not None:
        return {d: get_env(d, **env_options.get(d, {})) if d == "agent" else TaskFileEnv(env_options) for d in domains}
    return {d: get_env(d, **env_options.get(d, {})) for d in domains}


# ----------------------------------------------------------------------------- the student
def load_student(model_dir: Path, spec: DistillSpec, reference_dir: Path, device: str, ray_address: str | None):
    """The in-process student, or with `trainer_workers` > 1 the one sharded across Ray workers."""
    if spec.trainer_workers == 1:
        return Student.load(model_dir, spec, reference_dir=reference_dir, device=device)
    from mopd.distill.sharded import ShardedStudent  # Student under FSDP2 across Ray workers

    return ShardedStudent.load(model_dir, spec, reference_dir=reference_dir, device=device, ray_address=ray_address)


def save_checkpoint(out_dir: Path, step: int, student: Student) -> Path:
    """`checkpoints/step-NNNNNN`: model, tokenizer, optimizer state; older checkpoints are removed."""
    path = out_dir / "checkpoints" / f"step-{step:06d}"
    with atomic_dir(path) as tmp:
        student.save(tmp)
        torch.save(student.optimizer_state(), tmp / "optimizer.pt")
        write_json_atomic(tmp / "trainer_state.json", {"step": step})
    for old in path.parent.glob("step-*"):
        if old != path:
            shutil.rmtree(old, ignore_errors=True)
    return path


def last_checkpoint(out_dir: Path) -> tuple[int, Path | None]:
    for path in sorted((out_dir / "checkpoints").glob("step-*"), reverse=True):
        state = read_json(path / "trainer_state.json")
        if state is not None:
            return int(state["step"]), path
    return 0, None
