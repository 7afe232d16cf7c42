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
            raise ValueError("distill_pair: give --domain and --effort, or --data FILE")
        cells = [f"{domain}-{effort}"]
        if cells[0] not in CELLS:
            raise ValueError(f"distill_pair: unknown cell {cells[0]!r}; cells are {', '.join(CELLS)}")
    spec = DistillSpec(mix=dict.fromkeys(cells, 1.0), **{"teacher_actors": False, **spec_fields})
    return train_mopd(
        student, dict.fromkeys(cells, teacher), spec, out_dir,
        efforts=efforts or default_effort_specs(), env_options=env_options, tasks=tasks,
        backend=backend, seed=seed, progress=progress,
    )  # fmt: skip
