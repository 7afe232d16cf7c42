"""A benchmark report on disk: report.json, report.md (one table per metric, a column per model), plots.

A report on a `split: train` suite, or on a dev/test suite let through with overlapping tasks
(`--allow-overlap`), carries that `label` in its title and in every table's title.

Every interval in it comes from `mopd.stats` under one rule (`INTERVAL_RULE`): a report is one
pipeline seed, so a cell's scores are a 1 × contents matrix (`clustered` by the rows' `task_keys`)
and `two_way` on it, or on the difference of two models' matrices, is the t interval over contents,
paired task by task; a proportion of an external suite's one-sample 0/1 answers, each problem once,
gets the Wilson score interval (`wilson`).
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

from mopd.artifacts import write_json_atomic, write_text_atomic
from mopd.bench.audit import audit_text
from mopd.bench.plots import write_plots
from mopd.bench.scaffolds import scaffold_table, tasks_scores
from mopd.envs.base import EFFORTS
from mopd.stats import Interval, accuracy_interval, clustered, grand_mean, subtract, two_way

# (title, metric keys shown as "a / b", number format)
TABLES: list[tuple[str, tuple[str, ...], str]] = [
    ("Accuracy within budget (verifier accepts, thinking ≤ budget; mean@k)", ("accuracy",), "{:.2f}"),
    ("pass@k within budget", ("pass_at_k",), "{:.2f}"),
    ("Raw accuracy (verifier reward, thinking of any length; mean@k)", ("raw_accuracy",), "{:.2f}"),
    ("Thinking tokens (mean / p90)", ("thinking_tokens_mean", "thinking_tokens_p90"), "{:.0f}"),
    ("Answer tokens (mean / p90)", ("answer_tokens_mean", "answer_tokens_p90"), "{:.0f}"),
    ("Over-budget rate (thinking > budget)", ("over_budget_rate",), "{:.2f}"),
    ("Forced share (turns whose thinking the engine closed at the budget: budget forcing)", ("forced_rate",), "{:.2f}"),
    ("Latency per request, s (mean / p90)", ("latency_s_mean", "latency_s_p90"), "{:.1f}"),
    ("Throughput, generated tokens/s", ("tokens_per_s",), "{:.0f}"),
]
AUDITED = {False: "the model's lineage", True: "any stage of the model's run"}  # external suites: the whole run
INTERVAL_RULE = (
    "Brackets are 95% intervals (`mopd.stats`): Student-t over a cell's distinct contents (a content's tasks "
    "averaged into one, so a bracketed mean weighs each content once; differences paired task by task), or for "
    "an external suite's one-sample 0/1 answers, each problem once (one effort), the Wilson score interval of the "
    "proportion (pooled over efforts a problem repeats: the t interval over problems); the paired tables' accuracies "
    "are those content-weighted means; \"beyond noise\": the interval lies above 0."
)
PLOTS = {
    "accuracy_vs_effort.png": "Accuracy vs effort, per domain",
    "accuracy_vs_tokens.png": "Accuracy vs mean generated tokens (runtime scaling)",
    "ratio_heatmap.png": "Per-cell accuracy ratio",
}


def write_report(report: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    report["out"] = str(out)
    answered = [{"model": r["model"], "cell": f"{r['domain']}-{r['effort']}", **a} for r in report["results"] for a in r.pop("answers", [])]
    if answered:  # an external suite's answers, one line a sample
        write_text_atomic(out / "answers.jsonl", "".join(json.dumps(a, default=str) + "\n" for a in answered))
    report["plots"] = write_plots(report, out)
    write_json_atomic(out / "report.json", report)
    write_text_atomic(out / "report.md", markdown(report))


def workers_note(workers: int) -> str:
    return "" if workers == 1 else f" on {workers} workers at once (latencies measured side by side)"


def markdown(report: dict[str, Any]) -> str:
    suite, machine = report["suite"], report["machine"]
    names = [model["name"] for model in report["models"] if model["role"] != "teacher"]
    teachers = {m["cell"]: m["name"] for m in report["models"] if m["role"] == "teacher"}
    label = f" — {report['label']}" if report.get("label") else ""
    split = suite.get("split", "eval")  # reports written before suites declared their split
    lines = [
        f"# Effort benchmark: suite `{suite['name']}`, {split} split{label}",
        "",
        f"{len(report['models'])} model(s) on `{suite['path']}`: {tasks_text(report)}, "
        f"{suite['samples']} sample(s) per task (k = {suite['samples']}), "
        f"temperature {suite['temperature']}, backend {report['backend']}"
        f"{workers_note(report.get('workers', 1))}. Machine: {machine_text(machine)}.",
        "",
        "Models: " + "; ".join(f"{m['name']} = `{m.get('path', '?')}`" + (f", {m['architecture']}" if m.get("architecture") else "")
                               for m in report["models"]) + ".",
        "",
        "Budgets (thinking tokens" + (f", from {report['settings']}" if report.get("settings") else "") + "): "
        + ", ".join(f"{effort} {spec['budget_tokens']}" for effort, spec in report["efforts"].items())
        + ". A sample is correct when the verifier accepts it and its thinking fits its effort's budget; "
        "raw accuracy ignores the budget."
        + (" Each teacher answers only its own cell; the `teacher` column shows it." if teachers else ""),
        "",
        INTERVAL_RULE,
    ]
    if "code_sandbox" in report:
        lines += ["", f"Code verified in the {report['code_sandbox']}."]
    lines += [
        "",
        f"## Training-data audit: the cell's tasks that {AUDITED[split == 'external']} trained on{label}",
        "",
        *table(report, names, teachers, ("audit",), "", show=lambda row: audit_text(row and row.get("audit"))),
        *unavailable_notes(report),
        *(["", f"**{report['audit_line']}**"] if report.get("audit_line") else []),
    ]
    for title, keys, number in TABLES:
        if keys == ("pass_at_k",) and suite["samples"] == 1:
            continue  # pass@1 is the accuracy
        if keys == ("forced_rate",) and not forces(report):
            continue
        lines += ["", f"## {title}{label}", "", *table(report, names, teachers, keys, number)]
    base = next((m["name"] for m in report["models"] if m["role"] == "base"), None)
    student = next((m["name"] for m in report["models"] if m["role"] == "student"), None)
    if base and teachers:
        lines += ["", f"## Teachers against the base (accuracy){label}", "", *teacher_table(report, base, teachers)]
    if student and teachers:
        lines += ["", f"## Student against its teachers (accuracy){label}", "", *recovery_table(report, student, teachers)]
    lines += ["", f"## Accuracy by effort{label}", "", *effort_table(report, names, teachers)]
    lines += ["", f"## Accuracy by family{label}", "", *family_table(report, names, teachers)]
    if scaffolds := scaffold_table(report, names, teachers):
        lines += ["", f"## Agent accuracy by scaffold{label}", "", *scaffolds]
    if any(model.get("compute") for model in report["models"]):
        lines += ["", f"## Training compute{label}", "", *compute_table(report)]
    for file in report.get("plots", []):
        lines += ["", f"![{PLOTS.get(file, file)}]({file})"]
    return "\n".join(lines) + "\n"


def forces(report: dict[str, Any]) -> bool:
    """Whether an effort of the report closes unclosed thinking at its budget (`on_budget: force`)."""
    return any(spec.get("on_budget") == "force" for spec in report["efforts"].values())


def machine_text(machine: dict[str, Any]) -> str:
    """The machine line (`mopd.machine.describe_machine`); a report written before the bench used it
    names the thread count `threads` and has no load average."""
    threads = machine.get("torch_threads", machine.get("threads"))
    load = machine.get("load_average")
    return (
        f"{machine['cpu_count']} CPUs, torch {machine['torch']}" + (f" on {threads} thread(s)" if threads else "")
        + f", {machine['platform']}" + (f", load average {load[0]:.1f} at the end" if load else "")
    )  # fmt: skip


def tasks_text(report: dict[str, Any]) -> str:
    """How many tasks a cell holds: a generated suite's n per seed, an external suite's problems."""
    suite = report["suite"]
    if suite.get("split") != "external":
        return f"{suite['n'] * len(suite['seeds'])} {suite.get('split', 'eval')} tasks per cell (seeds {suite['seeds']})"
    counts = sorted({row["tasks"] for row in report["results"]})
    limit = f"the first {suite['limit']} of each source" if suite.get("limit") else "every problem"
    return f"{'/'.join(map(str, counts))} problems per cell ({limit}, in the source's order)"


def table(
    report, names: list[str], teachers: dict[str, str], keys: tuple[str, ...], number: str, show=None
) -> list[str]:
    """Rows are cells, columns the models; a run's nine teachers share one column (each its own cell).
    `show(row)`: a cell's text (default: the keys' values); a numeric table ends with the column means."""
    show = show or (lambda row: cell_text(row, keys, number))
    rows = {(r["domain"], r["effort"], r["model"]): r for r in report["results"]}
    cells = list(dict.fromkeys((r["domain"], r["effort"]) for r in report["results"]))
    columns = [*names[:1], "teacher", *names[1:]] if teachers else names
    lines = ["| cell | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for domain, effort in cells:
        model_of = {name: name for name in names} | {"teacher": teachers.get(f"{domain}-{effort}")}
        values = [show(rows.get((domain, effort, model_of[column]))) for column in columns]
        lines.append(f"| {domain}/{effort} | " + " | ".join(values) + " |")
    if len(keys) == 1 and number:
        means = [
            column_mean(report["results"], set(teachers.values()) if c == "teacher" else {c}, keys[0])
            for c in columns
        ]
        lines.append("| **mean** | " + " | ".join(fmt(m, number) for m in means) + " |")
    return lines


def unavailable_notes(report) -> list[str]:
    """Why a model's audit is unavailable, once per model and reason."""
    reasons = dict.fromkeys(
        (r["model"], r["audit"]["unavailable"]) for r in report["results"] if "unavailable" in r.get("audit", {})
    )
    return ["", *(f"- {model}: audit unavailable: {why}" for model, why in reasons)] if reasons else []


def recovery_table(report, student: str, teachers: dict[str, str], target: float = 0.9) -> list[str]:
    """Per cell: how much of its teacher's accuracy the student recovers (MOPD's goal: ≥ 90%)."""
    lines = [
        "| cell | teacher | student | student / teacher | ≥ 90% | student − teacher [95% CI] |",
        "|---|---:|---:|---:|:---:|---:|",
    ]
    for cell, ours, theirs in paired_rows(report, teachers, lambda teacher: (student, teacher)):
        student_mean, teacher_mean = content_mean(ours), content_mean(theirs)
        ratio = student_mean / teacher_mean if teacher_mean > 0 else math.nan
        reached = "—" if math.isnan(ratio) else ("yes" if ratio >= target else "no")
        lines.append(
            f"| {cell} | {teacher_mean:.2f} | {student_mean:.2f} | {fmt(ratio, '{:.2f}')} | {reached} "
            f"| {interval_text(difference(ours, theirs), '{:+.2f}')} |"
        )
    return lines


def teacher_table(report, base: str, teachers: dict[str, str]) -> list[str]:
    """Per cell: what RL earned the teacher over the base it started from, on the same tasks."""
    lines = ["| cell | base | teacher | teacher − base [95% CI] | beyond noise |", "|---|---:|---:|---:|:---:|"]
    for cell, ours, theirs in paired_rows(report, teachers, lambda teacher: (teacher, base)):
        gap = difference(ours, theirs)
        lines.append(
            f"| {cell} | {content_mean(theirs):.2f} | {content_mean(ours):.2f} | {interval_text(gap, '{:+.2f}')} "
            f"| {beyond_noise(gap)} |"
        )
    return lines


def content_mean(row: dict[str, Any]) -> float:
    """A row's accuracy with each content weighing once, as its paired difference counts it (the per-task mean
    for a report written before rows carried per-task scores)."""
    rewards = row.get("task_rewards")
    return grand_mean(clustered([rewards], row.get("task_keys"))) if rewards else row["accuracy"]


def paired_rows(report, teachers: dict[str, str], pair):
    """("domain/effort", our row, their row) per teacher cell both models were scored on; `pair(teacher)`
    names (ours, theirs)."""
    rows = {(r["model"], r["domain"], r["effort"]): r for r in report["results"]}
    for cell, teacher in teachers.items():
        domain, effort = cell.split("-")
        ours, theirs = (rows.get((model, domain, effort)) for model in pair(teacher))
        if ours is not None and theirs is not None:
            yield f"{domain}/{effort}", ours, theirs


def effort_table(report, names: list[str], teachers: dict[str, str]) -> list[str]:
    """Per model and domain, accuracy at each effort: does thinking longer pay? (teachers: one per effort)"""
    efforts = [effort for effort in EFFORTS if effort in report["efforts"]]
    scores = {(r["model"], r["domain"], r["effort"]): r["accuracy"] for r in report["results"]}
    domains = list(dict.fromkeys(r["domain"] for r in report["results"]))
    lines = ["| model | domain | " + " | ".join(efforts) + " | rises with effort |", "|---|---|" + "---:|" * len(efforts) + ":---:|"]
    for name in [*names, *(["teachers"] if teachers else [])]:
        for domain in domains:
            model_of = {e: teachers.get(f"{domain}-{e}") if name == "teachers" else name for e in efforts}
            values = [scores.get((model_of[e], domain, e)) for e in efforts]
            if None in values:
                continue
            shown = [round(value, 2) for value in values]  # "rises" as a reader of the table sees it
            rises = "—" if len(shown) < 2 else "yes" if all(a < b for a, b in itertools.pairwise(shown)) else "no"
            lines.append(f"| {name} | {domain} | " + " | ".join(f"{v:.2f}" for v in shown) + f" | {rises} |")
    return lines


def family_table(report, names: list[str], teachers: dict[str, str]) -> list[str]:
    """Per domain and task family (the rows' `task_families`), each model's accuracy [95% interval] over
    the family's tasks: every effort pooled (a content asked at several efforts is one cluster), then each
    effort. The teacher column holds each cell's own teacher."""
    if not all("task_families" in r and "task_keys" in r for r in report["results"]):
        return ["Not available: the report's rows carry no per-task families (written before they did)."]
    efforts = [effort for effort in EFFORTS if effort in report["efforts"]]
    columns = [*names[:1], "teacher", *names[1:]] if teachers else names
    rows = {(r["model"], r["domain"], r["effort"]): r for r in report["results"]}
    samples, external = report["suite"]["samples"], report["suite"].get("split") == "external"
    number = "{:.3f}" if external else "{:.2f}"
    lines = ["| domain | family | effort | answers a model | " + " | ".join(columns) + " |",
             "|---|---|---|---:|" + "---:|" * len(columns)]  # fmt: skip
    for domain, family in families(report):
        for chosen in [efforts, *([e] for e in efforts)] if len(efforts) > 1 else [efforts]:
            scored = [
                tasks_scores(rows, domain, "task_families", family, {e: teachers.get(f"{domain}-{e}") if c == "teacher" else c for e in chosen})
                for c in columns
            ]  # fmt: skip
            counted = next((len(rewards) * samples for rewards, _ in filter(None, scored)), None)
            if counted is None:
                continue
            values = ["—" if s is None else accuracy_interval(*s, samples, external).text(number) for s in scored]
            effort = "all" if len(chosen) > 1 else chosen[0]
            lines.append(f"| {domain} | {family} | {effort} | {counted} | " + " | ".join(values) + " |")
    return lines


def families(report) -> list[tuple[str, str]]:
    """(domain, family) pairs in the order the cells' tasks first show them."""
    return list(dict.fromkeys((r["domain"], family) for r in report["results"] for family in r["task_families"]))


def compute_table(report) -> list[str]:
    """Each model's training compute (`mopd.compute`), from its run's stage.json files: the base SFT
    once, as its own row, then what each model's lineage trained after the base."""
    models = [m for m in report["models"] if m.get("compute")]
    student = next((m["compute"]["post_training"]["flops"] for m in models if m["role"] == "student"), None)
    lines = [
        "FLOPs ≈ 6·N·trained + 2·N·sampled + 2·N_teacher·scored tokens (N: active parameters, no embedding table; "
        "with ExOPD, + 2·N·trained for the frozen reference). "
        "Every model starts from the base, whose SFT is counted once; a model's row is the training after it "
        "(a teacher: its RL; the student: the nine teachers and MOPD; mixed_rl: its RL).",
        "",
        "| model | FLOPs | / student's | tokens sampled | tokens trained | tokens scored | wall s | CPU s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        compute_row("base SFT", models[0]["compute"]["base"], None),
    ]
    for model in models:
        if model["role"] != "base":
            lines.append(compute_row(model["name"], model["compute"]["post_training"], student))
    return lines


def compute_row(name: str, compute: dict[str, Any], student_flops: float | None) -> str:
    ratio = compute["flops"] / student_flops if student_flops else math.nan
    tokens = " | ".join(f"{compute[key]:,}" for key in ("tokens_sampled", "tokens_trained", "tokens_scored"))
    return (
        f"| {name} | {compute['flops']:.3g} | {fmt(ratio, '{:.2f}')} | {tokens} "
        f"| {compute['wall_s']:,.0f} | {compute['cpu_s']:,.0f} |"
    )


# ----------------------------------------------------------------------------- intervals
def difference(ours: dict[str, Any], theirs: dict[str, Any]) -> Interval | None:
    """ours − theirs in accuracy with its 95% interval, paired task by task (`two_way` of the difference
    of the 1 × contents matrices); None unless both rows hold per-task scores of the same tasks."""
    a, b = ours.get("task_rewards"), theirs.get("task_rewards")
    keys = ours.get("task_keys")
    if not a or not b or len(a) != len(b) or keys != theirs.get("task_keys"):
        return None
    return two_way(subtract(clustered([a], keys), clustered([b], keys)))


def interval_text(interval: Interval | None, number: str = "{:.2f}") -> str:
    return "—" if interval is None else interval.text(number)


def beyond_noise(interval: Interval | None) -> str:
    """"yes" where the interval lies above 0; "—" where there is none."""
    if interval is None or math.isnan(interval.low):
        return "—"
    return "yes" if interval.low > 0 else "no"


def cell_text(row: dict[str, Any] | None, keys: tuple[str, ...], number: str) -> str:
    if row is None:
        return "—"
    return " / ".join(fmt(row.get(key), number) for key in keys)


def fmt(value: float | None, number: str) -> str:
    return "—" if value is None or math.isnan(value) else number.format(value)


def column_mean(results: list[dict[str, Any]], models: set[str], key: str) -> float | None:
    values = [r[key] for r in results if r["model"] in models and key in r]
    return sum(values) / len(values) if values else None
