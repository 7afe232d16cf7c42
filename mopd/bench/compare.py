"""`mopd compare`: sweeps of one recipe under different settings, each arm against a reference arm, paired.

An arm is a sweep directory (`mopd sweep RECIPE OVERRIDES --out ARM`): one run per pipeline seed in `seed-<s>/`,
each benched on the same suite. Over the seeds every arm has finished, a cell's difference arm − reference in the
student's accuracy is taken task by task (one suite draws the same tasks for every run; a content asked twice is one
cluster) with its 95% interval over seeds × contents (`mopd.stats.two_way`), and the pooled row puts every cell's
tasks side by side. Each arm's MOPD FLOPs (its `distill/stage.json`) ÷ the reference's are taken per seed, their
interval over seeds; each cell's share of the prompts, of the generated tokens and of the gradient comes from the
arm's `distill/metrics.jsonl`. `compare.json`, `compare.md` and `compare.png` (the differences per cell) go into
the output folder.

Read the intervals with the number of arms in mind: with several arms against one reference, one of them will
look better by chance; decide by a rule written before the runs, on dev, and quote test only for what was chosen.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from mopd.artifacts import MetricsLog, read_json, write_json_atomic, write_text_atomic
from mopd.bench.seeds import cell_summary, pooled_matrix, pooled_summary, suite_cells, suite_identity, verdict
from mopd.bench.suite import BenchError
from mopd.stats import Matrix, detectable, over_seeds, subtract, two_way

SUMMARY_KEYS = ("student", "teacher", "base", "student_over_teacher", "gain_share")


def compare(reference: Path, arms: list[Path]) -> dict[str, Any]:
    """compare.json's content: every arm beside the reference over the seeds all of them finished."""
    everyone = [reference, *arms]
    names = arm_names(everyone)
    runs = {arm: finished_runs(arm) for arm in everyone}
    seeds = common_seeds(runs, names)
    reports = {arm: {s: read_json(runs[arm][s] / "bench" / "report.json") for s in seeds} for arm in everyone}
    check_one_suite(reports, names)
    cells = suite_cells(reports[reference][seeds[0]])
    result: dict[str, Any] = {
        "reference": names[reference],
        "seeds": seeds,
        "suite": {k: reports[reference][seeds[0]]["suite"][k] for k in ("name", "path", "split", "n", "seeds")},
        "cells": [f"{d}-{e}" for d, e in cells],
        "arms": {},
    }
    for arm in everyone:
        record = arm_summary(reports[arm], runs[arm], seeds, cells)
        record["dir"] = str(arm)
        if arm != reference:
            record["minus_reference"] = differences(reports[arm], reports[reference], cells)
            record["flops_over_reference"] = flops_ratio(record["flops"], result["arms"][names[reference]]["flops"])
            record["other_base_or_teachers"] = other_upstream(runs[arm], runs[reference], seeds)
        result["arms"][names[arm]] = record
    return result


# ----------------------------------------------------------------------------------- the arms' runs
def arm_names(arms: list[Path]) -> dict[Path, str]:
    """Each arm by its folder's name, or its whole path where two arms share a name."""
    short = [arm.name for arm in arms]
    if len(set(short)) == len(short):
        return dict(zip(arms, short, strict=True))
    if len({str(arm) for arm in arms}) < len(arms):
        raise BenchError(f"an arm is given twice: {', '.join(map(str, arms))}")
    return {arm: str(arm) for arm in arms}


def finished_runs(arm: Path) -> dict[int, Path]:
    """seed → run directory, for the arm's `seed-<s>/` runs whose bench finished."""
    if not arm.is_dir():
        raise BenchError(f"{arm}: no such sweep directory (an arm is the --out of `mopd sweep`)")
    runs = {}
    for run in arm.glob("seed-*"):
        seed = run.name.removeprefix("seed-")
        if seed.lstrip("-").isdigit() and (run / "bench" / "report.json").is_file():
            runs[int(seed)] = run
    if not runs:
        raise BenchError(f"{arm}: no seed-<s>/ run with a finished bench (bench/report.json); is it a sweep's --out?")
    return dict(sorted(runs.items()))


def common_seeds(runs: dict[Path, dict[int, Path]], names: dict[Path, str]) -> list[int]:
    seeds = sorted(set.intersection(*(set(r) for r in runs.values())))
    if not seeds:
        finished = "; ".join(f"{names[arm]}: {sorted(r)}" for arm, r in runs.items())
        raise BenchError(f"no pipeline seed has finished in every arm (finished seeds: {finished}); pairing needs the same seeds")
    return seeds


def check_one_suite(reports: dict[Path, dict[int, dict]], names: dict[Path, str]) -> None:
    """Paired task by task only when every run of every arm drew the same tasks."""
    first_arm = next(iter(reports))
    first = suite_identity(next(iter(reports[first_arm].values())))
    for arm, by_seed in reports.items():
        for seed, report in by_seed.items():
            if suite_identity(report) != first:
                raise BenchError(
                    f"{names[arm]}: seed {seed}'s bench suite differs from {names[first_arm]}'s: the tasks are not the "
                    "same, so the arms cannot be paired"
                )


# ------------------------------------------------------------------------------------ the numbers
def arm_summary(reports: dict[int, dict], runs: dict[int, Path], seeds: list[int], cells) -> dict[str, Any]:
    """The arm's own student ÷ teacher and gain kept per cell and pooled, its MOPD FLOPs and its cells' shares."""
    cell_rows = {f"{d}-{e}": pick(cell_summary(reports, d, e, [])) for d, e in cells}
    return {
        "cells": cell_rows,
        "pooled": pick(pooled_summary(reports, cells, [])),
        "flops": [mopd_flops(runs[s]) for s in seeds],
        "shares": {str(s): cell_shares(runs[s]) for s in seeds},
    }


def pick(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: summary[k] for k in SUMMARY_KEYS if k in summary}


def differences(arm: dict[int, dict], reference: dict[int, dict], cells) -> dict[str, Any]:
    """arm − reference in the student's accuracy, per cell and pooled, paired per seed and content, each with the
    smallest difference these seeds would show with 80% power (`detectable_80`)."""
    groups = {**{f"{d}-{e}": [(d, e)] for d, e in cells}, "pooled": list(cells)}
    out = {}
    for name, group in groups.items():
        diff = two_way(subtract(student(arm, group), student(reference, group)))
        out[name] = {**asdict(diff), "detectable_80": detectable(diff)}
    return out


def student(reports: dict[int, dict], cells) -> Matrix:
    """seeds × contents of the student over some cells side by side."""
    matrix = pooled_matrix(reports, "student", cells)
    if matrix is None:
        raise BenchError(f"a run has no student scores in {', '.join(f'{d}-{e}' for d, e in cells)}")
    return matrix


def other_upstream(arm: dict[int, Path], reference: dict[int, Path], seeds: list[int]) -> list[int]:
    """The seeds whose base or teachers were not made from the same inputs as the reference's (their stage hashes
    differ, or are missing): there the difference is not the MOPD setting's alone."""
    def hashes(run: Path) -> list[str | None]:
        return [(read_json(run / stage / "stage.json", default={}) or {}).get("hash") for stage in ("base", "teachers")]

    return [s for s in seeds if None in (mine := hashes(arm[s])) or mine != hashes(reference[s])]


def mopd_flops(run: Path) -> float | None:
    return (read_json(run / "distill" / "stage.json", default={}) or {}).get("compute", {}).get("flops")


def flops_ratio(arm: list[float | None], reference: list[float | None]) -> dict[str, float] | None:
    """Per seed arm ÷ reference, its interval over seeds; None when a run has no FLOP estimate."""
    if any(f is None for f in arm + reference):
        return None
    return asdict(over_seeds([a / r for a, r in zip(arm, reference, strict=True)]))


def cell_shares(run: Path) -> dict[str, dict[str, float]]:
    """Over the MOPD run, each cell's share of the prompts, of the generated tokens and (the mean over steps) of the
    gradient; empty for a run without distill metrics."""
    path = run / "distill" / "metrics.jsonl"
    records = MetricsLog(path).records() if path.is_file() else []
    cells = sorted({key.split("/")[0] for r in records for key in r if key.endswith("/samples")})
    if not cells:
        return {}
    samples = {c: sum(r.get(f"{c}/samples", 0) for r in records) for c in cells}
    tokens = {c: sum(r.get(f"{c}/tokens", 0) for r in records) for c in cells}
    gradient = {c: statistics.fmean(r.get(f"{c}/gradient_share", r.get(f"{c}/tokens", 0) / max(1, r.get("tokens", 1)))
                                    for r in records) for c in cells}  # fmt: skip
    return {c: {"prompts": samples[c] / max(1, sum(samples.values())), "tokens": tokens[c] / max(1, sum(tokens.values())),
                "gradient": gradient[c]} for c in cells}  # fmt: skip


# ------------------------------------------------------------------------------------- the files
def write_comparison(result: dict[str, Any], out: Path, command: str) -> list[str]:
    """compare.json, compare.md and compare.png into `out`; returns the file names."""
    out.mkdir(parents=True, exist_ok=True)
    result = {**result, "command": command}
    write_json_atomic(out / "compare.json", result)
    plot = write_plot(result, out)
    write_text_atomic(out / "compare.md", markdown(result, plot))
    return ["compare.json", "compare.md", plot]


def markdown(result: dict[str, Any], plot: str) -> str:
    ref, arms = result["reference"], [a for a in result["arms"] if a != result["reference"]]
    suite = result["suite"]
    lines = [
        f"# {', '.join(arms)} against {ref}",
        "",
        f"`{result['command']}`",
        "",
        f"Suite {suite['name']} ({suite['split']} split), pipeline seeds {result['seeds']}; every interval is 95%, over "
        "seeds × distinct contents, the differences paired per seed and content."
        + (" One seed: the intervals are over tasks only; an anecdote." if len(result["seeds"]) == 1 else ""),
        "",
        "| cell | " + " | ".join(f"{a}: student ÷ teacher" for a in [ref, *arms])
        + "".join(f" | {a} − {ref}" for a in arms) + " |",
        "|---" * (1 + len(arms) * 2 + 1) + "|",
    ]
    for cell in [*result["cells"], "pooled"]:
        row = [f"**{cell}**" if cell == "pooled" else cell]
        for arm in [ref, *arms]:
            own = result["arms"][arm]["pooled" if cell == "pooled" else "cells"]
            row.append(interval_text((own if cell == "pooled" else own[cell]).get("student_over_teacher")))
        row += [interval_text(result["arms"][a]["minus_reference"][cell], "{:+.3f}") for a in arms]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "| arm | pooled gain kept (s − b) ÷ (t − b) | pooled − reference | MOPD FLOPs ÷ reference |", "|---|---|---|---|"]
    for arm in [ref, *arms]:
        record = result["arms"][arm]
        diff = record.get("minus_reference", {}).get("pooled")
        lines.append(f"| {arm} | {interval_text(record['pooled'].get('gain_share'))} | "
                     f"{difference_text(diff)} | {interval_text(record.get('flops_over_reference'), '{:.3f}')} |")  # fmt: skip
    lines += ["", *detectable_lines(result), *upstream_lines(result), *shares_lines(result), "",
              f"![student − {ref} per cell]({plot})", ""]
    return "\n".join(lines)


def detectable_lines(result: dict[str, Any]) -> list[str]:
    """Per arm, the smallest difference its seeds show with 80% power: below it, "within noise" decides nothing."""
    lines = []
    for arm, record in result["arms"].items():
        if arm == result["reference"]:
            continue
        sizes = [(cell, d.get("detectable_80", math.nan)) for cell, d in record["minus_reference"].items()]
        text = ", ".join(f"{cell} {size:.3f}" for cell, size in sizes if not math.isnan(size))
        if not text:
            continue
        lines.append(f"- {arm}: the smallest difference these seeds show with 80% power (a 95% interval clear of 0): "
                     f"{text}. A smaller one reads \"within noise\" most of the time, whether it is there or not.")
    return [*lines, ""] if lines else []


def upstream_lines(result: dict[str, Any]) -> list[str]:
    """Whether each arm's base and teachers are the reference's, so that a difference is the MOPD setting's alone."""
    lines = []
    for arm, record in result["arms"].items():
        if arm == result["reference"]:
            continue
        other = record["other_base_or_teachers"]
        lines.append(f"- {arm}: base and teachers made from the same inputs as {result['reference']}'s in every seed"
                     if not other else
                     f"- {arm}: **base or teachers differ from {result['reference']}'s in seed(s) {other}**: there the "
                     "difference includes them, not the MOPD setting alone")  # fmt: skip
    return [*lines, ""]


def shares_lines(result: dict[str, Any]) -> list[str]:
    """Per arm and cell, the MOPD run's share of prompts / of gradient, the mean over seeds."""
    arms = [a for a in result["arms"] if result["arms"][a]["shares"] and all(result["arms"][a]["shares"].values())]
    if not arms:
        return []
    lines = ["Each cell's share of the MOPD prompts / of the gradient (mean over seeds):", "",
             "| cell | " + " | ".join(arms) + " |", "|---" * (1 + len(arms)) + "|"]  # fmt: skip
    for cell in result["cells"]:
        row = [cell]
        for arm in arms:
            per_seed = [shares.get(cell) for shares in result["arms"][arm]["shares"].values()]
            if any(s is None for s in per_seed):
                row.append("—")
                continue
            prompts, gradient = (statistics.fmean(s[k] for s in per_seed) for k in ("prompts", "gradient"))
            row.append(f"{prompts:.2f} / {gradient:.2f}")
        lines.append("| " + " | ".join(row) + " |")
    return lines


def interval_text(x: dict[str, float] | None, form: str = "{:.2f}") -> str:
    if not x:
        return "—"
    if x["low"] != x["low"]:  # NaN: one draw, no interval
        return form.format(x["mean"])
    return f"{form.format(x['mean'])} [{form.format(x['low'])}, {form.format(x['high'])}]"


def difference_text(x: dict[str, float] | None) -> str:
    if not x:
        return "—"
    above, below = verdict(x, 0.0), verdict({"mean": -x["mean"], "low": -x["high"], "high": -x["low"]}, 0.0)
    word = "above 0" if above["beyond_noise"] else "below 0" if below["beyond_noise"] else "within noise"
    return f"{interval_text(x, '{:+.3f}')} ({word})"


def write_plot(result: dict[str, Any], out: Path) -> str:
    """Each arm's difference from the reference per cell and pooled, with its 95% interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [a for a in result["arms"] if a != result["reference"]]
    rows = [*result["cells"], "pooled"]
    figure, axis = plt.subplots(figsize=(max(7, 0.9 * len(rows)), 4))
    width = 0.8 / len(arms)
    for k, arm in enumerate(arms):
        diffs = [result["arms"][arm]["minus_reference"][r] for r in rows]
        xs = [i + (k - (len(arms) - 1) / 2) * width for i in range(len(rows))]
        errors = [[d["mean"] - d["low"] for d in diffs], [d["high"] - d["mean"] for d in diffs]]
        axis.errorbar(xs, [d["mean"] for d in diffs], yerr=errors, fmt="o", capsize=3, label=arm)
    axis.axhline(0.0, color="grey", linewidth=0.8)
    axis.set_xticks(range(len(rows)), rows, rotation=30, ha="right")
    axis.set_ylabel(f"student accuracy − {result['reference']}")
    axis.set_title(f"{result['suite']['split']} split, seeds {result['seeds']}: mean and 95% interval")
    axis.legend(fontsize=8)
    name = "compare.png"
    figure.savefig(out / name, dpi=110, bbox_inches="tight")
    plt.close(figure)
    return name
