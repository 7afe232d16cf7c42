"""A recipe's claims over pipeline seeds: the runs of a sweep, aggregated with intervals.

Every seed's bench stage scores the same suite, so the same test tasks, and every effort answers
the same questions (`mopd.bench.suite`). A model's scores in a cell therefore form a seeds × tasks
matrix, and two models' matrices are paired cell by cell: a difference is taken per seed and task
before it is averaged. The interval of a mean over that matrix comes from its two-way
decomposition, score = mean + seed effect + task effect + noise (`two_way`): the seed term is
what another pipeline run would change, the task term what another draw of test tasks would.
Ratios (student ÷ teacher, the share of the teacher's gain the student keeps) get theirs by the
delta method on the same matrices. Where a suite repeats a content (a small split: the tiny code
cells hold ~31 functions for 128 tasks), its tasks are one cluster: the matrices are seeds ×
contents, each column the mean over that content's tasks (`clustered`), so an interval counts a
content once and each content weighs once in the mean.

The claims, as the summary tests them:
  1. every teacher beats the base on its own cell;
  2. the student reaches 90% of its teacher in every cell (the ratio of means over seeds), beside
     the share of the teacher's gain it keeps, (student − base) ÷ (teacher − base);
  3. within each domain the student's thinking tokens and its within-budget accuracy rise
     low < high < max.
A claim "holds" when the means satisfy it and is "beyond noise" when the 95% interval does too; a
claim over every cell does not hold where a cell could not be measured, and names it.

Beside the claims, accuracy by task family (`families`): per domain and family, each model's
accuracy over seeds × the family's contents, every effort pooled (a content asked at several
efforts is one cluster) and per effort, with the number of answers behind it. It needs the rows'
`task_families`; reports written before them leave it empty, and the summary says so.
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from mopd.artifacts import read_json
from mopd.bench.suite import BenchError
from mopd.envs.base import DOMAINS, EFFORTS
from mopd.stats import Interval, Matrix, accuracy, clustered, gain_share, over_seeds, ratio, subtract, two_way

TARGET_RATIO = 0.9
TIE = 1e-9  # float noise in a verdict's comparison: (9/384) / (10/384) is 0.8999999999999999
STAGES = ("base", "teachers", "distill", "baselines/mixed_rl", "curves", "bench")




# ----------------------------------------------------------------------------------- the summary
def summarise(runs: dict[int, Path]) -> dict[str, Any]:
    """summary.json's content for the finished runs of a sweep, seed → run directory."""
    reports = {seed: read_report(run) for seed, run in sorted(runs.items())}
    check_same_suite(reports)
    first = next(iter(reports.values()))
    cells = suite_cells(first)
    # every model beside the base, its teachers and its student: mixed RL, the pretrained checkpoint of a warm-up
    baselines = sorted({m["name"] for m in first["models"] if m["role"] not in ("base", "teacher", "student")})
    summary = {
        "seeds": list(reports),
        "runs": {str(seed): run_facts(runs[seed], report) for seed, report in reports.items()},
        "suite": {k: first["suite"][k] for k in ("name", "path", "split", "n", "seeds", "samples")},
        "baselines": baselines,
        "overlap": overlap(reports),
        "cells": {f"{d}-{e}": cell_summary(reports, d, e, baselines) for d, e in cells},
        "pooled": pooled_summary(reports, cells, baselines),
        "efforts": {d: effort_summary(reports, d) for d in dict.fromkeys(d for d, _ in cells)},
        "families": families_summary(reports, cells, baselines),
        "seeds_without_families": [seed for seed, report in reports.items() if not has_families(report)],
    }
    summary["compute"] = compute_ratios(summary["runs"])
    summary["curves"] = curves_summary(runs)
    summary["claims"] = claims(summary)
    return summary


def read_report(run: Path) -> dict[str, Any]:
    report = read_json(run / "bench" / "report.json")
    if report is None:
        raise BenchError(f"{run}: no bench/report.json; the run has not finished its bench stage")
    return report


def check_same_suite(reports: dict[int, dict]) -> None:
    """Seeds are comparable task by task only when their benches drew the same tasks."""
    suites = {seed: suite_identity(r) for seed, r in reports.items()}
    first_seed, first = next(iter(suites.items()))
    for seed, suite in suites.items():
        if suite != first:
            raise BenchError(f"seed {seed}'s bench suite differs from seed {first_seed}'s: the tasks are not the same")


def suite_identity(report: dict[str, Any]) -> dict[str, Any]:
    """What decides which tasks a bench drew: two reports with the same identity scored the same tasks."""
    return {k: report["suite"][k] for k in ("name", "split", "n", "seeds", "samples", "domains", "efforts")}


def suite_cells(report: dict[str, Any]) -> list[tuple[str, str]]:
    """The (domain, effort) cells a bench scored, in the project's order."""
    suite = report["suite"]
    return [(d, e) for d in DOMAINS if d in suite["domains"] for e in EFFORTS if e in suite["efforts"]]


def run_facts(run: Path, report: dict[str, Any]) -> dict[str, Any]:
    """Where a seed's run is and how long its stages took (summed from each stage.json)."""
    stages, flops = {}, {}
    for stage in STAGES:
        marker = read_json(run / stage / "stage.json", default=None)
        if marker is not None:
            stages[stage] = marker.get("seconds")
            if "flops" in marker.get("compute", {}):
                flops[stage] = marker["compute"]["flops"]
    return {"dir": str(run), "stage_seconds": stages, "seconds": round(sum(v or 0 for v in stages.values()), 1),
            "flops": flops, "code_sandbox": report.get("code_sandbox")}


def compute_ratios(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per seed, from the stages' FLOP estimates (runs that predate compute accounting have none):
    MOPD ÷ the teachers' RL, and the mixed-RL baseline ÷ (teachers + MOPD), its match."""
    ratios: dict[str, list[float]] = {"mopd_over_teachers": [], "mixed_rl_over_teachers_plus_mopd": []}
    for run in runs.values():
        f = run["flops"]
        if f.get("teachers") and "distill" in f:
            ratios["mopd_over_teachers"].append(f["distill"] / f["teachers"])
            if "baselines/mixed_rl" in f:
                ratios["mixed_rl_over_teachers_plus_mopd"].append(f["baselines/mixed_rl"] / (f["teachers"] + f["distill"]))
    return {name: asdict(over_seeds(values)) for name, values in ratios.items() if values}


def curves_summary(runs: dict[int, Path]) -> dict[str, Any] | None:
    """From the runs' `curves/curves.json` (`mopd.bench.curves`), where they have one: per seed the FLOPs
    the student (teachers + MOPD) and the mixed-RL baseline took to reach the bar on dev, and mixed ÷ MOPD
    over seeds (a geometric mean, its t interval on the log scale) among seeds where both reached it."""
    found = {seed: read_json(run / "curves" / "curves.json") for seed, run in sorted(runs.items())}
    found = {seed: curves for seed, curves in found.items() if curves is not None}
    if not found:
        return None
    per_seed = {
        str(seed): {"bar": c["bar"], "overlap": c["overlap"], "mixed_over_mopd": c.get("mixed_over_mopd"),
                    **{name: series["reached"]["flops"] for name, series in c["series"].items()}}
        for seed, c in found.items()
    }  # fmt: skip
    first = next(iter(found.values()))
    logs = [math.log(s["mixed_over_mopd"]) for s in per_seed.values() if s["mixed_over_mopd"] is not None]
    log_interval = over_seeds(logs) if logs else None
    return {
        "suite": first["suite"], "split": first["split"], "target": first["target"], "seeds": per_seed,
        "mixed_over_mopd": None if log_interval is None else asdict(Interval(
            *(math.exp(v) for v in (log_interval.mean, log_interval.low, log_interval.high)), log_interval.se, log_interval.df
        )),
        "both_reached": len(logs),
    }  # fmt: skip


def overlap(reports: dict[int, dict]) -> dict[str, Any]:
    """Test tasks found in the training records of the model that answered them, over every seed."""
    found = tasks = unavailable = 0
    for report in reports.values():
        for row in report["results"]:
            audit = row.get("audit")
            if not audit or audit.get("overlap") is None:
                unavailable += 1
                continue
            found += audit["overlap"]
            tasks += audit["tasks"]
    return {"overlap": found, "tasks": tasks, "rows_without_audit": unavailable}


# ------------------------------------------------------------------------------------ per cell
def scores(report: dict[str, Any], model: str, domain: str, effort: str) -> list[float] | None:
    row = row_of(report, model, domain, effort)
    return None if row is None else row["task_rewards"]


def teacher_of(report: dict[str, Any], cell: str) -> str | None:
    return next((m["name"] for m in report["models"] if m["role"] == "teacher" and m["cell"] == cell), None)


def task_matrix(reports: dict[int, dict], role_or_name: str, domain: str, effort: str) -> Matrix | None:
    """seeds × tasks within-budget scores of a model ("teacher": the cell's own teacher)."""
    rows = []
    for report in reports.values():
        model = teacher_of(report, f"{domain}-{effort}") if role_or_name == "teacher" else role_or_name
        row = scores(report, model, domain, effort) if model else None
        if row is None:
            return None
        rows.append(row)
    return rows


def contents_of(reports: dict[int, dict], domain: str, effort: str) -> list[str] | None:
    """The content key of each task of a cell, "domain:key" (the same for every seed: one suite),
    or None for a report from before bench rows carried them."""
    row = next((r for r in next(iter(reports.values()))["results"] if (r["domain"], r["effort"]) == (domain, effort)), None)
    keys = row and row.get("task_keys")
    return [f"{domain}:{key}" for key in keys] if keys else None


def matrix(reports: dict[int, dict], role_or_name: str, domain: str, effort: str) -> Matrix | None:
    """seeds × contents within-budget scores of a model in a cell (`clustered`)."""
    return clustered(task_matrix(reports, role_or_name, domain, effort), contents_of(reports, domain, effort))


def cell_summary(reports: dict[int, dict], domain: str, effort: str, baselines: list[str]) -> dict[str, Any]:
    m = {name: matrix(reports, name, domain, effort) for name in ("base", "teacher", "student", *baselines)}
    out = compared(m, baselines)
    out["per_seed"] = {name: [statistics.fmean(row) for row in x] for name, x in m.items() if x is not None}
    out["contents"] = contents_count(reports, [(domain, effort)])
    return out


def contents_count(reports: dict[int, dict], cells: list[tuple[str, str]]) -> dict[str, Any]:
    """Tasks and distinct contents (the clusters behind the intervals) of some cells."""
    keys = [contents_of(reports, d, e) for d, e in cells]
    suite = next(iter(reports.values()))["suite"]
    tasks = len(cells) * len(suite["seeds"]) * suite["n"]
    if any(k is None for k in keys):
        return {"tasks": tasks, "distinct": None}
    return {"tasks": tasks, "distinct": len(set(itertools.chain.from_iterable(keys)))}


def pooled_summary(reports: dict[int, dict], cells: list[tuple[str, str]], baselines: list[str]) -> dict[str, Any]:
    """Every cell's tasks side by side, one seeds × contents matrix per model: a content asked at
    three efforts is one cluster."""
    m = {name: pooled_matrix(reports, name, cells) for name in ("base", "teacher", "student", *baselines)}
    if not all(m[name] is not None for name in ("base", "teacher", "student")):
        return {}
    return {**compared(m, baselines), "contents": contents_count(reports, cells)}


def pooled_matrix(reports: dict[int, dict], role_or_name: str, cells: list[tuple[str, str]]) -> Matrix | None:
    """seeds × contents of a model over some cells side by side (`clustered`: a content at several efforts is one
    cluster); None where the model has no scores in one of them."""
    keys = [contents_of(reports, d, e) for d, e in cells]
    pooled_keys = None if any(k is None for k in keys) else list(itertools.chain.from_iterable(keys))
    return clustered(joined([task_matrix(reports, role_or_name, d, e) for d, e in cells]), pooled_keys)


def compared(m: dict[str, Matrix | None], baselines: list[str]) -> dict[str, Any]:
    """Each model's accuracy and the paired differences and ratios between them, from their
    seeds × tasks matrices (None: the model has no scores there)."""
    out: dict[str, Any] = {name: asdict(accuracy(x)) for name, x in m.items() if x is not None}
    if m["teacher"] and m["base"]:
        out["teacher_minus_base"] = asdict(two_way(subtract(m["teacher"], m["base"])))
    if m["student"] and m["teacher"]:
        out["student_over_teacher"] = asdict(ratio(m["student"], m["teacher"]))
        out["student_minus_teacher"] = asdict(two_way(subtract(m["student"], m["teacher"])))
    if m["student"] and m["teacher"] and m["base"]:
        out["gain_share"] = asdict(gain_share(m["student"], m["teacher"], m["base"]))
    for name in baselines:
        for model in ("student", "teacher"):
            if m[name] and m[model]:
                out[f"{model}_minus_{name}"] = asdict(two_way(subtract(m[model], m[name])))
    return out


def joined(matrices: list[Matrix | None]) -> Matrix | None:
    if any(x is None for x in matrices):
        return None
    return [list(itertools.chain.from_iterable(x[seed] for x in matrices)) for seed in range(len(matrices[0]))]


# ---------------------------------------------------------------------------------- per family
def has_families(report: dict[str, Any]) -> bool:
    return all("task_families" in row for row in report["results"])


def families_summary(reports: dict[int, dict], cells: list[tuple[str, str]], baselines: list[str]) -> dict[str, Any]:
    """domain → family → each model's accuracy over seeds × the family's contents, every effort pooled,
    with `answers` (a model's, over seeds, efforts and samples) and `contents`, and the same per effort
    in `by_effort`; {} where a report predates the rows' `task_families`."""
    if not all(has_families(report) for report in reports.values()):
        return {}
    models = ("base", "teacher", "student", *baselines)
    out: dict[str, Any] = {}
    for domain in dict.fromkeys(d for d, _ in cells):
        efforts = [e for d, e in cells if d == domain]
        for family in dict.fromkeys(f for e in efforts for f in families_of(reports, domain, e)):
            pooled = family_summary(reports, domain, family, efforts, models)
            by_effort = {e: family_summary(reports, domain, family, [e], models) for e in efforts}
            out.setdefault(domain, {})[family] = {**pooled, "by_effort": {e: v for e, v in by_effort.items() if v["answers"]}}
    return out


def families_of(reports: dict[int, dict], domain: str, effort: str) -> list[str]:
    """Each task's family in a cell (the same for every seed: one suite); none for a cell not scored."""
    row = next((r for r in next(iter(reports.values()))["results"] if (r["domain"], r["effort"]) == (domain, effort)), None)
    return row["task_families"] if row else []


def family_summary(reports: dict[int, dict], domain: str, family: str, efforts: list[str], models) -> dict[str, Any]:
    """The models' accuracy (`accuracy` of the seeds × contents matrix) on a family's tasks at some efforts."""
    columns = {e: [j for j, name in enumerate(families_of(reports, domain, e)) if name == family] for e in efforts}
    keys = [contents_of(reports, domain, e) for e in efforts]
    picked_keys = None if None in keys else [k[j] for k, js in zip(keys, columns.values(), strict=True) for j in js]
    tasks = sum(len(js) for js in columns.values())
    out: dict[str, Any] = {
        "answers": len(reports) * tasks * next(iter(reports.values()))["suite"]["samples"],
        "contents": None if picked_keys is None else len(set(picked_keys)),
    }
    if not tasks:
        return out
    for name in models:
        parts = [task_matrix(reports, name, domain, e) for e in efforts]
        picked = [None if x is None else [[row[j] for j in js] for row in x] for x, js in zip(parts, columns.values(), strict=True)]
        m = clustered(joined(picked), picked_keys)
        if m is not None:
            out[name] = asdict(accuracy(m))
    return out


# ---------------------------------------------------------------------------------- per effort
def effort_summary(reports: dict[int, dict], domain: str) -> dict[str, Any]:
    """The student's accuracy and thinking tokens at each effort of a domain, and the steps between.
    Accuracy differences are paired over seeds and tasks; thinking tokens are a mean per seed in the
    report, so their interval is over seeds only (t with seeds − 1 degrees of freedom). An effort the
    student was not scored at in every seed is left out and named in `unmeasured`."""
    asked = [e for e in EFFORTS if any(scores(r, "student", domain, e) is not None for r in reports.values())]
    efforts = [e for e in asked if all(scores(r, "student", domain, e) is not None for r in reports.values())]
    scored = {e: matrix(reports, "student", domain, e) for e in efforts}
    tokens = {e: [row_of(r, "student", domain, e)["thinking_tokens_mean"] for r in reports.values()] for e in efforts}
    steps = list(itertools.pairwise(efforts))
    return {
        "efforts": efforts,
        "unmeasured": [e for e in asked if e not in efforts],
        "accuracy": {e: asdict(accuracy(scored[e])) for e in efforts},
        "thinking_tokens": {e: asdict(over_seeds(tokens[e])) for e in efforts},
        "accuracy_steps": {f"{a}->{b}": asdict(two_way(subtract(scored[b], scored[a]))) for a, b in steps},
        "token_steps": {f"{a}->{b}": asdict(over_seeds([y - x for x, y in zip(tokens[a], tokens[b], strict=True)])) for a, b in steps},
    }


def row_of(report: dict[str, Any], model: str, domain: str, effort: str) -> dict[str, Any] | None:
    return next((r for r in report["results"] if (r["model"], r["domain"], r["effort"]) == (model, domain, effort)), None)


# ---------------------------------------------------------------------------------- the claims
def claims(summary: dict[str, Any]) -> dict[str, Any]:
    """A claim over every cell fails where a cell could not be measured (a model unscored in some seed)."""
    cells = summary["cells"]
    beats = {c: verdict(s["teacher_minus_base"], above=0.0) if "teacher_minus_base" in s else UNMEASURED
             for c, s in cells.items()}
    reaches = {c: verdict(s["student_over_teacher"], above=TARGET_RATIO, inclusive=True)
               if "student_over_teacher" in s else UNMEASURED for c, s in cells.items()}
    rises = {}
    for domain, e in summary["efforts"].items():
        if e.get("unmeasured"):
            rises[domain] = {"accuracy": UNMEASURED, "thinking_tokens": UNMEASURED}
            continue
        accuracy = [verdict(step, above=0.0) for step in e["accuracy_steps"].values()]
        tokens = [verdict(step, above=0.0) for step in e["token_steps"].values()]
        rises[domain] = {"accuracy": all_of(accuracy), "thinking_tokens": all_of(tokens)}
    return {
        "teacher_beats_base": {"cells": beats, **all_of(list(beats.values()))},
        "student_reaches_90pct": {"cells": reaches, **all_of(list(reaches.values()))},
        "student_rises_with_effort": {"domains": rises,
                                      **all_of([v for r in rises.values() for v in r.values()])},
    }


UNMEASURED = {"holds": False, "beyond_noise": False, "measured": False}


def verdict(interval: dict[str, float], above: float, inclusive: bool = False) -> dict[str, bool]:
    """Whether the mean, and the whole 95% interval, lie above a threshold; within `TIE` of it is equal."""
    over = (lambda x: x >= above - TIE) if inclusive else (lambda x: x > above + TIE)
    return {"holds": bool(over(interval["mean"])), "beyond_noise": bool(over(interval["low"]))}


def all_of(verdicts: list[dict[str, bool]]) -> dict[str, bool]:
    return {"holds": all(v["holds"] for v in verdicts), "beyond_noise": all(v["beyond_noise"] for v in verdicts)}


# ------------------------------------------------------------------------------------ the files
def write_summary(summary: dict[str, Any], out: Path, command: str) -> list[str]:
    """summary.json, summary.md and the plot into `out`; returns the file names."""
    from mopd.artifacts import write_json_atomic, write_text_atomic

    summary = {**summary, "command": command}
    write_json_atomic(out / "summary.json", summary)
    plot = write_plot(summary, out)
    write_text_atomic(out / "summary.md", markdown(summary, plot))
    return ["summary.json", "summary.md", plot]


def markdown(summary: dict[str, Any], plot: str) -> str:
    seeds, suite, found = summary["seeds"], summary["suite"], summary["overlap"]
    audit = (f"overlap {found['overlap']}/{found['tasks']}" +
             (f"; {found['rows_without_audit']} rows without an audit" if found["rows_without_audit"] else ""))
    lines = [
        f"# Sweep: {len(seeds)} pipeline seed(s) {seeds}",
        "",
        f"Command: `{summary['command']}`",
        "",
        f"Suite `{suite['path']}`, **{suite['split']} split**: {suite['n']} tasks per cell, the same tasks for every "
        f"seed and effort, {suite['samples']} sample(s) each. Training-data audit over all seeds, cells and models: "
        f"**{audit}**. Accuracy is within budget (verifier accepts, thinking ≤ budget). Brackets are 95% intervals "
        "over seeds and distinct contents, paired where models answer the same tasks (seeds × contents two-way "
        "decomposition, a repeated content one cluster; ratios by the delta method).",
        "",
        "| seed | run seconds (sum of stages) | code sandbox |",
        "|---|---:|---|",
        *[f"| {s} | {r['seconds']:.0f} | {r['code_sandbox'] or '—'} |" for s, r in summary["runs"].items()],
        "",
        *claims_lines(summary),
        "",
        *compute_lines(summary),
        *curves_lines(summary),
        *cell_lines(summary),
        "",
        *effort_lines(summary),
        "",
        *family_lines(summary),
        "",
        f"![accuracy by cell and effort]({plot})",
        "",
    ]
    return "\n".join(lines)


def claims_lines(summary: dict[str, Any]) -> list[str]:
    c = summary["claims"]

    def state(v: dict[str, bool]) -> str:
        return "holds, beyond noise" if v["beyond_noise"] else "holds (within noise)" if v["holds"] else "**does not hold**"

    def failing(cells: dict[str, dict[str, bool]]) -> str:
        unmeasured = [cell for cell, v in cells.items() if not v.get("measured", True)]
        missed = [cell for cell, v in cells.items() if not v["holds"] and cell not in unmeasured]
        parts = []
        if missed:
            parts.append(f"fails in {', '.join(missed)}")
        if unmeasured:
            parts.append(f"not measured in {', '.join(unmeasured)}")
        return f" ({'; '.join(parts)})" if parts else ""

    rises = c["student_rises_with_effort"]["domains"]
    flat = [f"{d} {what}" + ("" if v.get("measured", True) else " (not measured at every effort)")
            for d, r in rises.items() for what, v in r.items() if not v["holds"]]
    return [
        "## Claims",
        "",
        f"1. Every teacher beats the base on its own cell: {state(c['teacher_beats_base'])}"
        f"{failing(c['teacher_beats_base']['cells'])}.",
        f"2. The student reaches ≥ {TARGET_RATIO:.0%} of its teacher in every cell (ratio of means over seeds): "
        f"{state(c['student_reaches_90pct'])}{failing(c['student_reaches_90pct']['cells'])}. "
        f"Share of the teachers' gain the student keeps, pooled: {pooled_text(summary, 'gain_share')}.",
        f"3. Within each domain the student's thinking tokens and accuracy rise low < high < max: "
        f"{state(c['student_rises_with_effort'])}" + (f" (not in: {', '.join(flat)})" if flat else "") + ".",
    ]


def compute_lines(summary: dict[str, Any]) -> list[str]:
    names = {"mopd_over_teachers": "MOPD compute ÷ the teachers' RL compute",
             "mixed_rl_over_teachers_plus_mopd": "mixed-RL compute ÷ (teachers + MOPD), its match"}
    rows = [f"- {names[k]}: {Interval(**v).text('{:.3f}')} (FLOP estimates, over seeds)" for k, v in summary["compute"].items()]
    return [*rows, ""] if rows else []


def curves_lines(summary: dict[str, Any]) -> list[str]:
    curves = summary.get("curves")
    if not curves:
        return []

    def flops(value: float | None) -> str:
        return "not reached" if value is None else f"{value:.3g}"

    def number(value: float | None) -> str:
        return "—" if value is None else f"{value:.2f}"

    ratio = curves["mixed_over_mopd"]
    over = ("no seed where both reached it" if ratio is None
            else f"{Interval(**ratio).text()} (geometric mean over {curves['both_reached']} seed(s); above 1: MOPD needed less)")
    return [
        f"## Compute to reach {curves['target']:.0%} of the teachers ({curves['split']} suite `{curves['suite']}`)",
        "",
        "| seed | bar (dev accuracy) | teachers + MOPD FLOPs | mixed-RL FLOPs | mixed ÷ MOPD | audit |",
        "|---|---:|---:|---:|---:|---|",
        *[f"| {seed} | {s['bar']:.3f} | {flops(s.get('student'))} | {flops(s.get('mixed_rl'))} | "
          f"{number(s['mixed_over_mopd'])} | overlap {s['overlap']['overlap']}/{s['overlap']['tasks']} |"
          for seed, s in curves["seeds"].items()],
        "",
        f"Mixed RL's FLOPs to the bar ÷ MOPD's: {over}.",
        "",
    ]


def pooled_text(summary: dict[str, Any], key: str) -> str:
    value = summary["pooled"].get(key)
    return Interval(**value).text() if value else "—"


def cell_lines(summary: dict[str, Any]) -> list[str]:
    baselines = summary["baselines"]
    head = ["cell", "contents", "base", "teacher", "student", *baselines, "teacher − base", "student ÷ teacher",
            "gain kept (s−b)÷(t−b)", *[f"{m} − {b}" for b in baselines for m in ("student", "teacher")]]
    keys = ["base", "teacher", "student", *baselines, "teacher_minus_base", "student_over_teacher", "gain_share",
            *[f"{m}_minus_{b}" for b in baselines for m in ("student", "teacher")]]
    lines = ["## Per cell (within-budget accuracy, mean over seeds and distinct contents; contents: distinct / tasks)", "",
             "| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for cell, s in summary["cells"].items():
        lines.append(f"| {cell} | {contents_text(s)} | " + " | ".join(Interval(**s[k]).text() if k in s else "—" for k in keys) + " |")
    pooled = summary["pooled"]
    if pooled:
        lines.append(f"| **pooled** | {contents_text(pooled)} | "
                     + " | ".join(Interval(**pooled[k]).text() if k in pooled else "—" for k in keys) + " |")
    return lines


def contents_text(s: dict[str, Any]) -> str:
    counted = s.get("contents") or {}
    return "—" if counted.get("distinct") is None else f"{counted['distinct']} / {counted['tasks']}"


def effort_lines(summary: dict[str, Any]) -> list[str]:
    lines = ["## The student by effort", "",
             "| domain | accuracy low / high / max | thinking tokens low / high / max | accuracy steps | token steps |",
             "|---|---|---|---|---|"]
    for domain, e in summary["efforts"].items():
        acc = " / ".join(Interval(**e["accuracy"][x]).text() for x in e["efforts"])
        tok = " / ".join(Interval(**e["thinking_tokens"][x]).text("{:.1f}") for x in e["efforts"])
        acc_steps = ", ".join(f"{k} {Interval(**v).text('{:+.2f}')}" for k, v in e["accuracy_steps"].items())
        tok_steps = ", ".join(f"{k} {Interval(**v).text('{:+.1f}')}" for k, v in e["token_steps"].items())
        lines.append(f"| {domain} | {acc} | {tok} | {acc_steps} | {tok_steps} |")
    return lines


def family_lines(summary: dict[str, Any]) -> list[str]:
    """Accuracy by task family, every effort pooled (per effort: summary.json's `by_effort`)."""
    title = "## Accuracy by task family (within budget, every effort pooled; mean over seeds and distinct contents)"
    missing = summary.get("seeds_without_families", [])
    if missing:
        return [title, "", f"Not available: the reports of seed(s) {missing} carry no per-task families (benched "
                "before they did)."]  # fmt: skip
    models = ["base", "teacher", "student", *summary["baselines"]]
    lines = [title, "", "| domain | family | answers a model | contents | " + " | ".join(models) + " |",
             "|---|---|---:|---:|" + "---:|" * len(models)]  # fmt: skip
    for domain, by_family in summary["families"].items():
        for family, s in by_family.items():
            values = [Interval(**s[m]).text() if m in s else "—" for m in models]
            lines.append(f"| {domain} | {family} | {s['answers']:,} | {s['contents'] or '—'} | " + " | ".join(values) + " |")
    return lines


def write_plot(summary: dict[str, Any], out: Path) -> str:
    """Per cell, each model's accuracy with its 95% interval as an error bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = ["base", "teacher", "student", *summary["baselines"]]
    cells = list(summary["cells"])
    figure, axis = plt.subplots(figsize=(max(8, 1.1 * len(cells)), 4))
    width = 0.8 / len(models)
    for k, model in enumerate(models):
        values = [summary["cells"][c].get(model) for c in cells]
        xs = [i + (k - (len(models) - 1) / 2) * width for i, v in enumerate(values) if v]
        means = [v["mean"] for v in values if v]
        errors = [[v["mean"] - v["low"] for v in values if v], [v["high"] - v["mean"] for v in values if v]]
        axis.bar(xs, means, width, yerr=errors, capsize=2, label=model)
    axis.set_xticks(range(len(cells)), cells, rotation=30, ha="right")
    axis.set_ylabel("accuracy within budget")
    axis.set_title(f"{summary['suite']['split']} split, {len(summary['seeds'])} seed(s): mean and 95% interval "
                   "over seeds and tasks")
    axis.legend(ncol=len(models), fontsize=8)
    name = "summary.png"
    figure.savefig(out / name, dpi=110, bbox_inches="tight")
    plt.close(figure)
    return name
