"""Benchmark: seconds of one teacher-RL step, split into generate / verify / train, as JSON.

    python -m benchmarks.grpo_step --recipe recipes/tiny.yaml --base runs/tiny/base --out runs/bench/rl_step.json

Each cell trains `--steps` GRPO steps in-process (no Ray) at the recipe's batch size
(prompts_per_step × group_size) from the given base; the JSON holds, per cell, the median of
each part over the steps after the first (which pays start-up costs), their shares of the step,
and a description of the machine.

With `--compare-trl-batches` each cell also trains with TRL's own micro-batches (the step's
rollouts shuffled, all padded to the longest), and the JSON gives the ratio of train seconds,
TRL's over ours (length-sorted micro-batches, each trimmed to its longest rollout).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from statistics import median

import torch
from trl import GRPOTrainer

from mopd.artifacts import MetricsLog, write_json_atomic
from mopd.base.sft import check_checkpoint
from mopd.machine import describe_machine
from mopd.recipe import load_recipe, load_teacher_specs
from mopd.rl.grpo import train_teacher

PARTS = ("generate", "verify", "train")


def bench_cell(spec, recipe, base: Path, steps: int, trainer_class: type | None = None) -> dict:
    spec = spec.model_copy(update={"steps": steps, "checkpoint_every": steps})
    with tempfile.TemporaryDirectory(prefix=f"rl-bench-{spec.cell}-") as out:
        train_teacher(spec, recipe, base, Path(out), trainer_class=trainer_class)
        rows = (
            MetricsLog(Path(out) / "metrics.jsonl").records()[1:]
            or MetricsLog(Path(out) / "metrics.jsonl").records()
        )
    seconds = {part: median(r[f"time_{part}"] for r in rows) for part in PARTS}
    total = sum(seconds.values())
    return {
        "batch": {
            "prompts": spec.prompts_per_step,
            "group_size": spec.group_size,
            "rollouts": spec.prompts_per_step * spec.group_size,
        },
        "median_seconds": {**seconds, "step": total},
        "share": {part: seconds[part] / total for part in PARTS},
        "steps_measured": len(rows),
        "median_tokens_per_rollout": median(r["thinking_tokens"] + r["answer_tokens"] for r in rows),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", default="recipes/tiny.yaml")
    parser.add_argument("--base", required=True, help="HF checkpoint the teachers start from (a run's base)")
    parser.add_argument("--cells", default="general-low,general-max", help="comma-separated teacher cells")
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps per cell (the first is not counted)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument(
        "--compare-trl-batches", action="store_true", help="also train with TRL's micro-batches; report the ratio"
    )
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("overrides", nargs="*", help="recipe overrides KEY=VALUE")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    recipe = load_recipe(args.recipe, args.overrides)
    check_checkpoint(Path(args.base), "--base")
    specs = load_teacher_specs(recipe, Path(args.recipe).parent)
    unknown = [c for c in args.cells.split(",") if c not in specs]
    if unknown:
        parser.error(f"--cells: {unknown} are not teacher cells of {args.recipe} ({', '.join(specs)})")
    cells = {}
    for cell in args.cells.split(","):
        cells[cell] = bench_cell(specs[cell], recipe, Path(args.base), args.steps)
        if args.compare_trl_batches:
            trl = bench_cell(specs[cell], recipe, Path(args.base), args.steps, trainer_class=GRPOTrainer)
            cells[cell]["trl_micro_batches"] = trl
            cells[cell]["train_seconds_trl_over_ours"] = (
                trl["median_seconds"]["train"] / cells[cell]["median_seconds"]["train"]
            )
    report = {"recipe": recipe.name, "rollout": recipe.rollout, "cells": cells, "machine": describe_machine()}
    write_json_atomic(args.out, report)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
