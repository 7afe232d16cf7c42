"""Resident-teacher cap: peak RSS and scoring step time with nine teachers at caps 9, 3 and 1.

    python -m benchmarks.resident_teachers --out runs/bench/resident.json [--caps 9 3 1] [--steps 4]

Nine teachers of the tiny shape (`seeded_copy` of one freshly initialised tiny student, with the
tiny tokenizer), one per cell of the recipe's mix (default `recipes/tiny.yaml`). A step is one
`TeacherPool.score` call on what that recipe's MOPD step sends the teachers: `prompts_per_step`
samples whose cells are drawn by its mix (the route table's draw, as training does), interleaved,
with random ids of 20-60 prompt and 30-240 completion tokens, scored with `full_vocab_kl` as the
recipe asks. The step's requests are the same at every cap.

Each cap runs in a fresh (spawned) process with in-process scorers and one torch thread: it builds
the pool (which loads the first `cap` teachers), scores one warm-up step, then `--steps` steps.
Peak RSS is Linux VmHWM over the whole pool (reset after imports, before the pool is built: the
teachers and their scoring, on top of `rss_before_bytes`). Step time is the median over the
measured steps; `loads_per_step` is the teachers (re)loaded per measured step.

The projection scales the measured setting to bigger teachers from parameter bytes alone: a cap
of c keeps c teachers' weights instead of nine (fp32, the scorer's default, at the tiny tokenizer's
vocabulary). It is computed, not measured.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import in_fresh_process, reset_peak_rss, rss_bytes
from mopd.artifacts import write_json_atomic
from mopd.distill.routing import RouteTable, build_route_table
from mopd.distill.scorer import TeacherPool
from mopd.machine import describe_machine
from mopd.recipe import load_recipe

PROMPT_TOKENS, COMPLETION_TOKENS = (20, 60), (30, 240)
PROJECTED_SHAPES = {  # name → (preset, overrides)
    "tiny (this benchmark)": ("tiny", {}),
    "small preset (27M)": ("small", {}),
    "k3-gpu.yaml (small, 24 layers)": ("small", {"num_hidden_layers": 24}),
}


def build_teachers(work: Path, cells: list[str]) -> dict[str, Path]:
    from tests.fakes import build_student, seeded_copy

    student = build_student(work / "student")
    return {cell: seeded_copy(student, work / "teachers" / cell, seed=1 + i) for i, cell in enumerate(cells)}


def step_requests(table: RouteTable, prompts: int, vocab_size: int, step: int) -> tuple[list, list, list]:
    rng = random.Random(step)
    cells = table.sample_cells(prompts, rng)

    def ids(bounds: tuple[int, int]) -> list[int]:
        return [rng.randrange(3, vocab_size) for _ in range(rng.randint(*bounds))]

    return cells, [ids(PROMPT_TOKENS) for _ in cells], [ids(COMPLETION_TOKENS) for _ in cells]


def measure(table: RouteTable, cap: int, steps: int, prompts: int, vocab_size: int, full: bool) -> dict:
    """One cap in this (fresh) process: the pool built, one warm-up step, then `steps` timed steps."""
    from transformers import AutoModelForCausalLM  # noqa: F401  (imports are not the teachers' memory)

    import mopd.model  # noqa: F401

    torch.set_num_threads(1)
    reset_peak_rss()
    before = rss_bytes("VmRSS")
    start = time.perf_counter()
    pool = TeacherPool(table, use_ray=False, max_resident=cap)
    build_seconds = time.perf_counter() - start
    pool.score(*step_requests(table, prompts, vocab_size, step=0), full=full)
    loads_before, seconds = pool.loads, []
    for step in range(1, steps + 1):
        cells, prompt_ids, completion_ids = step_requests(table, prompts, vocab_size, step)
        start = time.perf_counter()
        pool.score(cells, prompt_ids, completion_ids, full=full)
        seconds.append(time.perf_counter() - start)
    peak = rss_bytes("VmHWM")
    return {
        "step_seconds_median": statistics.median(seconds),
        "step_seconds": seconds,
        "loads_per_step": (pool.loads - loads_before) / steps,
        "build_seconds": build_seconds,
        "rss_before_bytes": before,
        "peak_rss_bytes": peak,
        "teachers_and_scoring_bytes": peak - before,
    }


def parameter_bytes(preset: str, vocab_size: int, **overrides) -> int:
    from mopd.model import K3HybridForCausalLM, preset_config

    with torch.device("meta"):
        model = K3HybridForCausalLM(preset_config(preset, vocab_size=vocab_size, **overrides))
    return sum(4 * p.numel() for p in model.parameters())  # fp32


def projection(caps: list[int], teachers: int, vocab_size: int) -> dict:
    shapes = {name: parameter_bytes(preset, vocab_size, **o) for name, (preset, o) in PROJECTED_SHAPES.items()}
    return {
        "note": "projection, not measured: resident teacher weights = min(cap, teachers) x fp32 parameter bytes",
        "teachers": teachers,
        "shapes": {
            name: {"parameter_bytes": size, "resident_weight_bytes": {str(c): min(c, teachers) * size for c in caps}}
            for name, size in shapes.items()
        },
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--recipe", type=Path, default=Path("recipes/tiny.yaml"), help="its distill mix and prompts_per_step")
    parser.add_argument("--caps", type=int, nargs="+", default=[9, 3, 1], help="max_resident_teachers; the first is the baseline")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per cap (after one warm-up step)")
    args = parser.parse_args(argv)
    if min([*args.caps, args.steps]) < 1:
        parser.error("--caps and --steps must be positive")

    spec = load_recipe(args.recipe).distill
    with tempfile.TemporaryDirectory(prefix="mopd-bench-resident-") as tmp:
        table = build_route_table(spec.mix, build_teachers(Path(tmp), list(spec.mix)))
        teacher = next(iter(table.teachers))
        vocab_size = json.loads((teacher / "config.json").read_text())["vocab_size"]
        setup = (spec.prompts_per_step, vocab_size, spec.full_vocab_kl)
        caps = {str(cap): in_fresh_process(measure, table, cap, args.steps, *setup) for cap in args.caps}
    base = caps[str(args.caps[0])]
    for measured in caps.values():
        measured["over_baseline"] = {
            key: measured[key] / base[key] for key in ("peak_rss_bytes", "teachers_and_scoring_bytes", "step_seconds_median")
        }
    result = {
        "benchmark": "teacher pool with at most `cap` teachers resident (LRU; on CPU an evicted teacher is re-read from disk)",
        "machine": describe_machine() | {"torch_threads": 1},
        "setup": {"recipe": str(args.recipe), "teachers": len(table.teachers), "prompts_per_step": spec.prompts_per_step,
                  "prompt_tokens": PROMPT_TOKENS, "completion_tokens": COMPLETION_TOKENS, "full_vocab": spec.full_vocab_kl,
                  "vocab_size": vocab_size, "timed_steps": args.steps, "baseline_cap": args.caps[0]},
        "caps": caps,
        "projection": projection(args.caps, len(table.teachers), vocab_size),
    }  # fmt: skip
    write_json_atomic(args.out, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
