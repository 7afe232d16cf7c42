"""MOPD benchmark: step time split into sample / score / train / weight sync, and teacher scoring speed.

    python -m benchmarks.mopd_step --out runs/bench/distill.json
    python -m benchmarks.mopd_step --student runs/tiny/base --teachers runs/tiny/teachers --backends vllm hf

Without --student it builds a tiny student and differently-seeded teachers sharing its tokenizer
(timing does not depend on what the teachers learned). Each backend runs the same MOPD steps side
by side; the JSON holds per-phase medians over the steps after the first (warm-up), teacher
scoring tokens/s inside the loop and in isolation, and a machine description.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from mopd.artifacts import MetricsLog, write_json_atomic
from mopd.distill.scorer import TeacherScorer
from mopd.envs.effort import default_effort_specs
from mopd.machine import describe_machine
from mopd.recipe import CELLS, DistillSpec
from tests.fakes import build_student, seeded_copy

PHASES = ("sample", "score", "train", "weight_sync")


def bench_backend(student: Path, teachers: dict[str, Path], backend: str, spec: DistillSpec, work: Path) -> dict:
    from mopd.distill.trainer import train_mopd

    out = work / f"mopd-{backend}"
    start = time.perf_counter()
    train_mopd(student, teachers, spec, out, efforts=default_effort_specs(), backend=backend, progress=False)
    total = time.perf_counter() - start
    steps = MetricsLog(out / "metrics.jsonl").records()[1:] or MetricsLog(out / "metrics.jsonl").records()
    medians = {phase: statistics.median(r[f"time/{phase}"] for r in steps) for phase in PHASES}
    return {
        "step_seconds_median": sum(medians.values()),
        "phase_seconds_median": medians,
        "phase_fraction": {p: s / max(sum(medians.values()), 1e-9) for p, s in medians.items()},
        "teacher_tokens_per_s_median": statistics.median(r["teacher_tokens_per_s"] for r in steps),
        "completion_tokens_per_step_median": statistics.median(r["tokens"] for r in steps),
        "steps_timed": len(steps),
        "run_seconds_with_startup": total,
    }


def bench_scoring(teacher: Path, batch: int, prompt_len: int, completion_len: int, repeats: int = 3) -> dict:
    """Prefill-only scoring throughput of one teacher on fixed random sequences."""
    scorer = TeacherScorer(teacher)
    generator = torch.Generator().manual_seed(0)
    vocab = scorer.model.config.vocab_size
    prompts = torch.randint(3, vocab, (batch, prompt_len), generator=generator).tolist()
    completions = torch.randint(3, vocab, (batch, completion_len), generator=generator).tolist()
    scorer.score(prompts[:1], completions[:1])  # warm-up
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        scorer.score(prompts, completions)
        seconds.append(time.perf_counter() - start)
    return {
        "batch": batch,
        "prompt_tokens": prompt_len,
        "completion_tokens": completion_len,
        "seconds_median": statistics.median(seconds),
        "completion_tokens_per_s": batch * completion_len / statistics.median(seconds),
    }


def fake_setup(work: Path, cells: list[str]) -> tuple[Path, dict[str, Path]]:
    student = build_student(work / "student")
    return student, {cell: seeded_copy(student, work / "teachers" / cell, seed=i + 1) for i, cell in enumerate(cells)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--student", type=Path, help="student checkpoint (default: a fresh tiny one)")
    parser.add_argument("--teachers", type=Path, help="folder of <cell>/ teacher checkpoints")
    parser.add_argument("--cells", nargs="+", default=["general-low", "general-high"], choices=CELLS)
    parser.add_argument("--backends", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--actors", action="store_true", help="teachers as Ray actors (default: in-process)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared 2-core box)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory(prefix="mopd-bench-") as tmp:
        work = Path(tmp)
        if args.student:
            student = args.student
            teachers = {cell: (args.teachers or args.student.parent / "teachers") / cell for cell in args.cells}
        else:
            student, teachers = fake_setup(work, args.cells)
        spec = DistillSpec(
            mix=dict.fromkeys(args.cells, 1.0), steps=args.steps, prompts_per_step=args.prompts_per_step,
            checkpoint_every=args.steps, teacher_actors=args.actors,
        )  # fmt: skip
        result = {
            "benchmark": "mopd step",
            "machine": describe_machine(),
            "setup": {"cells": args.cells, "steps": args.steps, "prompts_per_step": args.prompts_per_step,
                      "teacher_actors": args.actors, "student": str(args.student or "fresh tiny")},
            "backends": {backend: bench_backend(student, teachers, backend, spec, work) for backend in args.backends},
            "teacher_scoring": bench_scoring(next(iter(teachers.values())), batch=16, prompt_len=32, completion_len=96),
        }  # fmt: skip
    write_json_atomic(args.out, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
