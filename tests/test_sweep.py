"""`mopd sweep`'s summary: intervals over seeds and tasks, and the claims they decide, on planted
bench reports whose answers are known. (The command end to end: tests/test_smoke_recipe.py.)"""

import json
import math
import random
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from mopd.bench.seeds import summarise, verdict, write_summary
from mopd.recipe import RecipeError
from mopd.stats import Interval, accuracy, clustered, detectable, gain_share, ratio, two_way
from mopd.sweep import format_seeds, parse_seeds
from tests.planted import CELLS, TASKS, write_runs

ROOT = Path(__file__).resolve().parent.parent


def test_claims_follow_the_planted_accuracies(tmp_path):
    accuracy = {
        "base": dict.fromkeys(CELLS, 0.2),
        "teacher": {**dict.fromkeys(CELLS, 0.7), "code-low": 0.2},  # code-low's teacher learned nothing
        "student": {**dict.fromkeys(CELLS, 0.75), "agent-max": 0.35},  # the student lost agent-max
    }
    tokens = {"low": 2.0, "high": 20.0, "max": 60.0}
    summary = summarise(write_runs(tmp_path, [0, 1, 2], accuracy, tokens))

    claims = summary["claims"]
    assert not claims["teacher_beats_base"]["holds"]
    assert [c for c, v in claims["teacher_beats_base"]["cells"].items() if not v["beyond_noise"]] == ["code-low"]
    assert [c for c, v in claims["student_reaches_90pct"]["cells"].items() if not v["holds"]] == ["agent-max"]
    assert claims["student_rises_with_effort"]["domains"]["general"]["thinking_tokens"]["beyond_noise"]
    # equal accuracy at every effort: the accuracy steps sit at 0, not beyond noise either way
    assert not claims["student_rises_with_effort"]["domains"]["general"]["accuracy"]["beyond_noise"]
    assert summary["overlap"] == {"overlap": 0, "tasks": 3 * (9 + 9 + 9) * TASKS, "rows_without_audit": 0}
    cell = summary["cells"]["general-high"]
    assert cell["teacher"]["low"] < 0.7 < cell["teacher"]["high"]
    assert cell["per_seed"]["base"] == [statistics.fmean(r) for r in per_seed_rewards(tmp_path, "base", "general", "high")]
    assert summary["runs"]["0"]["seconds"] == 180.0
    mopd_share = summary["compute"]["mopd_over_teachers"]
    assert mopd_share["mean"] == pytest.approx(0.5) and mopd_share["low"] < 0.5 < mopd_share["high"]
    assert "mixed_rl_over_teachers_plus_mopd" not in summary["compute"]  # no baseline in these runs

    files = write_summary(summary, tmp_path, "mopd sweep planted")
    text = (tmp_path / "summary.md").read_text()
    assert files == ["summary.json", "summary.md", "summary.png"] and (tmp_path / "summary.png").stat().st_size > 0
    assert "**does not hold** (fails in code-low)" in text and "(fails in agent-max)" in text
    assert "MOPD compute ÷ the teachers' RL compute: 0.500 [" in text
    assert "overlap 0/" in text and json.loads((tmp_path / "summary.json").read_text())["command"] == "mopd sweep planted"


def test_a_cell_unmeasured_in_one_seed_fails_a_claim_over_every_cell_and_is_named(tmp_path):
    accuracy = {"base": dict.fromkeys(CELLS, 0.2), "teacher": dict.fromkeys(CELLS, 0.7), "student": dict.fromkeys(CELLS, 0.7)}
    runs = write_runs(tmp_path, [0, 1, 2], accuracy, {"low": 2.0, "high": 20.0, "max": 60.0})
    report_file = runs[1] / "bench" / "report.json"
    report = json.loads(report_file.read_text())
    report["results"] = [r for r in report["results"] if (r["model"], r["domain"], r["effort"]) != ("student", "code", "max")]
    report_file.write_text(json.dumps(report))  # seed 1's student was never scored on code-max

    summary = summarise(runs)
    reaches = summary["claims"]["student_reaches_90pct"]
    assert not reaches["holds"] and reaches["cells"]["code-max"]["measured"] is False
    assert summary["claims"]["teacher_beats_base"]["holds"]  # base and teacher were scored everywhere
    assert summary["efforts"]["code"]["unmeasured"] == ["max"] and summary["efforts"]["code"]["efforts"] == ["low", "high"]
    assert summary["claims"]["student_rises_with_effort"]["domains"]["code"]["accuracy"]["measured"] is False
    write_summary(summary, tmp_path, "test")
    assert "not measured in code-max)" in (tmp_path / "summary.md").read_text()


def per_seed_rewards(tmp_path: Path, model: str, domain: str, effort: str) -> list[list[float]]:
    rows = []
    for seed in (0, 1, 2):
        report = json.loads((tmp_path / f"seed-{seed}" / "bench" / "report.json").read_text())
        rows += [r["task_rewards"] for r in report["results"]
                 if (r["model"], r["domain"], r["effort"]) == (model, domain, effort)]
    return rows


def test_two_way_interval_counts_seed_and_task_variation():
    rng = random.Random(0)
    seeds, tasks = 3, 200
    # one seed: the usual paired interval over tasks
    row = [rng.gauss(0, 1) for _ in range(tasks)]
    one = two_way([row])
    assert one.se == pytest.approx(statistics.stdev(row) / math.sqrt(tasks))
    # a seed effect shared by all tasks: a constant shift per seed widens the interval by its spread
    shifts = [-1.0, 0.0, 1.0]
    with_seeds = two_way([[v + shift for v in row] for shift in shifts])
    expected = math.sqrt(statistics.variance(shifts) / seeds + statistics.variance(row) / tasks)
    assert with_seeds.se == pytest.approx(expected, rel=1e-9)
    assert with_seeds.df < 3  # dominated by three seeds: a t quantile far above 1.96
    assert with_seeds.high - with_seeds.mean > 3 * with_seeds.se


def test_the_detectable_difference_is_found_four_times_in_five():
    """At the difference `detectable` names, the paired 95% interval clears 0 in about 80% of repeats, and at half
    of it in far fewer: the sentence compare.md prints is what happens."""
    rng = random.Random(2)
    tasks = 40
    size = detectable(Interval(0.0, 0.0, 0.0, se=1 / math.sqrt(tasks), df=tasks - 1))
    assert size == pytest.approx((2.0227 + 0.8513) / math.sqrt(tasks), rel=1e-3)  # t(39) quantiles .975 and .80

    def found(delta: float) -> float:
        clears = [two_way([[rng.gauss(delta, 1.0) for _ in range(tasks)]]).low > 0 for _ in range(3000)]
        return sum(clears) / len(clears)

    assert found(size) == pytest.approx(0.80, abs=0.03)
    assert found(size / 2) < 0.40
    assert math.isnan(detectable(Interval(0.5, math.nan, math.nan, se=math.nan, df=math.nan)))  # one draw


def test_ratios_by_the_delta_method_match_a_bootstrap():
    rng = random.Random(1)
    teacher = [[float(rng.random() < 0.6) for _ in range(300)] for _ in range(3)]
    student = [[t if rng.random() < 0.8 else float(rng.random() < 0.5) for t in row] for row in teacher]
    r = ratio(student, teacher)
    assert r.mean == pytest.approx(sum(map(sum, student)) / sum(map(sum, teacher)))
    boot = []
    for _ in range(400):
        cols = [rng.randrange(300) for _ in range(300)]
        boot.append(sum(s[c] for s in student for c in cols) / sum(t[c] for t in teacher for c in cols))
    assert r.se == pytest.approx(statistics.stdev(boot), rel=0.25)
    base = [[0.0] * 300 for _ in range(3)]
    assert gain_share(student, teacher, base).mean == pytest.approx(r.mean)  # a base at 0 leaves the ratio
    assert math.isnan(gain_share(student, base, teacher).mean)  # a "teacher" below its base: no share


def test_the_pooled_row_compares_the_baseline_and_accuracies_stay_in_0_1(tmp_path):
    """A baseline's pooled accuracy and its paired differences sit beside the cells'; an accuracy
    near the floor keeps its interval inside [0, 1], a difference does not need to."""
    runs = write_runs(tmp_path, [0, 1, 2], {"base": dict.fromkeys(CELLS, 0.2), "teacher": dict.fromkeys(CELLS, 0.6),
                                            "student": dict.fromkeys(CELLS, 0.5)}, {"low": 1.0, "high": 2.0, "max": 3.0})
    for seed, run in runs.items():
        report = json.loads((run / "bench" / "report.json").read_text())
        rng = random.Random(100 + seed)
        # a run writes mixed RL as a baseline and the checkpoint its base was warmed up from as a model
        report["models"] += [{"name": "mixed_rl", "role": "baseline", "cell": None}, {"name": "pretrained", "role": "model", "cell": None}]
        for r in [r for r in report["results"] if r["model"] == "base"]:
            report["results"].append({**r, "model": "mixed_rl", "task_rewards": [float(rng.random() < 0.4) for _ in range(TASKS)]})
            report["results"].append({**r, "model": "pretrained", "task_rewards": [0.0] * TASKS})
        (run / "bench" / "report.json").write_text(json.dumps(report))
    summary = summarise(runs)
    pooled = summary["pooled"]
    assert summary["baselines"] == ["mixed_rl", "pretrained"]
    assert pooled["mixed_rl"]["low"] < 0.4 < pooled["mixed_rl"]["high"]
    assert pooled["student_minus_mixed_rl"]["mean"] == pytest.approx(pooled["student"]["mean"] - pooled["mixed_rl"]["mean"])
    assert pooled["pretrained"]["mean"] == 0.0 and pooled["student_minus_pretrained"]["mean"] == pytest.approx(pooled["student"]["mean"])
    floor = [[1.0] + [0.0] * 19, [0.0] * 20, [0.0] * 20]  # one right answer in 60: t's interval dips below 0
    assert two_way(floor).low < 0 and accuracy(floor).low == 0.0 and accuracy(floor).mean == two_way(floor).mean


def test_a_ratio_equal_to_the_target_in_exact_counts_reaches_it():
    # the sweep's code-low student answered 9 of 384 and its teacher 10: 0.9 exactly, 0.8999999999999999 in floats
    exact = (9 / 384) / (10 / 384)
    assert exact < 0.9
    assert verdict({"mean": exact, "low": exact}, above=0.9, inclusive=True) == {"holds": True, "beyond_noise": True}
    assert verdict({"mean": 0.899, "low": 0.5}, above=0.9, inclusive=True)["holds"] is False
    difference = 0.3 - 0.1 - 0.2  # -2.8e-17: a float zero is not above zero, nor a float-noise positive
    assert verdict({"mean": -difference, "low": -difference}, above=0.0) == {"holds": False, "beyond_noise": False}


def test_interval_text_says_when_there_is_one_draw():
    assert Interval(0.5, math.nan, math.nan, math.nan, 0).text() == "0.50 (no interval: one draw)"
    assert Interval(0.5, 0.4, 0.6, 0.05, 10).text() == "0.50 [0.40, 0.60]"


def test_sweep_refuses_bad_seeds_before_any_run(tmp_path):
    mopd = Path(sys.executable).parent / "mopd"
    result = subprocess.run([mopd, "sweep", "recipes/smoke.yaml", "--seeds", "0-2,1", "--out", str(tmp_path / "s")],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr == "mopd sweep: error: --seeds '0-2,1': seed 1 given more than once; give each seed once\n"
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(
    ("text", "seeds"),
    [
        ("0,1,2", [0, 1, 2]),
        ("0-17", list(range(18))),
        ("0-2,5,9-11", [0, 1, 2, 5, 9, 10, 11]),
        ("9-11, 0 - 2", [9, 10, 11, 0, 1, 2]),  # the order given is the order run; spaces are ignored
        ("7-7", [7]),
        ("3", [3]),
    ],
)
def test_seeds_take_ranges_and_lists_mixed_and_their_text_parses_back(text, seeds):
    assert parse_seeds(text) == seeds
    assert parse_seeds(format_seeds(seeds)) == seeds


def test_format_seeds_writes_rising_runs_of_three_or_more_as_ranges():
    assert format_seeds(list(range(18))) == "0-17"
    assert format_seeds([0, 1, 2, 5, 9, 10, 11]) == "0-2,5,9-11"
    assert format_seeds([0, 1, 5, 4, 3]) == "0,1,5,4,3"  # only rising runs of three or more become ranges


def test_the_summary_command_parses_back_to_the_sweep_seeds(tmp_path, monkeypatch):
    import mopd.sweep

    commands = []
    monkeypatch.setattr(mopd.sweep, "run_seed", lambda *args, **kwargs: True)  # every seed "finished"
    monkeypatch.setattr(mopd.sweep, "summarise", lambda finished: finished)
    monkeypatch.setattr(mopd.sweep, "write_summary", lambda summary, out, command: commands.append(command))
    seeds = parse_seeds("0-2,5,9-11")
    mopd.sweep.run_sweep("recipes/tiny.yaml", seeds, tmp_path, ["distill.steps=3"])
    argv = shlex.split(commands[-1])
    assert argv[:3] == ["mopd", "sweep", "recipes/tiny.yaml"] and argv[-1] == "distill.steps=3"
    assert argv[argv.index("--seeds") + 1] == "0-2,5,9-11" and len(commands) == len(seeds)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "--seeds '': give at least one seed; expected comma-separated seeds and ranges, e.g. 0,1,2 or 0-17 or 0-2,5,9-11"),
        ("  ", "--seeds '  ': give at least one seed; expected"),
        ("5-2", "--seeds '5-2': the range 5-2 runs backwards; write 2-5"),
        ("0-2,1-3", "--seeds '0-2,1-3': seeds 1, 2 given more than once; give each seed once"),
        ("-1", "--seeds '-1': a negative seed; expected comma-separated seeds and ranges"),
        ("-3-2", "--seeds '-3-2': a negative seed; expected"),
        ("0,,1", "--seeds '0,,1': an empty item; expected"),
        ("0,1,", "--seeds '0,1,': an empty item; expected"),
        ("0..3", "--seeds '0..3': '0..3' is not a seed or a range; expected comma-separated seeds and ranges"),
        ("1 2", "--seeds '1 2': '1 2' is not a seed or a range; expected"),
        ("x", "--seeds 'x': 'x' is not a seed or a range; expected"),
    ],
)
def test_bad_seeds_name_the_flag_and_what_is_expected(text, expected):
    with pytest.raises(RecipeError) as err:
        parse_seeds(text)
    assert str(err.value).startswith(expected) and "\n" not in str(err.value)


def test_a_repeated_content_is_one_cluster_so_its_copies_do_not_narrow_the_interval(tmp_path):
    """Issue #42: the tiny code cells asked ~31 functions 128 times. Copies of one content are one
    cluster: the interval of 10 contents asked 4 times each equals that of the 10 asked once."""
    rng = random.Random(3)
    distinct = [[float(rng.random() < 0.5) for _ in range(10)] for _ in range(3)]  # seeds × contents
    copies = [row * 4 for row in distinct]
    keys = [f"code:{i}" for i in range(10)] * 4
    assert clustered(copies, keys) == distinct
    assert two_way(clustered(copies, keys)).se == two_way(distinct).se
    assert two_way(copies).se < two_way(distinct).se  # what counting each copy as a task claimed

    accuracy = {"base": dict.fromkeys(CELLS, 0.3), "teacher": dict.fromkeys(CELLS, 0.6), "student": dict.fromkeys(CELLS, 0.6)}
    runs = write_runs(tmp_path, [0, 1, 2], accuracy, {"low": 1.0, "high": 2.0, "max": 3.0})
    for run in runs.values():  # every cell asks 8 contents, 5 times each; a content is the same at each effort
        report = json.loads((run / "bench" / "report.json").read_text())
        for row in report["results"]:
            row["task_keys"] = [f"{k:016x}" for k in range(8)] * 5
        (run / "bench" / "report.json").write_text(json.dumps(report))
    summary = summarise(runs)
    assert summary["cells"]["code-low"]["contents"] == {"tasks": TASKS, "distinct": 8}
    assert summary["pooled"]["contents"] == {"tasks": 9 * TASKS, "distinct": 3 * 8}  # per domain, over efforts
    assert summary["pooled"]["base"]["df"] < 3 * 8  # from 24 clusters, not 360 tasks
    markdown = write_summary(summary, tmp_path / "out", "mopd sweep")
    assert any("| code-low | 8 / 40 |" in line for line in (tmp_path / "out" / "summary.md").read_text().splitlines()), markdown
