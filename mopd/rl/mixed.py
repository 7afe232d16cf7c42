"""The mixed-RL baseline: one GRPO run from the base over the prompts of all the cells, evenly mixed.

    run_mixed_rl(ctx)   the pipeline stage `baselines/mixed_rl` (after distill, before bench)

It is what MOPD is measured against: the teachers' verifiers, effort shaping and TRL machinery
(`mopd.rl.grpo.train_grpo`) in one policy, at the compute of teachers + MOPD. Its prompts are
drawn as MOPD draws them (each cell's env with the recipe's options, the train split), as many of
each cell (`ceil(teacher prompts / cells)`, interleaved cell by cell; TRL shuffles them and cycles
through them again if the run needs more), each at its own effort with the recipe's budget and
shaping of that effort, as MOPD and the bench use them.

Unless the recipe sets `baselines.mixed_rl.steps`, the run matches a FLOP target: the `flops` of
the teachers and distill stages' `stage.json` (`mopd.compute`). A step's FLOPs are known once it
has run, so the run ends after the step where one more step of the mean size so far would
overshoot the target by more than stopping falls short. stage.json records `target_flops`, the
achieved `flops` and `mismatch` (flops / target − 1): about half a step's FLOPs, more where steps
differ in size (a step of agent prompts costs more than one of sums).
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from statistics import fmean
from typing import Any

from mopd.artifacts import MetricsLog, read_json
from mopd.compute import checkpoint_active_parameters, estimate_flops, steps_compute
from mopd.envs import get_env
from mopd.recipe import (
    GRPOSpec,
    MixedRLSpec,
    Recipe,
    RecipeError,
    deep_merge,
    load_teacher_specs,
    validate,
    with_precision,
)
from mopd.rl.grpo import RL_SEED_OFFSET, train_grpo
from mopd.rl.teachers import STEP_TIMES

MATCHED_STAGES = ("teachers", "distill")  # the student's compute beyond the base


def mixed_rl_spec(recipe: Recipe) -> MixedRLSpec:
    """The recipe's `baselines.mixed_rl`, its unset GRPO fields taken from `teachers.common`."""
    common = {key: value for key, value in recipe.teachers.common.items() if key in GRPOSpec.model_fields and key != "steps"}
    own = recipe.baselines.mixed_rl.model_dump(exclude_unset=True)
    return validate(MixedRLSpec, with_precision(deep_merge(common, own), recipe), source="baselines.mixed_rl (with teachers.common)")


def run_mixed_rl(ctx, recipe_dir: Path | None = None) -> dict[str, Any]:
    """Pipeline stage: train the baseline into `ctx.dir`; returns its compute, with the target it matched."""
    recipe, spec = ctx.recipe, mixed_rl_spec(ctx.recipe)
    base = Path(recipe.base.as_is or ctx.inputs["base"])
    active = checkpoint_active_parameters(base)
    target = None if spec.steps is not None else target_flops(ctx.inputs)
    prompts = sum(s.steps * s.prompts_per_step for s in load_teacher_specs(recipe, recipe_dir).values())
    envs = {domain: get_env(domain, **recipe.env_options(domain)) for domain in {c.split("-")[0] for c in spec.cells}}
    try:
        tasks = mixed_tasks(envs, spec.cells, math.ceil(max(prompts, spec.prompts_per_step) / len(spec.cells)), recipe.seed)
        stop = None if target is None else flop_stop(target, active)
        train_grpo(spec, recipe, base, ctx.dir, envs, tasks, dict(recipe.efforts), stop=stop, curve_every=spec.curve_every)
    finally:
        for env in envs.values():
            if hasattr(env, "close"):
                env.close()
    compute = steps_compute(MetricsLog(ctx.dir / "metrics.jsonl").records(), active, wall_keys=STEP_TIMES)
    if target is not None:
        compute |= {"target_flops": target, "mismatch": compute["flops"] / target - 1 if target else None}
    return compute


def target_flops(inputs: dict[str, Path]) -> float:
    """The FLOPs of the teachers and MOPD stages, from their stage.json."""
    total = 0.0
    for name in MATCHED_STAGES:
        marker = read_json(Path(inputs[name]) / "stage.json", default={})
        if "flops" not in marker.get("compute", {}):
            raise RecipeError(
                f"baselines.mixed_rl: {inputs[name]}/stage.json has no compute.flops to match (a stage finished "
                "before compute was counted); re-run that stage or set baselines.mixed_rl.steps"
            )
        total += marker["compute"]["flops"]
    return total


def mixed_tasks(envs: dict[str, Any], cells: list[str], per_cell: int, seed: int) -> list:
    """`per_cell` train-split tasks of each cell at its effort (the teachers' RL seed), interleaved cell
    by cell; ids get the cell as prefix (a domain draws the same ids at every effort)."""
    drawn = []
    for cell in cells:
        domain, effort = cell.split("-")
        tasks = envs[domain].sample(per_cell, seed + RL_SEED_OFFSET, "train", effort)
        drawn.append([replace(task, id=f"{cell}/{task.id}") for task in tasks])
    return [task for row in zip(*drawn, strict=True) for task in row]


def flop_stop(target: float, active_params: int):
    """`stop(records)` for train_grpo: True once the FLOPs so far are closer to `target` than they
    would be after one more step of the mean size so far."""

    def stop(records: list[dict[str, Any]]) -> bool:
        flops = [estimate_flops(r.get("tokens_sampled", 0), r.get("tokens_trained", 0), 0, active_params) for r in records]
        return sum(flops) + fmean(flops) / 2 >= target

    return stop
