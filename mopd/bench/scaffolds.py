"""Agent accuracy by scaffold (`mopd.envs.agent.scaffolds`), and whether a model saw each in training.

A suite that asks its agent tasks in chosen scaffolds (`agent: {scaffolds: heldout}`) gets tasks
that record theirs (`meta["scaffold"]`). Each such cell's report row carries `task_scaffolds` (in
task order, like `task_families`) and `scaffolds_seen`: per scaffold, whether its key is in a
training record of the model's lineage (`mopd.bench.audit`), measured, not assumed: the
trained-text records list the scaffolds each stage's text stated. None where the audit is
unavailable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mopd.bench.audit import audit_cell
from mopd.envs.agent.harness import scaffold_key
from mopd.envs.base import EFFORTS, Task
from mopd.stats import accuracy_interval


def task_scaffolds(tasks: list[Task]) -> list[str] | None:
    """Each task's scaffold, or None for a cell whose tasks record none (today's harness)."""
    if not any("scaffold" in task.meta for task in tasks):
        return None
    return [task.meta.get("scaffold", "mopd") for task in tasks]


def scaffolds_seen(
    jobs: list[tuple[str, Path, str, list[Task]]], records: dict | None = None
) -> dict[tuple[str, str], dict[str, bool | None]]:
    """(model, cell) → {scaffold: seen in training}, for the cells whose tasks record scaffolds."""
    records = {} if records is None else records
    seen = {}
    for model, path, cell, tasks in jobs:
        names = task_scaffolds(tasks)
        if names is None:
            continue
        audits = {name: audit_cell(path, cell, [scaffold_key(name)], records) for name in dict.fromkeys(names)}
        seen[model, cell] = {name: None if "unavailable" in audit else audit["overlap"] > 0 for name, audit in audits.items()}
    return seen


def scaffold_table(report: dict[str, Any], names: list[str], teachers: dict[str, str]) -> list[str]:
    """Per scaffold, whether the models saw it in training, and each model's accuracy [95% interval]
    over the scaffold's tasks: every effort pooled, then each effort. The teacher column holds each
    cell's own teacher. Empty where no cell's tasks record a scaffold."""

    rows = {(r["model"], r["domain"], r["effort"]): r for r in report["results"] if "task_scaffolds" in r}
    if not rows:
        return []
    efforts = [effort for effort in EFFORTS if effort in report["efforts"]]
    columns = [*names[:1], "teacher", *names[1:]] if teachers else names
    samples = report["suite"]["samples"]
    lines = ["| scaffold | seen in training | effort | answers a model | " + " | ".join(columns) + " |",
             "|---|---|---|---:|" + "---:|" * len(columns)]  # fmt: skip
    for domain, scaffold in dict.fromkeys((d, s) for (_, d, _), r in rows.items() for s in r["task_scaffolds"]):
        asked = [(model, row) for (model, d, _), row in rows.items() if d == domain and scaffold in row["task_scaffolds"]]
        seen = seen_text({model: row["scaffolds_seen"].get(scaffold) for model, row in asked})
        for chosen in [efforts, *([e] for e in efforts)] if len(efforts) > 1 else [efforts]:
            scored = [tasks_scores(rows, domain, "task_scaffolds", scaffold, {e: teachers.get(f"{domain}-{e}") if c == "teacher" else c
                                                                for e in chosen}) for c in columns]  # fmt: skip
            counted = next((len(rewards) * samples for rewards, _ in filter(None, scored)), None)
            if counted is None:
                continue
            values = ["—" if s is None else accuracy_interval(*s, samples, False).text("{:.2f}") for s in scored]
            effort = "all" if len(chosen) > 1 else chosen[0]
            lines.append(f"| {scaffold} | {seen} | {effort} | {counted} | " + " | ".join(values) + " |")
    return lines


def seen_text(seen: dict[str, bool | None]) -> str:
    """yes / no when every model agrees, else the models that saw it; unknown without an audit."""
    if None in seen.values():
        return "unknown (audit unavailable)"
    if all(seen.values()):
        return "yes"
    if not any(seen.values()):
        return "no"
    return "by " + ", ".join(sorted(model for model, saw in seen.items() if saw))


def tasks_scores(rows, domain: str, column: str, value: str, model_of: dict[str, str | None]) -> tuple[list[float], list[str]] | None:
    """The per-task scores and content keys of the tasks whose `column` (a row's per-task list, e.g.
    `task_scaffolds`) holds `value`, at some efforts, `model_of[effort]` answering each; None where a
    model did not answer one of them or no task has that value."""
    rewards: list[float] = []
    keys: list[str] = []
    for effort, model in model_of.items():
        row = rows.get((model, domain, effort))
        if row is None:
            return None
        picked = [j for j, name in enumerate(row[column]) if name == value]
        rewards += [row["task_rewards"][j] for j in picked]
        keys += [row["task_keys"][j] for j in picked]
    return (rewards, keys) if rewards else None
