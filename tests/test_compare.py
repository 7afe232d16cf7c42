"""`mopd compare`: arms of planted sweeps against a reference, paired per seed and task, find what was planted."""

import json

import pytest

from mopd.bench.compare import compare
from mopd.bench.suite import BenchError
from mopd.cli import main
from tests.planted import CELLS, write_runs

TOKENS = {"low": 2.0, "high": 20.0, "max": 60.0}


def planted_arm(root, name, student, seeds=(0, 1, 2), flops_factor=1.0):
    """A sweep directory whose runs' teachers (0.7) and base (0.2) are the reference's; only the student differs."""
    accuracy = {"base": dict.fromkeys(CELLS, 0.2), "teacher": dict.fromkeys(CELLS, 0.7), "student": student}
    runs = write_runs(root / name, seeds, accuracy, TOKENS)
    for run in runs.values():
        marker = run / "distill" / "stage.json"
        stage = json.loads(marker.read_text())
        stage["compute"]["flops"] *= flops_factor
        marker.write_text(json.dumps(stage))
        shares = {"general-low/samples": 3 if name == "static" else 1, "code-low/samples": 1,
                  "general-low/tokens": 30, "code-low/tokens": 90, "tokens": 120}  # fmt: skip
        (run / "distill" / "metrics.jsonl").write_text(json.dumps({"step": 1, **shares}) + "\n")
    return root / name


def test_an_arm_better_in_one_cell_is_above_the_reference_there_and_nowhere_else(tmp_path):
    """The same seed draws the same uniforms for the student in both arms, so where the planted accuracy is the same
    the paired difference is exactly 0, and where the arm's is higher it is above 0 on every task it differs."""
    static = planted_arm(tmp_path, "static", dict.fromkeys(CELLS, 0.5))
    better = planted_arm(tmp_path, "better", {**dict.fromkeys(CELLS, 0.5), "code-low": 0.9}, flops_factor=1.2)
    result = compare(static, [better])

    diff = result["arms"]["better"]["minus_reference"]
    assert diff["code-low"]["low"] > 0.25 and diff["code-low"]["mean"] == pytest.approx(0.4, abs=0.12)
    assert all(diff[c]["mean"] == 0 for c in CELLS if c != "code-low")
    assert diff["pooled"]["mean"] == pytest.approx(diff["code-low"]["mean"] / len(CELLS))
    assert result["arms"]["better"]["flops_over_reference"]["mean"] == pytest.approx(1.2)
    assert result["seeds"] == [0, 1, 2] and result["reference"] == "static" and result["cells"] == CELLS
    student_over_teacher = result["arms"]["static"]["cells"]["general-low"]["student_over_teacher"]["mean"]
    assert student_over_teacher == pytest.approx(5 / 7, abs=0.15)
    assert result["arms"]["static"]["shares"]["0"]["general-low"] == {"prompts": 0.75, "tokens": 0.25, "gradient": 0.25}
    assert result["arms"]["better"]["other_base_or_teachers"] == []
    assert 0 < diff["code-low"]["detectable_80"] < 0.4  # three seeds find the planted +0.4 ...
    assert diff["code-low"]["detectable_80"] > 2.8 * diff["code-low"]["se"]  # ... and t quantiles exceed the normal's


def test_seeds_whose_base_or_teachers_differ_from_the_references_are_named(tmp_path):
    static = planted_arm(tmp_path, "static", dict.fromkeys(CELLS, 0.5))
    other = planted_arm(tmp_path, "other", dict.fromkeys(CELLS, 0.5))
    marker = other / "seed-1" / "teachers" / "stage.json"
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "hash": "another"}))
    result = compare(static, [other])
    assert result["arms"]["other"]["other_base_or_teachers"] == [1]
    assert main(["compare", str(static), str(other), "--out", str(tmp_path / "cmp")]) == 0
    assert "base or teachers differ from static's in seed(s) [1]" in (tmp_path / "cmp" / "compare.md").read_text()


def test_the_command_writes_the_table_the_plot_and_the_json(tmp_path):
    static = planted_arm(tmp_path, "static", dict.fromkeys(CELLS, 0.5))
    worse = planted_arm(tmp_path, "worse", dict.fromkeys(CELLS, 0.2))
    assert main(["compare", str(static), str(worse), "--out", str(tmp_path / "cmp")]) == 0
    text = (tmp_path / "cmp" / "compare.md").read_text()
    assert "| worse |" in text and "(below 0)" in text and "the smallest difference these seeds show with 80% power" in text and "| general-low | 0.75 / 0.25 | 0.50 / 0.25 |" in text
    assert (tmp_path / "cmp" / "compare.png").stat().st_size > 0
    result = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert result["command"].startswith("mopd compare") and result["arms"]["worse"]["minus_reference"]["pooled"]["high"] < 0


def test_only_the_seeds_every_arm_finished_are_paired(tmp_path):
    static = planted_arm(tmp_path, "static", dict.fromkeys(CELLS, 0.5), seeds=(0, 1, 2))
    other = planted_arm(tmp_path, "other", dict.fromkeys(CELLS, 0.5), seeds=(1, 2, 3))
    assert compare(static, [other])["seeds"] == [1, 2]
    disjoint = planted_arm(tmp_path, "disjoint", dict.fromkeys(CELLS, 0.5), seeds=(7,))
    with pytest.raises(BenchError, match=r"no pipeline seed has finished in every arm .*static: \[0, 1, 2\]; disjoint: \[7\]"):
        compare(static, [disjoint])


def test_arms_that_cannot_be_paired_are_refused_naming_them(tmp_path):
    static = planted_arm(tmp_path, "static", dict.fromkeys(CELLS, 0.5))
    with pytest.raises(BenchError, match="no seed-<s>/ run with a finished bench"):
        compare(static, [tmp_path])  # not a sweep
    with pytest.raises(BenchError, match="no such sweep directory"):
        compare(static, [tmp_path / "missing"])
    other = planted_arm(tmp_path, "other", dict.fromkeys(CELLS, 0.5))
    report = other / "seed-1" / "bench" / "report.json"
    data = json.loads(report.read_text())
    data["suite"]["seeds"] = [2002]  # another draw of tasks
    report.write_text(json.dumps(data))
    with pytest.raises(BenchError, match="other: seed 1's bench suite differs from static's"):
        compare(static, [other])
    code = main(["compare", str(static), str(tmp_path / "missing")])
    assert code == 2
