"""Learning curves on dev (`mopd.bench.curves`): where a curve reaches the bar, the curves built from a
planted report, the sweep's ratio over seeds, and the recipe checks. (The stage end to end, on real
snapshots: tests/test_smoke_recipe.py.)"""

import json
import math
from pathlib import Path

import pytest

from mopd.bench.curves import build_curves, reach
from mopd.bench.seeds import curves_lines, curves_summary
from mopd.pipeline import build_stages
from mopd.recipe import RecipeError, load_recipe

ROOT = Path(__file__).resolve().parent.parent


def curve(*points):
    return [{"step": k, "flops": flops, "accuracy": accuracy} for k, (flops, accuracy) in enumerate(points)]


def test_a_curve_reaches_the_bar_where_the_line_between_two_points_crosses_it():
    assert reach(curve((0, 0.2), (10, 0.4), (20, 0.8)), 0.6) == {"flops": 15.0, "step": 2}
    assert reach(curve((5, 0.7), (10, 0.9)), 0.6) == {"flops": 5, "step": 0}  # already there at the start
    assert reach(curve((0, 0.2), (10, 0.6)), 0.6) == {"flops": 10.0, "step": 1}  # exactly at a point
    # a curve that rises above the bar, falls and rises again is read at its first crossing
    assert reach(curve((0, 0.2), (10, 0.7), (20, 0.3), (30, 0.9)), 0.6)["flops"] == pytest.approx(8.0)
    never = reach(curve((0, 0.2), (10, 0.5), (20, 0.4)), 0.6)
    assert never["flops"] is None and never["best"] == {"step": 1, "flops": 10, "accuracy": 0.5}


def planted_report(accuracy: dict[str, dict[str, float]]) -> dict:
    results = [
        {"model": model, "domain": cell.split("-")[0], "effort": cell.split("-")[1], "accuracy": value,
         "audit": {"overlap": 0, "tasks": 4, "stages": {}}}
        for model, cells in accuracy.items() for cell, value in cells.items()
    ]  # fmt: skip
    return {"suite": {"path": "eval/tiny-dev.yaml", "split": "dev"}, "results": results}


def test_curves_place_each_point_at_its_compute_and_compare_where_they_reach_the_bar():
    both = ["general-low", "code-high"]
    report = planted_report({
        "base": dict.fromkeys(both, 0.2),
        "general-low": {"general-low": 0.6}, "code-high": {"code-high": 0.4},  # teachers' mean 0.5: bar 0.45
        "student@2": {"general-low": 0.3, "code-high": 0.3}, "student@4": {"general-low": 0.6, "code-high": 0.4},
        "mixed_rl@5": {"general-low": 0.3, "code-high": 0.2}, "mixed_rl@9": {"general-low": 0.5, "code-high": 0.5},
    })  # fmt: skip
    points = [
        {"name": "student@2", "series": "student", "step": 2, "stage_flops": 10.0},
        {"name": "student@4", "series": "student", "step": 4, "stage_flops": 20.0},
        {"name": "mixed_rl@5", "series": "mixed_rl", "step": 5, "stage_flops": 50.0},
        {"name": "mixed_rl@9", "series": "mixed_rl", "step": 9, "stage_flops": 90.0},
    ]
    curves = build_curves(report, points, teachers=100.0, target=0.9)
    assert curves["bar"] == pytest.approx(0.45) and curves["teachers_pooled"] == pytest.approx(0.5)
    student = curves["series"]["student"]
    # the student starts at the base's accuracy, after the teachers' RL; its points add MOPD's FLOPs
    assert [(p["flops"], p["accuracy"]) for p in student["points"]] == [(100.0, 0.2), (110.0, 0.3), (120.0, 0.5)]
    assert student["reached"]["flops"] == pytest.approx(110 + 10 * (0.45 - 0.3) / 0.2)  # 117.5
    mixed = curves["series"]["mixed_rl"]
    assert [p["flops"] for p in mixed["points"]] == [0.0, 50.0, 90.0]
    assert mixed["reached"]["flops"] == pytest.approx(50 + 40 * (0.45 - 0.25) / 0.25)  # 82
    assert curves["mixed_over_mopd"] == pytest.approx(82 / 117.5)
    assert curves["overlap"] == {"overlap": 0, "tasks": 4 * 12, "rows_without_audit": 0}  # 12 (model, cell) rows

    # where the base is already at the bar (teachers that learnt nothing), no training was needed: no ratio
    for row in report["results"]:
        row["accuracy"] = 0.0
    flat = build_curves(report, points, teachers=100.0, target=0.9)
    assert flat["base_reaches_bar"] and "mixed_over_mopd" not in flat
    assert flat["series"]["mixed_rl"]["reached"]["flops"] == 0.0


def write_curves(tmp_path: Path, ratios: dict[int, float | None]) -> dict[int, Path]:
    runs = {}
    for seed, value in ratios.items():
        run = tmp_path / f"seed-{seed}"
        (run / "curves").mkdir(parents=True)
        reached = {"student": {"reached": {"flops": 100.0}}, "mixed_rl": {"reached": {"flops": None if value is None else 100.0 * value}}}
        curves = {"suite": "eval/tiny-dev.yaml", "split": "dev", "target": 0.9, "bar": 0.3, "series": reached,
                  "overlap": {"overlap": 0, "tasks": 9}, **({} if value is None else {"mixed_over_mopd": value})}  # fmt: skip
        (run / "curves" / "curves.json").write_text(json.dumps(curves))
        runs[seed] = run
    return runs


def test_the_sweep_takes_the_geometric_mean_of_the_seeds_ratios_where_both_reached_the_bar(tmp_path):
    summary = curves_summary(write_curves(tmp_path, {0: 2.0, 1: 8.0, 2: None}))
    assert summary["both_reached"] == 2
    ratio = summary["mixed_over_mopd"]
    assert ratio["mean"] == pytest.approx(4.0)  # exp(mean(log 2, log 8))
    assert ratio["low"] < 4.0 < ratio["high"] and math.log(ratio["high"] / 4.0) == pytest.approx(math.log(4.0 / ratio["low"]))
    assert summary["seeds"]["2"]["mixed_rl"] is None
    text = "\n".join(curves_lines({"curves": summary}))
    assert "| 2 | 0.300 | 100 | not reached | — |" in text and "geometric mean over 2 seed(s)" in text
    assert curves_summary({0: tmp_path / "no-curves"}) is None


def test_curves_need_snapshots_and_a_dev_suite():
    with pytest.raises(RecipeError, match=r"curves: needs distill\.curve_every"):
        load_recipe(ROOT / "recipes/smoke.yaml", ["curves={suite: eval/tiny-dev.yaml}", "distill.curve_every=null"])
    with pytest.raises(RecipeError, match=r"curves: needs baselines\.mixed_rl\.curve_every"):
        load_recipe(ROOT / "recipes/smoke.yaml", ["curves={suite: eval/tiny-dev.yaml}", "distill.curve_every=1",
                                                  "baselines.mixed_rl={}"])  # fmt: skip
    test = load_recipe(ROOT / "recipes/smoke.yaml", ["curves={suite: eval/tiny.yaml}", "distill.curve_every=1",
                                                     "baselines.mixed_rl={curve_every: 2}"])  # fmt: skip
    with pytest.raises(RecipeError, match=r"curves\.suite: eval/tiny\.yaml is a test suite"):
        build_stages(test)  # the pipeline refuses before its first stage
