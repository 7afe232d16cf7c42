"""The stage graph of a recipe run: each stage is a directory, skipped when already complete.

A stage is complete when its directory holds `stage.json` with the hash of the stage's config and
of the stages it reads. Changing a field re-runs that stage and everything downstream, from
scratch: work in its directory from other inputs is moved to `<stage>.previous/` first, so no
checkpoint of the old config is resumed. A crash re-runs only the unfinished stage, which
resumes from its own last checkpoint (`started.json` names the inputs that checkpoint is for).

`stage.json` also holds the stage's `compute` (`mopd.compute`): the tokens and FLOP estimate the
stage returns, `wall_s` (its seconds in this run) and `cpu_s`: the training stages' own count over
their steps (`cpu_s_of` says which processes), else the pipeline's process and its waited-for
children over the whole stage.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from mopd.artifacts import config_hash, read_json, set_aside, write_json_atomic
from mopd.compute import cpu_seconds, device_of
from mopd.envs.effort import hashed_effort
from mopd.envs.sandbox import describe_backend, resolve_backend
from mopd.machine import release_freed_memory
from mopd.recipe import Recipe

console = Console(stderr=True)

StageFn = Callable[["StageContext"], "dict[str, Any] | None"]  # returns what it knows of its compute


@dataclass
class Stage:
    name: str  # also its directory under the run, e.g. "base" or "teachers/code-max"
    config: dict[str, Any]  # everything in the recipe this stage's output depends on
    run: StageFn
    needs: tuple[str, ...] = ()
    checks_own_parts: bool = False  # keeps its directory and checks each part's inputs itself (teachers)
    judges_code: bool = False  # runs candidate programs in the code sandbox; stage.json names which sandbox


@dataclass
class StageContext:
    recipe: Recipe
    run_dir: Path
    dir: Path
    inputs: dict[str, Path] = field(default_factory=dict)  # needed stage name → its directory


class Pipeline:
    def __init__(self, recipe: Recipe, run_dir: Path, stages: list[Stage]):
        self.recipe, self.run_dir, self.stages = recipe, run_dir, stages
        self.hashes: dict[str, str] = {}
        self.code_sandbox: str | None = None

    def run(self) -> dict[str, str]:
        """Run (or skip) every stage in order; returns stage name → 'done' | 'skipped'."""
        if any(stage.judges_code for stage in self.stages):
            self.code_sandbox = code_sandbox(self.recipe)  # refuses here, before any work, without bwrap
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.run_dir / "recipe.json", self.recipe.model_dump(mode="json"))
        outcome = {}
        for stage in self.stages:
            outcome[stage.name] = self.run_stage(stage)
            self.write_manifest(outcome)
        return outcome

    def run_stage(self, stage: Stage) -> str:
        digest = config_hash(stage.name, stage.config, [self.hashes[n] for n in stage.needs])
        self.hashes[stage.name] = digest
        stage_dir = self.run_dir / stage.name
        marker = read_json(stage_dir / "stage.json", default={})
        if marker.get("hash") == digest:
            console.print(f"[dim]✓ {stage.name}: complete for these inputs ({digest}), skipped[/dim]")
            return "skipped"
        console.print(f"[bold]▶ {stage.name}[/bold]")
        if not stage.checks_own_parts:
            set_aside_work_of_other_inputs(stage_dir, digest)
        start, cpu_start = time.time(), cpu_seconds()
        context = StageContext(self.recipe, self.run_dir, stage_dir, {n: self.run_dir / n for n in stage.needs})
        stage_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(stage_dir / "started.json", {"name": stage.name, "hash": digest})
        compute = stage.run(context) or {}
        release_freed_memory()  # the next stage's actors need what this one freed
        seconds = round(time.time() - start, 1)
        marker = {"name": stage.name, "hash": digest, "seconds": seconds}
        marker["compute"] = {
            "cpu_s": round(cpu_seconds() - cpu_start, 1),
            "cpu_s_of": "the stage: the pipeline's process and its waited-for children",
            **compute,  # a training stage's own count of its steps' CPU, on whichever process ran them
            "wall_s": seconds,
            "device": device_of(self.recipe),
        }
        if stage.judges_code and self.code_sandbox:
            marker["code_sandbox"] = describe_backend(self.code_sandbox)
        write_json_atomic(stage_dir / "stage.json", marker)
        console.print(f"[green]✓ {stage.name}[/green] in {seconds} s")
        return "done"

    def write_manifest(self, outcome: dict[str, str]) -> None:
        write_json_atomic(
            self.run_dir / "manifest.json",
            {
                "recipe": self.recipe.name,
                "stages": {
                    s.name: {"hash": self.hashes.get(s.name), "status": outcome.get(s.name, "pending")}
                    for s in self.stages
                },
            },
        )


def set_aside_work_of_other_inputs(stage_dir: Path, digest: str) -> None:
    """Move a stage directory started (or finished) for other inputs to `<stage>.previous/`, replacing
    an older one: resuming its checkpoints would continue a run of another config."""
    marker = read_json(stage_dir / "started.json", default=None) or read_json(stage_dir / "stage.json", default={})
    if marker.get("hash") in (None, digest):
        return
    previous = set_aside(stage_dir)
    console.print(f"[yellow]{stage_dir.name}: work of other inputs ({marker['hash']}) moved to {previous}[/yellow]")


# ----------------------------------------------------------------------------- the recipe's graph
def build_stages(recipe: Recipe, recipe_dir: Path | None = None) -> list[Stage]:
    """base → teachers → distill → (baselines) → bench, each hashed on the recipe fields it reads."""
    from mopd.base.sft import build_base
    from mopd.bench.run import run_bench_stage
    from mopd.distill.trainer import run_distill
    from mopd.recipe import load_teacher_specs, resolve_path
    from mopd.rl.teachers import teachers_compute, train_teachers

    shared = {"seed": recipe.seed, "envs": recipe.envs, "efforts": {e: hashed_effort(s) for e, s in recipe.efforts.items()}}
    sampling = {**shared, "rollout": recipe.rollout, **recipe.engine_limits()}
    specs = load_teacher_specs(recipe, recipe_dir)
    suite = resolve_path(recipe.bench.suite, recipe_dir)

    def teachers(ctx: StageContext) -> dict[str, Any]:
        train_teachers(ctx.recipe, ctx.run_dir, recipe_dir=recipe_dir)
        return teachers_compute(ctx.recipe, ctx.run_dir, recipe_dir)

    code = stages_judging_code(recipe, specs, suite, recipe_dir)
    baselines = baseline_stages(recipe, sampling, recipe_dir, "mixed_rl" in code)
    curves = curves_stages(recipe, sampling, recipe_dir, [b.name for b in baselines], "curves" in code)
    return [
        Stage("base", {**shared, **unsampled(recipe), "model": hashed_fields(recipe.model), "base": hashed_fields(recipe.base)}, build_base,
              judges_code="base" in code),
        Stage(
            "teachers",
            {**sampling, "specs": {c: hashed_fields(s) for c, s in specs.items()}},
            teachers,
            needs=("base",),
            checks_own_parts=True,  # a teacher is kept or cleared by its own spec hash
            judges_code="teachers" in code,
        ),
        Stage("distill", {**sampling, "distill": hashed_fields(recipe.distill)},
              run_distill, needs=("base", "teachers"), judges_code="distill" in code),
        *baselines,
        *curves,
        Stage("bench", {**sampling, "bench": hashed_fields(recipe.bench), "suite": suite.read_text()},
              run_bench_stage, needs=("base", "teachers", "distill", *(b.name for b in baselines)),
              judges_code="bench" in code),
    ]  # fmt: skip


def baseline_stages(recipe: Recipe, sampling: dict[str, Any], recipe_dir: Path | None, judges_code: bool) -> list[Stage]:
    """`baselines/mixed_rl` when the recipe enables it: it reads the FLOPs of teachers and distill."""
    if recipe.baselines.mixed_rl is None:
        return []
    from mopd.rl.mixed import mixed_rl_spec, run_mixed_rl

    config = {**sampling, "mixed_rl": hashed_fields(mixed_rl_spec(recipe))}
    return [Stage("baselines/mixed_rl", config, lambda ctx: run_mixed_rl(ctx, recipe_dir),
                  needs=("base", "teachers", "distill"), judges_code=judges_code)]  # fmt: skip


def curves_stages(
    recipe: Recipe, sampling: dict[str, Any], recipe_dir: Path | None, baselines: list[str], judges_code: bool
) -> list[Stage]:
    """`curves` when the recipe asks for learning curves: the snapshots of distill and the baselines on dev."""
    if recipe.curves is None:
        return []
    from mopd.bench.curves import check_curves_suite, run_curves_stage

    suite = check_curves_suite(recipe, recipe_dir)  # a test suite is refused before any stage runs
    config = {**sampling, "curves": hashed_fields(recipe.curves), "suite": suite.read_text()}
    return [Stage("curves", config, lambda ctx: run_curves_stage(ctx, suite),
                  needs=("base", "teachers", "distill", *baselines), judges_code=judges_code)]  # fmt: skip


def stages_judging_code(recipe: Recipe, specs: dict, suite: Path, recipe_dir: Path | None = None) -> set[str]:
    """The stages that run candidate programs in the code sandbox: base (verifying its corrupted
    traces), teachers, distill and the mixed-RL baseline with a code cell, bench and curves with a code domain."""
    from mopd.bench.suite import load_suite
    from mopd.recipe import resolve_path

    stages = set()
    if recipe.base.trains and recipe.base.sft.mix.get("code", 0) > 0:
        stages.add("base")
    if any(spec.domain == "code" for spec in specs.values()):
        stages.add("teachers")
    if any(weight > 0 and cell.startswith("code-") for cell, weight in recipe.distill.mix.items()):
        stages.add("distill")
    if "code" in load_suite(suite).domains:
        stages.add("bench")
    if recipe.baselines.mixed_rl is not None and any(c.startswith("code-") for c in recipe.baselines.mixed_rl.cells):
        stages.add("mixed_rl")
    if recipe.curves is not None and "code" in load_suite(resolve_path(recipe.curves.suite, recipe_dir)).domains:
        stages.add("curves")
    return stages


def code_sandbox(recipe: Recipe) -> str:
    """The sandbox that will judge the recipe's code here, 'bwrap' or 'rlimit', found before any work:
    without a working bubblewrap, SandboxUnavailable unless the recipe opts into the degraded one."""
    options = recipe.env_options("code")
    return resolve_backend(options.get("backend", "auto"), options.get("allow_degraded", False))


def check_code_sandbox(recipe: Recipe, recipe_dir: Path | None = None) -> str | None:
    """`code_sandbox` when some stage of the recipe judges code, else None (`mopd validate`)."""
    from mopd.recipe import load_teacher_specs, resolve_path

    specs = load_teacher_specs(recipe, recipe_dir)
    judging = stages_judging_code(recipe, specs, resolve_path(recipe.bench.suite, recipe_dir), recipe_dir)
    return code_sandbox(recipe) if judging else None


def unsampled(recipe: Recipe) -> dict[str, Any]:
    """The efforts as a stage that never samples hashes them: without what only sampling reads (`on_budget`)."""
    return {"efforts": {effort: hashed_effort(spec, samples=False) for effort, spec in recipe.efforts.items()}}


def hashed_fields(model) -> dict:
    """A config's fields for its stage hash. Defaults stay out: a new schema field must not turn
    every finished stage of an earlier run stale."""
    return model.model_dump(mode="json", exclude_defaults=True)


def run_recipe(recipe: Recipe, out: str | Path | None = None, recipe_dir: Path | None = None) -> dict[str, str]:
    run_dir = Path(out) if out else Path(recipe.runs_dir) / recipe.name
    check_writable(run_dir)
    outcome = Pipeline(recipe, run_dir, build_stages(recipe, recipe_dir)).run()
    report = run_dir / "bench" / "report.md"
    if report.is_file():
        console.print(report.read_text())
    console.print(f"[bold green]run complete[/bold green]: {run_dir}")
    return outcome


def check_writable(run_dir: Path) -> None:
    """Fail before any work when the run directory cannot be written."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-probe"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise RunDirError(f"run directory {run_dir} is not writable: {err.strerror or err}") from None


class RunDirError(OSError):
    """The run directory cannot be created or written."""
