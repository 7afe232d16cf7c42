"""Learning curves on dev: the compute MOPD and the mixed-RL baseline take to reach the teachers.

    run_curves_stage(ctx)   the pipeline's `curves` stage (after distill and the baselines, before bench)
    check_curves_suite      a recipe's `curves.suite` must be a dev suite (checked before any work)

The student's snapshots (`distill/curve/step-N/`, then `distill/model`) and the baseline's
(`baselines/mixed_rl/curve/step-N/`, then the baseline itself) answer every cell of the dev suite,
beside the base and each teacher on its own cell (`run_bench`, whose audit refuses a task any of
them trained on). Each point sits at the post-training FLOPs (`mopd.compute`) that made it,
counted from the base:

    the student after MOPD step k    all the teachers' RL + MOPD's steps 1..k (it needs its teachers)
    the baseline after step k        its steps 1..k
    the base                         0 on the baseline's curve, the teachers' RL on the student's

A curve's accuracy is the mean over cells of within-budget accuracy. The bar is `curves.target`
times the teachers' mean (each on its own cell). A curve reaches it at the FLOPs interpolated
linearly between its last point below the bar and its first point at or above it; one that never
does says so, with its best point. `mixed_over_mopd` is the baseline's FLOPs to the bar ÷ the
student's (teachers + MOPD): above 1, MOPD got there with less compute; it is left out where the
base already reaches the bar (`base_reaches_bar`: no training was needed). One run is one draw;
the sweep (`mopd sweep`) puts intervals over seeds on it.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from statistics import fmean
from typing import Any

from mopd.artifacts import (
    MetricsLog,
    checkpoint_in,
    curve_snapshots,
    read_json,
    write_json_atomic,
    write_text_atomic,
)
from mopd.bench.audit import base_dir
from mopd.bench.run import ModelRef, bench_compute, run_bench
from mopd.bench.seeds import overlap
from mopd.bench.suite import load_suite
from mopd.compute import checkpoint_active_parameters, steps_compute
from mopd.recipe import CELLS, Recipe, RecipeError, resolve_path

SERIES = {"student": "distill", "mixed_rl": "baselines/mixed_rl"}  # curve → the stage that trained it


def check_curves_suite(recipe: Recipe, recipe_dir: Path | None = None, where: str = "curves.suite") -> Path:
    """The curves' suite file; a RecipeError starting with `where` unless it is a dev suite (test numbers are
    reported, never read to compare methods while choosing anything)."""
    suite = resolve_path(recipe.curves.suite, recipe_dir)
    try:
        split = load_suite(suite).split
    except RecipeError as err:
        raise RecipeError(f"{where}: {err}") from None
    if split != "dev":
        raise RecipeError(f"{where}: {suite} is a {split} suite; learning curves are read on a dev suite")
    return suite


def run_curves_stage(ctx, suite: Path) -> dict[str, Any]:
    """Pipeline stage: score every snapshot on the dev `suite`, write curves.json/.md/.png; returns its compute."""
    recipe, spec = ctx.recipe, ctx.recipe.curves
    points, teachers = curve_points(recipe, ctx.run_dir, ctx.inputs), teachers_flops(ctx)  # before any sampling
    refs = [ModelRef("base", base_dir(stage_dir(ctx, "base")), "base")]
    refs += [ModelRef(cell, stage_dir(ctx, "teachers") / cell, "teacher", cell) for cell in CELLS
             if (stage_dir(ctx, "teachers") / cell / "config.json").is_file()]  # fmt: skip
    refs += [ModelRef(p["name"], Path(p["path"]), "student" if p["series"] == "student" else "baseline") for p in points]
    report = run_bench(
        refs, suite=suite, n=spec.n, out=None, backend=recipe.bench.backend or recipe.rollout,
        recipe=recipe, workers=spec.workers, resources=spec.resources,
    )  # fmt: skip
    write_json_atomic(ctx.dir / "report.json", report)
    curves = build_curves(report, points, teachers, spec.target)
    write_json_atomic(ctx.dir / "curves.json", curves)
    write_text_atomic(ctx.dir / "curves.md", markdown(curves))
    plot(curves, ctx.dir / "curves.png")
    return bench_compute(report)


def stage_dir(ctx, name: str) -> Path:
    return Path(ctx.inputs.get(name, ctx.run_dir / name))


# ----------------------------------------------------------------------------- the points
def curve_points(recipe: Recipe, run_dir: Path, inputs: dict[str, Path]) -> list[dict[str, Any]]:
    """Each snapshot, then the final model, of the student and (where trained) the baseline, with the
    FLOPs of the steps before it in its own stage."""
    from mopd.distill.trainer import distill_compute, distill_models

    student, teachers = distill_models(recipe, run_dir, inputs)
    trained_in = {series: Path(inputs.get(stage, run_dir / stage)) for series, stage in SERIES.items()}
    flops = {"student": lambda records: distill_compute(records, student, teachers, recipe.distill.scores_a_reference)["flops"]}
    if recipe.baselines.mixed_rl is not None:
        active = checkpoint_active_parameters(checkpoint_in(trained_in["mixed_rl"]))
        flops["mixed_rl"] = lambda records: steps_compute(records, active)["flops"]
    points = []
    for series, fn in flops.items():
        trained = trained_in[series]
        records = MetricsLog(trained / "metrics.jsonl").records()
        last = max(r["step"] for r in records)
        snapshots = {**curve_snapshots(trained), last: checkpoint_in(trained)}
        points += [
            {"name": f"{series}@{step}", "series": series, "step": step, "path": str(path),
             "stage_flops": fn([r for r in records if r["step"] <= step])}
            for step, path in sorted(snapshots.items())
        ]  # fmt: skip
    return points


def teachers_flops(ctx) -> float:
    marker = read_json(stage_dir(ctx, "teachers") / "stage.json", default={}) or {}
    if "flops" not in marker.get("compute", {}):
        raise RecipeError(f"curves: {stage_dir(ctx, 'teachers')}/stage.json has no compute.flops (re-run the teachers)")
    return marker["compute"]["flops"]


# ----------------------------------------------------------------------------- the curves
def build_curves(report: dict[str, Any], points: list[dict[str, Any]], teachers: float, target: float) -> dict[str, Any]:
    """Pooled dev accuracy per point, the bar, and where each curve reaches it."""
    pooled = {name: fmean(accuracies) for name, accuracies in accuracies_by_model(report).items()}
    per_teacher = {row["model"]: row["accuracy"] for row in report["results"] if row["model"] in CELLS}
    bar = target * fmean(per_teacher.values())
    start = {"student": teachers, "mixed_rl": 0.0}  # the base's place on each curve
    series = {}
    for name in dict.fromkeys(p["series"] for p in points):
        curve = [{"step": 0, "flops": start[name], "accuracy": pooled["base"]}]
        curve += [{"step": p["step"], "flops": start[name] + p["stage_flops"], "accuracy": pooled[p["name"]]}
                  for p in points if p["series"] == name]  # fmt: skip
        series[name] = {"points": curve, "reached": reach(curve, bar)}
    curves = {
        "suite": report["suite"]["path"], "split": report["suite"]["split"], "target": target,
        "teachers": per_teacher, "teachers_pooled": fmean(per_teacher.values()), "bar": bar,
        "teachers_flops": teachers, "series": series, "overlap": overlap({0: report}),
    }  # fmt: skip
    curves["base_reaches_bar"] = pooled["base"] >= bar  # then no training is needed to reach it: no ratio
    reached = {name: s["reached"]["flops"] for name, s in series.items() if s["reached"]["flops"] is not None}
    if "student" in reached and "mixed_rl" in reached and not curves["base_reaches_bar"]:
        curves["mixed_over_mopd"] = reached["mixed_rl"] / reached["student"]
    return curves


def accuracies_by_model(report: dict[str, Any]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for row in report["results"]:
        out.setdefault(row["model"], []).append(row["accuracy"])
    return out


def reach(curve: list[dict[str, float]], bar: float) -> dict[str, Any]:
    """The FLOPs where the curve first reaches `bar` (linear between points), or None and its best point."""
    if curve[0]["accuracy"] >= bar:
        return {"flops": curve[0]["flops"], "step": curve[0]["step"]}
    for before, after in itertools.pairwise(curve):
        if after["accuracy"] >= bar:
            share = (bar - before["accuracy"]) / (after["accuracy"] - before["accuracy"])
            return {"flops": before["flops"] + share * (after["flops"] - before["flops"]), "step": after["step"]}
    best = max(curve, key=lambda p: p["accuracy"])
    return {"flops": None, "best": best}


# ----------------------------------------------------------------------------- writing
def markdown(curves: dict[str, Any]) -> str:
    names = {"student": "MOPD student (teachers' RL + MOPD)", "mixed_rl": "mixed RL"}
    lines = [
        f"# Learning curves on {curves['suite']} ({curves['split']} split; overlap "
        f"{curves['overlap']['overlap']}/{curves['overlap']['tasks']})",
        "",
        f"Bar: {curves['target']:.0%} of the teachers' mean dev accuracy {curves['teachers_pooled']:.3f} = "
        f"**{curves['bar']:.3f}** (each teacher on its own cell). FLOPs: post-training estimates from the "
        "base (`mopd.compute`); one run, one draw.",
        "",
        "| curve | FLOPs to the bar | best accuracy |",
        "|---|---:|---:|",
    ]
    for name, series in curves["series"].items():
        best = max(p["accuracy"] for p in series["points"])
        flops = series["reached"]["flops"]
        lines.append(f"| {names[name]} | {'not reached' if flops is None else f'{flops:.3g}'} | {best:.3f} |")
    if "mixed_over_mopd" in curves:
        lines += ["", f"Mixed RL's FLOPs to the bar ÷ MOPD's: **{curves['mixed_over_mopd']:.2f}**"]
    if curves["base_reaches_bar"]:
        lines += ["", "The base already reaches the bar: no compute ratio."]
    lines += ["", "| curve | step | FLOPs | dev accuracy |", "|---|---:|---:|---:|"]
    for name, series in curves["series"].items():
        lines += [f"| {name} | {p['step']} | {p['flops']:.3g} | {p['accuracy']:.3f} |" for p in series["points"]]
    return "\n".join(lines) + "\n"


def plot(curves: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, series in curves["series"].items():
        ax.plot([p["flops"] for p in series["points"]], [p["accuracy"] for p in series["points"]], marker="o",
                label={"student": "MOPD student", "mixed_rl": "mixed RL"}[name])  # fmt: skip
    ax.axhline(curves["bar"], color="grey", linestyle="--", label=f"{curves['target']:.0%} of the teachers")
    ax.axvline(curves["teachers_flops"], color="grey", linestyle=":", linewidth=0.8, label="teachers' RL")
    ax.set_xlabel("post-training FLOPs (estimate)")
    ax.set_ylabel("dev accuracy, mean over cells")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
