"""Which of a benchmark's tasks a model was trained on: the lineage audit of `mopd bench`.

    lineage(path, cell)                        the training stages whose data reached a checkpoint
    run_stages(path)                           every training stage of a checkpoint's run (external suites)
    audit_jobs(jobs, whole_run)                per (model, cell): its tasks whose key a stage trained on
    check_overlap(audits, split, allow, source)  an overlap in a dev or test suite is an error

A checkpoint's run is the directory above it holding `recipe.json`; its stage is where it sits
there: `base/`, `teachers/<cell>/`, `distill/` (the student, `distill/model` or a checkpoint) or
`baselines/mixed_rl/`.
Its lineage, as a run trains them: the base (SFT), a teacher (the base and its own RL prompts),
the student (the base, the teacher of the cell being scored, and the MOPD prompts), the mixed-RL
baseline `baselines/mixed_rl` (the base and its own RL prompts); a teacher's
`init` or a `distill.student` other than the run's base is not followed. Each stage
wrote two records (`mopd.envs.splits`): the content keys of the tasks it trained on, and the
content keys stated in the text it trained on (a function in a failed attempt, a sum in a trace);
a task overlaps when its key is in any record of the lineage. A checkpoint outside a run, or a
stage of its lineage without both records (a run from before they existed), is "audit
unavailable", never a silent 0. On a dev or test suite, an overlap or a stage of the run without its
records is a `BenchError` before sampling, naming the cells, the model and the stage, unless the user
allows it (the report is then labelled). Each cell's audit also counts its distinct contents.
A run whose base is a pretrained checkpoint (`base.checkpoint`, as it is or warmed up) audits what the
run trained on it; the pretraining itself is not known, and the audit says so (`pretraining_not_audited`).
An external suite (a public benchmark, `mopd.bench.external`) is audited against every stage of the
model's run (`whole_run`), not only its lineage: no record of the run may hold its contents.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from mopd.artifacts import checkpoint_in, read_json
from mopd.bench.suite import BenchError
from mopd.envs.base import Task
from mopd.envs.splits import RECORDS, read_trained_on, task_keys
from mopd.recipe import CELLS

BASELINES = ("baselines/mixed_rl",)


class AuditUnavailable(Exception):
    """The checkpoint's training data is unknown; the message says why."""


# ----------------------------------------------------------------------------- lineage
def lineage(path: Path, cell: str) -> dict[str, Path]:
    """Stage name → the directory holding its training record, for a task of `cell` ("domain-effort")."""
    run, stage = run_stage(path)
    stages = {"base": base_dir(run / "base")}
    if stage.startswith("teachers/"):
        stages[stage] = run / stage
    elif stage == "distill":
        if cell in trained_teachers(run):  # a cell with no teacher of its own reached the student through MOPD only
            stages[f"teachers/{cell}"] = run / "teachers" / cell
        stages["distill"] = run / "distill"
    elif stage in BASELINES:
        stages[stage] = run / stage
    return stages


def trained_teachers(run: Path) -> set[str]:
    """The cells the run's recipe trains a teacher for (every cell where the run has no recipe.json)."""
    recipe = read_json(run / "recipe.json")
    return set(recipe["teachers"]["cells"]) if recipe else set(CELLS)


def run_stages(path: Path) -> dict[str, Path]:
    """Every training stage of the checkpoint's run that exists: the base, each teacher, MOPD, baselines."""
    run, _ = run_stage(path)
    stages = {"base": base_dir(run / "base")}
    stages |= {f"teachers/{cell}": run / "teachers" / cell for cell in CELLS if (run / "teachers" / cell).is_dir()}
    stages |= {name: run / name for name in ("distill", *BASELINES) if (run / name).is_dir()}
    return stages


def run_stage(path: Path) -> tuple[Path, str]:
    """(the run directory, the stage: "base", "teachers/<cell>", "distill" or a baseline) of a checkpoint."""
    path = Path(path).resolve()
    run = next((parent for parent in path.parents if (parent / "recipe.json").is_file()), None)
    if run is None:
        raise AuditUnavailable(f"{path} is not inside a run directory (no recipe.json above it)")
    parts = path.relative_to(run).parts
    if parts[0] in ("base", "distill"):
        return run, parts[0]
    if parts[0] == "teachers" and len(parts) > 1 and parts[1] in CELLS:
        return run, f"teachers/{parts[1]}"
    if "/".join(parts[:2]) in BASELINES:
        return run, "/".join(parts[:2])
    raise AuditUnavailable(
        f"{path} is not a base/, teachers/<cell>/, distill/ or baselines/mixed_rl/ checkpoint of the run {run}"
    )


def base_dir(stage_dir: Path) -> Path:
    """The base stage holds the checkpoint, or names the recipe's existing one in base.json."""
    pointer = read_json(stage_dir / "base.json")
    return Path(pointer["checkpoint"]) if pointer else checkpoint_in(stage_dir)


def pretrained_base(path: Path) -> Path | None:
    """The pretrained checkpoint the run's base is (`base.json`) or was warmed up from (`warmup.json`), if any."""
    run, _ = run_stage(path)
    pointer = read_json(run / "base" / "base.json") or read_json(run / "base" / "warmup.json")
    return Path(pointer["checkpoint"]) if pointer else None


# ----------------------------------------------------------------------------- the audit
def audit_cell(
    path: Path, cell: str, keys: list[str], records: dict[tuple[Path, str], set[str] | None], whole_run: bool = False
) -> dict[str, Any]:
    """{"tasks", "distinct", "overlap", "stages": {stage: overlap}} or {"tasks", "distinct", "unavailable": why}.
    A task overlaps a stage when its key is in either of the stage's records: the tasks it trained
    on, or the contents stated in the text it trained on. `whole_run`: every stage of the run, not
    only the model's lineage."""
    counted = {"tasks": len(keys), "distinct": len(set(keys))}
    try:
        stages = run_stages(path) if whole_run else lineage(path, cell)
    except AuditUnavailable as why:
        return {**counted, "unavailable": str(why)}
    for where, record in itertools.product(stages.values(), RECORDS):
        if (where, record) not in records:
            records[where, record] = read_trained_on(where, record)
    pretrained = pretrained_base(path)
    if pretrained is not None:
        counted["pretraining_not_audited"] = str(pretrained)
        for record in RECORDS:  # a base used as it is holds no record: what the run trained on it is audited, its pretraining is not
            if pretrained == stages["base"] and records[pretrained, record] is None:
                records[pretrained, record] = set()
    missing = [str(where / record) for where, record in itertools.product(stages.values(), RECORDS) if records[where, record] is None]
    if missing:
        names = [stage for stage, where in stages.items() if any(str(where / r) in missing for r in RECORDS)]
        return {**counted, "unavailable": f"{', '.join(names)} wrote no training record (no {', '.join(missing)})",
                "missing_record": True}
    trained = {stage: set().union(*(records[where, record] for record in RECORDS)) for stage, where in stages.items()}
    return {
        **counted,
        "overlap": sum(any(key in found for found in trained.values()) for key in keys),
        "stages": {stage: sum(key in found for key in keys) for stage, found in trained.items()},
    }


def audit_jobs(
    jobs: list[tuple[str, Path, str, list[Task]]], whole_run: bool = False
) -> dict[tuple[str, str], dict[str, Any]]:
    """(model, cell) → its audit, for each (model name, checkpoint path, cell, tasks) job; `whole_run`
    audits against every stage of the model's run (external suites)."""
    records: dict[tuple[Path, str], set[str] | None] = {}
    return {
        (model, cell): audit_cell(path, cell, task_keys(tasks), records, whole_run)
        for model, path, cell, tasks in jobs
    }


def check_overlap(audits: dict[tuple[str, str], dict[str, Any]], split: str, allow: bool, source: str) -> bool:
    """Whether any cell overlaps training, or misses a record in its run; for a dev or test suite
    either is an error unless `allow`. (A checkpoint outside any run is labelled "audit unavailable".)"""
    overlapping = {job: audit for job, audit in audits.items() if audit.get("overlap")}
    unaudited = {job: audit for job, audit in audits.items() if audit.get("missing_record")}
    if overlapping and split != "train" and not allow:
        found = "; ".join(
            f"model {model!r} cell {cell}: {audit['overlap']}/{audit['tasks']} tasks trained on in "
            + ", ".join(f"{stage} ({n})" for stage, n in audit["stages"].items() if n)
            for (model, cell), audit in overlapping.items()
        )
        raise BenchError(
            f"{source} is a {split} suite, but some of its tasks were trained on: {found}. "
            f"Pass --allow-overlap to benchmark anyway (the report is then labelled as overlapping)"
        )
    if unaudited and split != "train" and not allow:
        reasons = sorted({f"model {model!r}: {audit['unavailable']}" for (model, _), audit in unaudited.items()})
        raise BenchError(
            f"{source} is a {split} suite, but what some models trained on is unknown: {'; '.join(reasons)}. "
            f"Pass --allow-overlap to benchmark anyway (the report is then labelled as unaudited)"
        )
    return bool(overlapping) or bool(unaudited)


def audit_text(audit: dict[str, Any] | None) -> str:
    if audit is None:
        return "—"
    distinct = f", {audit['distinct']} distinct" if "distinct" in audit else ""
    if "unavailable" in audit:
        return f"audit unavailable{distinct}"
    pretrained = " (pretraining not audited)" if "pretraining_not_audited" in audit else ""
    return f"overlap {audit['overlap']}/{audit['tasks']}{distinct}{pretrained}"


# ----------------------------------------------------------------------------- training compute
COMPUTE_KEYS = ("tokens_sampled", "tokens_trained", "tokens_scored", "flops", "wall_s", "cpu_s")


def training_compute(path: Path) -> dict[str, Any] | None:
    """The compute that made a checkpoint, from its run's stage.json files (`mopd.compute`): `base`,
    the SFT every model of the run shares, shown apart; `post_training`, its lineage's training after
    the base, counted once per stage (a teacher: its own RL; the student: all the teachers and MOPD;
    a baseline: its own RL). None outside a run, or where a stage.json holds no compute."""
    try:
        run, stage = run_stage(path)
    except AuditUnavailable:
        return None

    def compute(name: str) -> dict[str, Any] | None:
        return (read_json(run / name / "stage.json", default={}) or {}).get("compute")

    if stage == "base":
        parts = []
    elif stage.startswith("teachers/"):
        parts = [(compute("teachers") or {}).get("teachers", {}).get(stage.removeprefix("teachers/"))]
    elif stage == "distill":
        parts = [compute("teachers"), compute("distill")]
    else:
        parts = [compute(stage)]
    base = compute("base")
    if base is None or None in parts:
        return None
    return {
        "base": {key: base.get(key, 0) for key in COMPUTE_KEYS},
        "post_training": {key: sum(part.get(key, 0) for part in parts) for key in COMPUTE_KEYS},
    }
