"""`mopd sweep`'s summary by task family (`mopd.bench.seeds.families_summary`), on planted bench reports
whose rows are given families and contents."""

import dataclasses
import json
from pathlib import Path

import pytest

from mopd.bench.seeds import summarise, write_summary
from mopd.stats import accuracy, clustered
from tests.planted import CELLS, TASKS, write_runs

PLANTED = {"base": dict.fromkeys(CELLS, 0.3), "teacher": dict.fromkeys(CELLS, 0.6), "student": dict.fromkeys(CELLS, 0.7)}
TOKENS = {"low": 1.0, "high": 2.0, "max": 3.0}


def with_families(runs: dict[int, Path], chain_wrong: str) -> None:
    """Each cell's 40 tasks: the first 20 of family `add`, the rest `chain`, each content (c0 ... c19) twice;
    model `chain_wrong` answers every chain task wrong."""
    half = TASKS // 2
    for run in runs.values():
        report = json.loads((run / "bench" / "report.json").read_text())
        for row in report["results"]:
            row["task_families"] = ["add"] * half + ["chain"] * (TASKS - half)
            row["task_keys"] = [f"c{j // 2}" for j in range(TASKS)]
            if row["model"] == chain_wrong:
                row["task_rewards"] = row["task_rewards"][:half] + [0.0] * (TASKS - half)
        (run / "bench" / "report.json").write_text(json.dumps(report))


def test_accuracy_by_family_pools_seeds_efforts_and_contents_and_counts_the_answers(tmp_path):
    runs = write_runs(tmp_path, [0, 1, 2], PLANTED, TOKENS)
    with_families(runs, chain_wrong="student")
    summary = summarise(runs)
    add, chain = summary["families"]["general"]["add"], summary["families"]["general"]["chain"]
    assert (add["answers"], add["contents"]) == (3 * 3 * TASKS // 2, 10)  # seeds × efforts × tasks; c0 ... c9
    assert add["by_effort"]["low"]["answers"] == 3 * TASKS // 2 and set(add["by_effort"]) == {"low", "high", "max"}
    assert chain["student"]["mean"] == chain["student"]["high"] == 0.0
    for model, planted in (("base", 0.3), ("teacher", 0.6), ("student", 0.7)):
        assert add[model]["low"] < planted < add[model]["high"], model
    # by hand: each seed's add tasks at low, high, max side by side, a content's six answers one column
    rows = [[x for e in ("low", "high", "max") for x in json_rewards(run, "base", "general", e)[: TASKS // 2]]
            for run in runs.values()]  # fmt: skip
    keys = [f"c{j // 2}" for j in range(TASKS // 2)] * 3
    assert add["base"] == pytest.approx(dataclasses.asdict(accuracy(clustered(rows, keys))), nan_ok=True)
    write_summary(summary, tmp_path, "test")
    text = (tmp_path / "summary.md").read_text()
    assert "## Accuracy by task family" in text and f"| general | chain | {3 * 3 * TASKS // 2} | 10 | " in text


def json_rewards(run: Path, model: str, domain: str, effort: str) -> list[float]:
    report = json.loads((run / "bench" / "report.json").read_text())
    return next(r["task_rewards"] for r in report["results"] if (r["model"], r["domain"], r["effort"]) == (model, domain, effort))


def test_reports_without_task_families_still_summarise_and_say_so_once(tmp_path):
    summary = summarise(write_runs(tmp_path, [0, 1], PLANTED, TOKENS))
    assert summary["families"] == {} and summary["seeds_without_families"] == [0, 1]
    assert summary["cells"]["general-low"]["student"]["low"] < 0.7  # the rest of the summary as before
    write_summary(summary, tmp_path, "test")
    text = (tmp_path / "summary.md").read_text()
    assert text.count("carry no per-task families") == 1 and "seed(s) [0, 1]" in text
