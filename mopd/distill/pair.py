"""Pair mode: one teacher distilled into one student with the MOPD machinery.

    mopd distill --teacher PATH --student PATH --domain general --effort low --out DIR
    mopd distill --teacher PATH --student PATH --data tasks.jsonl --verifier general/exact --out DIR

The teacher may be any HF causal LM that shares the student's tokenizer; the student is a K3
hybrid checkpoint (it samples through the rollout engine). Prompts come from a domain's
environment at one effort, or from a task file (see `mopd.envs.data.load_task_file`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mopd.envs.effort import EffortSpec, default_effort_specs
from mopd.recipe import CELLS, DistillSpec


class PairError(ValueError):
    """A pair-mode request that names no cell or an unknown one."""


def distill_pair(
    teacher: str | Path,
    student: str | Path,
    out_dir: str | Path,
    *,
    domain: str | None = None,
    effort: str | None = None,
    data_file: str | Path | None = None,
    verifier: str | None = None,
    efforts: dict[str, EffortSpec] | None = None,
    env_options: dict[str, dict] | None = None,
    backend: str = "hf",
    seed: int = 0,
    progress: bool = True,
    **spec_fields: Any,
) -> Path:
    """Distil `teacher` into `student` on one cell or a task file; returns the student checkpoint."""
    from mopd.distill.trainer import train_mopd

    tasks = None
    if data_file is not None:
        from mopd.envs.data import load_task_file

        tasks = load_task_file(data_file, verifier or domain or "general", effort or "high")
        cells = sorted({f"{t.domain}-{t.effort}" for t in tasks})
    else:
        if domain is None or effort is None:
            raise PairError("give --domain and --effort, or --data FILE")
        cells = [f"{domain}-{effort}"]
        if cells[0] not in CELLS:
            raise PairError(f"unknown cell {cells[0]!r}; cells are {', '.join(CELLS)}")
    spec = DistillSpec(mix=dict.fromkeys(cells, 1.0), **{"teacher_actors": False, **spec_fields})
    return train_mopd(
        student, dict.fromkeys(cells, teacher), spec, out_dir,
        efforts=efforts or default_effort_specs(), env_options=env_options, tasks=tasks,
        backend=backend, seed=seed, progress=progress,
    )  # fmt: skip


# ----------------------------------------------------------------------------- command line
def add_distill_parser(subparsers) -> None:
    """`mopd distill`: the block the CLI adds with one call."""
    parser = subparsers.add_parser("distill", help="distil one teacher into one student (pair mode)")
    parser.add_argument("--teacher", required=True, help="teacher HF checkpoint (any causal LM with the student's tokenizer)")
    parser.add_argument("--student", required=True, help="student K3 hybrid checkpoint")
    parser.add_argument("--out", required=True, help="output directory (model/, metrics.jsonl, checkpoints/)")
    parser.add_argument("--domain", help="sample prompts from this domain's environment...")
    parser.add_argument("--effort", help="...at this effort (low, high, max)")
    parser.add_argument("--data", help="or a JSONL/parquet task file")
    parser.add_argument("--verifier", help="the task file's verifier (default: the domain, or general)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--backend", choices=["hf", "vllm"], default="hf")
    parser.set_defaults(func=cmd_distill)


def cmd_distill(args) -> int:
    import sys

    from mopd.distill.routing import RoutingError
    from mopd.envs.data import TaskFileError

    try:
        final = distill_pair(
            args.teacher, args.student, args.out, domain=args.domain, effort=args.effort,
            data_file=args.data, verifier=args.verifier, backend=args.backend,
            steps=args.steps, prompts_per_step=args.prompts_per_step, learning_rate=args.learning_rate,
        )  # fmt: skip
    except (PairError, RoutingError, TaskFileError) as err:
        print(f"mopd distill: error: {err}", file=sys.stderr)
        return 2
    print(f"distilled student written to {final}")
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m mopd.distill.pair", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_distill_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
