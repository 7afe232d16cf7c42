"""The nine teachers on Ray actors, one cell at a time per actor, restarted from the last checkpoint.

    train_teachers(recipe, run_dir, only=["code-max", ...])

Each cell is trained with GRPO (`mopd.rl.grpo`), then scores the base and itself on the
cell's held-out tasks, and writes `runs/<recipe>/teachers/<domain>-<effort>/`: the HF checkpoint,
`metrics.jsonl`, `trained_on.txt` (the content keys of all its RL prompts, written before the
first step), `attempts.jsonl` (one line per attempt: pid, step resumed from) and, last,
`teacher.json` (spec hash + held-out scores), the mark of a finished teacher. A finished
teacher with the same spec is skipped. Ray restarts an actor that died (`max_restarts`) and retries
its cell, which resumes from the newest TRL checkpoint. The driver shows one line per running
teacher (step/steps, reward, seconds per step), read from the teachers' own metrics files, and one
summary line when a teacher finishes; piped to a file, a teacher's line is printed again at most
every 30 s.

Teachers start longest first (by `expected_cost`), as many at a time as the cluster fits: left to
Ray, queued actors start in no fixed order and the longest one often starts last.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from statistics import fmean
from typing import Any

import ray
import torch

from mopd.artifacts import MetricsLog, config_hash, read_json, set_aside, write_json_atomic
from mopd.base.sft import base_checkpoint, check_checkpoint
from mopd.cluster import StatusLines, run_in_slots, slots, start_ray
from mopd.compute import checkpoint_active_parameters, steps_compute, total_compute
from mopd.envs.effort import hashed_effort
from mopd.envs.tokenizer import transcript_text
from mopd.machine import release_freed_memory
from mopd.recipe import CELLS, Recipe, RecipeError, load_teacher_specs, resolve_path
from mopd.rl.evaluate import evaluate_cell
from mopd.rl.grpo import checkpoint_step, last_checkpoint, teacher_effort, teacher_env, train_teacher


def train_teachers(
    recipe: Recipe, run_dir: str | Path, only: list[str] | None = None, recipe_dir: Path | None = None
) -> dict[str, dict[str, Any]]:
    """Train the recipe's teachers (or the `only` subset) in parallel Ray actors; returns cell → teacher.json."""
    run_dir = Path(run_dir)
    specs = select_cells(load_teacher_specs(recipe, recipe_dir), only)
    inits = {cell: init_dir(spec, recipe, run_dir) for cell, spec in specs.items()}  # checked before any work
    todo = {
        cell: spec
        for cell, spec in specs.items()
        if not is_finished(teacher_dir(run_dir, cell), spec_hash(spec, recipe, inits[cell]))
    }
    if todo:
        started = start_ray(recipe)
        try:
            queue = longest_first(todo, recipe)
            TeacherPool(recipe, todo, inits, run_dir).run(queue, slots=teacher_slots(todo.values()))
        finally:
            if started:
                ray.shutdown()
    return {cell: read_json(teacher_dir(run_dir, cell) / "teacher.json") for cell in specs}


def teachers_compute(recipe: Recipe, run_dir: str | Path, recipe_dir: Path | None = None) -> dict[str, Any]:
    """The teachers stage's compute (`mopd.compute`): each teacher's from its metrics.jsonl (wall_s:
    its steps' seconds), and their total."""
    run_dir = Path(run_dir)
    parts = {
        cell: steps_compute(
            MetricsLog(teacher_dir(run_dir, cell) / "metrics.jsonl").records(),
            checkpoint_active_parameters(init_dir(spec, recipe, run_dir)),
            wall_keys=STEP_TIMES,
        )
        for cell, spec in load_teacher_specs(recipe, recipe_dir).items()
    }
    return {**total_compute(parts), "teachers": parts}


def select_cells(specs: dict[str, Any], only: list[str] | None) -> dict[str, Any]:
    if not only:
        return specs
    unknown = [cell for cell in only if cell not in CELLS]
    if unknown:
        raise RecipeError(f"--only: unknown cells {unknown}; cells are {', '.join(CELLS)}")
    missing = [cell for cell in only if cell not in specs]
    if missing:
        raise RecipeError(f"--only: cells {missing} are not in the recipe's teachers.cells {list(specs)}")
    return {cell: specs[cell] for cell in only}


def teacher_dir(run_dir: Path, cell: str) -> Path:
    return run_dir / "teachers" / cell


def spec_hash(spec, recipe: Recipe, init: Path) -> str:
    """What a teacher depends on: its spec, effort, env options, seed, backend, engine limits and its initial weights.

    Spec fields and engine limits at their defaults are left out, so adding a field to the schema keeps finished
    teachers.
    """
    weights = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in init.glob("*.safetensors"))
    limits = recipe.engine_limits()
    return config_hash(
        spec.model_dump(mode="json", exclude_defaults=True),
        hashed_effort(recipe.efforts[spec.effort]),
        recipe.envs,
        recipe.seed,
        recipe.rollout,
        str(init.resolve()),
        weights,
        *([limits] if limits else []),
    )


def is_finished(out_dir: Path, digest: str) -> bool:
    """Finished for this very hash; a directory left by another spec or base is moved to `<cell>.previous/`
    (resuming its checkpoints would continue another spec's run) and the cell starts afresh."""
    if (read_json(out_dir / "spec.json", default={}) or {}).get("spec_hash") != digest:
        if out_dir.is_dir():
            print(f"{out_dir.name}: work of another spec or base moved to {set_aside(out_dir)}", flush=True)
        write_json_atomic(out_dir / "spec.json", {"spec_hash": digest})
    return (out_dir / "teacher.json").is_file()


def init_dir(spec, recipe: Recipe, run_dir: Path) -> Path:
    path = base_checkpoint(recipe, run_dir) if spec.init == "base" else resolve_path(spec.init, None)
    check_checkpoint(path, f"teachers/{spec.cell}.yaml: init")
    return path


class TeacherWorker:
    """A Ray actor that trains teachers one after another: its process imports torch, TRL and vLLM
    once (~13 s on one CPU), not once per cell. Ray restarts a worker that died and retries the cell
    it was training, which resumes from its last checkpoint; a worker may restart as often as its
    cells' `max_restarts` add up to."""

    def run(self, recipe: Recipe, spec, init: str, out_dir: str) -> dict[str, Any]:
        try:
            return run_teacher(recipe, spec, init, out_dir)
        finally:
            # the next cell starts beside this worker's idle memory, not its last cell's peak (SmolLM2: a worker
            # in its third cell held enough that Ray's memory monitor killed its neighbour on a 24 GB machine)
            release_freed_memory()


def start_workers(specs: list, slots: int) -> list:
    """`slots` workers, each with the most CPUs and GPUs any of the specs asks for."""
    restarts = sum(spec.max_restarts for spec in specs)
    worker = ray.remote(TeacherWorker).options(
        num_cpus=max(spec.resources.num_cpus for spec in specs),
        num_gpus=max(spec.resources.num_gpus for spec in specs),
        max_restarts=restarts,
        max_task_retries=restarts,
    )
    return [worker.remote() for _ in range(slots)]


# ------------------------------------------------------------------------------------- scheduling
def longest_first(specs: dict[str, Any], recipe: Recipe) -> list[str]:
    """The cells by decreasing expected cost; prints the start order once."""
    costs = {cell: expected_cost(spec, recipe) for cell, spec in specs.items()}
    queue = sorted(costs, key=costs.get, reverse=True)
    print("teachers start longest first: " + ", ".join(f"{cell} ({costs[cell]:,.0f})" for cell in queue))
    return queue


def expected_cost(spec, recipe: Recipe, n_tasks: int = 4) -> float:
    """Characters the teacher trains on: steps × rollouts per step × chars of an expert transcript."""
    env = teacher_env(spec, recipe)
    try:
        tasks = env.sample(n_tasks, recipe.seed, "train", spec.effort)
        sample_chars = fmean(len(transcript_text(env, task)) for task in tasks)
    finally:
        if hasattr(env, "close"):
            env.close()
    return spec.steps * spec.prompts_per_step * spec.group_size * sample_chars


def teacher_slots(specs) -> int:
    """How many teachers the cluster runs at once: as many as fit when each needs the most any spec asks."""
    return slots(spec.resources for spec in specs)


class TeacherPool:
    """The Ray side of `run_in_slots`: a worker actor per slot, each cell on the next idle one."""

    def __init__(self, recipe: Recipe, specs: dict[str, Any], inits: dict[str, Path], run_dir: Path):
        self.recipe, self.specs, self.inits, self.run_dir = recipe, specs, inits, run_dir
        self.running: dict[Any, tuple[str, Any]] = {}  # run ref -> (cell, worker)
        self.started_at: dict[str, float] = {}

    def run(self, queue: list[str], slots: int) -> None:
        self.idle = start_workers([self.specs[cell] for cell in queue], min(slots, len(queue)))
        workers = list(self.idle)
        try:
            with StatusLines() as self.status:
                run_in_slots(queue, slots, self.start, self.wait_one)
        finally:
            for worker in workers:
                ray.kill(worker)

    def start(self, cell: str) -> None:
        worker = self.idle.pop()
        out_dir = teacher_dir(self.run_dir, cell)
        ref = worker.run.remote(self.recipe, self.specs[cell], str(self.inits[cell]), str(out_dir))
        self.running[ref] = (cell, worker)
        self.started_at[cell] = time.monotonic()
        self.status.update(cell, progress_line(cell, self.specs[cell].steps, []))

    def wait_one(self) -> str:
        while True:
            done, _ = ray.wait(list(self.running), timeout=1.0)
            for cell, _ in self.running.values():
                self.status.update(cell, progress_line(cell, self.specs[cell].steps, self.records(cell)))
            if done:
                cell, worker = self.running.pop(done[0])
                result = ray.get(done[0])  # a teacher that failed past its restarts raises here
                seconds = time.monotonic() - self.started_at[cell]
                self.status.finish(cell, summary_line(cell, self.records(cell), seconds, result))
                self.idle.append(worker)
                return cell

    def records(self, cell: str) -> list[dict[str, Any]]:
        return MetricsLog(teacher_dir(self.run_dir, cell) / "metrics.jsonl").records()


# ------------------------------------------------------------------------------------- one teacher
def run_teacher(recipe: Recipe, spec, init: str, out_dir: str) -> dict[str, Any]:
    """Train one cell, resuming from the newest checkpoint in `out_dir`; returns its teacher.json."""
    out_dir, init = Path(out_dir), Path(init)
    torch.set_num_threads(max(1, int(spec.resources.num_cpus)))
    resumed_from = checkpoint_step(last_checkpoint(out_dir / "checkpoints"))
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / "attempts.jsonl").open("a") as f:
        f.write(json.dumps({"pid": os.getpid(), "resumed_from": resumed_from, "time": time.time()}) + "\n")
    train_teacher(spec, recipe, init, out_dir)
    summary = {
        "spec": spec.cell,
        "spec_hash": spec_hash(spec, recipe, init),
        "init": str(init),
        "steps": spec.steps,
        **held_out_scores(spec, recipe, init, out_dir),
    }
    shutil.rmtree(out_dir / "checkpoints", ignore_errors=True)
    write_json_atomic(out_dir / "teacher.json", summary)
    return summary


def held_out_scores(spec, recipe: Recipe, init: Path, out_dir: Path) -> dict[str, Any]:
    if spec.eval_tasks == 0:
        return {}
    env, effort = teacher_env(spec, recipe), teacher_effort(spec, recipe)
    base, teacher = (
        evaluate_cell(model_dir, spec, recipe, env, effort, recipe.rollout) for model_dir in (init, out_dir)
    )
    return {"base": base, "teacher": teacher, "margin": teacher["reward"] - base["reward"]}


# ------------------------------------------------------------------------------------- progress
# Each teacher's own metrics.jsonl (one line per optimizer step) is its progress channel: the
# driver reads it, so a restarted actor needs nothing re-sent, and the file says what the line says.
STEP_TIMES = ("time_generate", "time_verify", "time_train")


def progress_line(cell: str, steps: int, records: list[dict[str, Any]]) -> str:
    """`code-max      step 12/40  reward 0.412  4.3 s/step`, or `starting` before its first step."""
    if not records:
        return f"{cell:<13} starting"
    last = records[-1]
    return (
        f"{cell:<13} step {last['step']}/{steps}  reward {last.get('reward', 0.0):.3f}  "
        f"{seconds_per_step(records):.1f} s/step"
    )


def summary_line(cell: str, records: list[dict[str, Any]], seconds: float, result: dict[str, Any]) -> str:
    """`code-max      done: 40 steps  reward 0.210 → 0.480  612 s  held-out 0.38 → 0.52`."""
    if records:
        first, last = records[0].get("reward", 0.0), records[-1].get("reward", 0.0)
        steps = records[-1]["step"]
        text = f"{cell:<13} done: {steps} step{'s' * (steps != 1)}  reward {first:.3f} → {last:.3f}  {seconds:.0f} s"
    else:
        text = f"{cell:<13} done: no steps  {seconds:.0f} s"
    if "margin" in result:
        text += f"  held-out {result['base']['reward']:.2f} → {result['teacher']['reward']:.2f}"
    return text


def seconds_per_step(records: list[dict[str, Any]]) -> float:
    return fmean(sum(record.get(name, 0.0) for name in STEP_TIMES) for record in records)
