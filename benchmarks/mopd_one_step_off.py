"""One-step-off sampling: median MOPD step time, synchronous (`max_staleness: 0`) against asynchronous (1).

    python -m benchmarks.mopd_one_step_off --out runs/bench/async.json [--recipe recipes/tiny.yaml] [--steps 6]

The recipe's distillation (mix, prompts per step, efforts, environments, rollout backend) with
`--steps` steps, on a freshly initialised student of the recipe's model shape and the tiny
tokenizer, and one `seeded_copy` teacher per cell of the mix (random weights: the student samples
to its budgets, so sampling weighs more than with trained checkpoints). Each mode runs `train_mopd`
in a fresh (spawned) process with one torch thread in the trainer and one in the rollout thread.
Step time is the wall time of a step as the loop logs it (`time/step`: from taking the step's
rollouts to the weights pushed); the first step is left out of the median (warm-up, and the
asynchronous loop has nothing in flight yet). The JSON holds both modes' per-step phases, the
lags, the IcePop out-of-bounds rates, the process's CPU seconds per wall second (2 would be both
threads busy at once), sync over async, and the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import in_fresh_process
from mopd.artifacts import write_json_atomic
from mopd.machine import describe_machine
from mopd.recipe import load_recipe

MODES = {"sync": 0, "async": 1}  # name → distill.max_staleness
PHASES = ("step", "sample", "score", "train", "rollout_wait", "weight_sync")


def build_models(work: Path, recipe) -> tuple[Path, dict[str, Path]]:
    from tests.fakes import build_student, seeded_copy

    if recipe.model.preset != "tiny":
        raise ValueError(f"mopd_one_step_off builds tiny-preset models; the recipe's preset is {recipe.model.preset!r}")
    student = build_student(work / "student", seed=recipe.seed, **recipe.model.overrides)
    cells = [cell for cell, weight in recipe.distill.mix.items() if weight > 0]
    return student, {cell: seeded_copy(student, work / "teachers" / cell, seed=1 + i) for i, cell in enumerate(cells)}


def run_mode(recipe_path: Path, student: Path, teachers: dict[str, Path], out: Path, max_staleness: int, steps: int):
    """`train_mopd` in this (fresh) process with one torch thread: its metrics, one record per step,
    and the process's CPU seconds per wall second over the whole run (start-up included)."""
    from mopd.distill.trainer import train_mopd
    from mopd.envs.base import DOMAINS

    torch.set_num_threads(1)
    recipe = load_recipe(recipe_path)
    spec = recipe.distill.model_copy(update={"steps": steps, "max_staleness": max_staleness, "checkpoint_every": steps})
    wall, cpu = time.perf_counter(), time.process_time()
    train_mopd(
        student, teachers, spec, out, efforts=recipe.efforts, env_options={d: recipe.env_options(d) for d in DOMAINS},
        backend=recipe.rollout, seed=recipe.seed, device="cpu", progress=False,
    )  # fmt: skip
    cpu_per_wall = (time.process_time() - cpu) / (time.perf_counter() - wall)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], cpu_per_wall


def summary(records: list[dict], cpu_per_wall: float) -> dict:
    timed = records[1:]
    return {
        "cpu_seconds_per_wall_second": cpu_per_wall,
        **{f"{phase}_seconds_median": statistics.median(r[f"time/{phase}"] for r in timed) for phase in PHASES},
        "lags": [{k: v for k, v in r.items() if k.startswith("lag/")} for r in records],
        "is_out_of_bounds": [r["is_out_of_bounds"] for r in records],
        "train_rollout_gap": [r["train_rollout_gap"] for r in records],
        "steps": [{f"time/{phase}": r[f"time/{phase}"] for phase in PHASES} for r in records],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--recipe", type=Path, default=Path("recipes/tiny.yaml"))
    parser.add_argument("--steps", type=int, default=6, help="steps per mode; the first is not timed")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is not timed)")

    recipe = load_recipe(args.recipe)
    with tempfile.TemporaryDirectory(prefix="mopd-bench-async-") as tmp:
        student, teachers = in_fresh_process(build_models, Path(tmp), recipe)
        modes = {
            name: summary(*in_fresh_process(run_mode, args.recipe, student, teachers, Path(tmp) / name, staleness, args.steps))
            for name, staleness in MODES.items()
        }
    result = {
        "benchmark": "MOPD step time, synchronous vs one-step-off asynchronous sampling",
        "machine": describe_machine() | {"torch_threads": "1 trainer + 1 rollout thread"},
        "setup": {"recipe": str(args.recipe), "steps": args.steps, "timed_steps": args.steps - 1,
                  "prompts_per_step": recipe.distill.prompts_per_step, "rollout": recipe.rollout,
                  "full_vocab_kl": recipe.distill.full_vocab_kl, "teachers": len(teachers), "weights": "random (seeded)"},
        "modes": modes,
        "sync_over_async_step_seconds": modes["sync"]["step_seconds_median"] / modes["async"]["step_seconds_median"],
    }  # fmt: skip
    write_json_atomic(args.out, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
