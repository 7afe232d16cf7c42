"""`mopd run recipes/smoke.yaml`: every stage end to end, then a re-run that skips them all; the
training records the stages wrote, and the bench's audit that reads them."""

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mopd.base.sft import mix_domains, sft_tasks
from mopd.bench.audit import audit_jobs
from mopd.bench.suite import close, load_suite, make_env
from mopd.distill.routing import build_route_table
from mopd.distill.trainer import task_source
from mopd.envs import get_env
from mopd.envs.base import DOMAINS
from mopd.envs.splits import read_trained_on, task_keys, write_trained_on
from mopd.recipe import CELLS, load_recipe, load_teacher_specs
from mopd.rl.grpo import teacher_env, teacher_tasks

ROOT = Path(__file__).resolve().parent.parent
STAGES = ["base", "teachers", "distill", "baselines/mixed_rl", "curves", "bench"]


def run_smoke(out: Path, *overrides: str) -> subprocess.CompletedProcess:
    mopd = Path(sys.executable).parent / "mopd"
    return subprocess.run([mopd, "run", "recipes/smoke.yaml", "--out", str(out), *overrides],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_smoke_recipe_runs_every_stage_then_skips_them(tmp_path):
    run = tmp_path / "seed-0"
    first = run_smoke(run)
    assert first.returncode == 0, first.stderr[-3000:]
    manifest = json.loads((run / "manifest.json").read_text())
    assert {name: s["status"] for name, s in manifest["stages"].items()} == dict.fromkeys(STAGES, "done")
    for cell in ("general-low", "agent-high", "code-max"):
        assert (run / "teachers" / cell / "config.json").is_file()
        assert (run / "teachers" / cell / "metrics.jsonl").is_file()
    report = json.loads((run / "bench" / "report.json").read_text())
    assert report["results"] and (run / "bench" / "report.md").is_file()

    check_compute_accounting_and_the_mixed_rl_baseline(run, report)
    check_learning_curves(run)

    # `mopd sweep` over seed 0 resumes that run (every stage skipped) and summarises it
    mopd = Path(sys.executable).parent / "mopd"
    again = subprocess.run([mopd, "sweep", "recipes/smoke.yaml", "--seeds", "0", "--out", str(tmp_path)],
                           cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert all(f"{stage}: complete for these inputs" in again.stderr for stage in STAGES)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["seeds"] == [0] and summary["overlap"] == {"overlap": 0, "tasks": len(report["results"]),
                                                              "rows_without_audit": 0}
    row = next(r for r in report["results"] if (r["model"], r["domain"], r["effort"]) == ("base", "general", "low"))
    assert summary["cells"]["general-low"]["base"]["mean"] == row["accuracy"]
    assert (tmp_path / "summary.md").is_file() and (tmp_path / "summary.png").is_file()
    assert summary["curves"]["seeds"]["0"]["bar"] == json.loads((run / "curves" / "curves.json").read_text())["bar"]
    assert "## Compute to reach 90% of the teachers (dev suite" in (tmp_path / "summary.md").read_text()
    check_training_records_and_their_audit(run, report)


def check_compute_accounting_and_the_mixed_rl_baseline(run: Path, report: dict) -> None:
    """Every stage.json counts its compute; the baseline's FLOPs match teachers + MOPD within 10%;
    the bench scores it on every cell, on tasks it never trained on."""
    compute = {stage: json.loads((run / stage / "stage.json").read_text())["compute"] for stage in STAGES}
    assert all(c["wall_s"] > 0 and c["cpu_s"] > 0 and c["device"] == "cpu" for c in compute.values())
    assert compute["base"]["tokens_trained"] > 0 and compute["bench"]["tokens_sampled"] > 0
    teachers, distill, mixed = compute["teachers"], compute["distill"], compute["baselines/mixed_rl"]
    assert sorted(teachers["teachers"]) == sorted(CELLS)
    assert teachers["flops"] == sum(t["flops"] for t in teachers["teachers"].values()) > 0
    assert distill["tokens_scored"] == distill["tokens_trained"] > distill["tokens_sampled"] > 0
    assert mixed["target_flops"] == teachers["flops"] + distill["flops"]
    assert mixed["mismatch"] == mixed["flops"] / mixed["target_flops"] - 1
    assert abs(mixed["mismatch"]) <= 0.10, mixed

    rows = [row for row in report["results"] if row["model"] == "mixed_rl"]
    assert {f"{row['domain']}-{row['effort']}" for row in rows} == {
        f"{row['domain']}-{row['effort']}" for row in report["results"] if row["model"] == "base"
    }
    assert all(row["audit"]["overlap"] == 0 and set(row["audit"]["stages"]) == {"base", "baselines/mixed_rl"} for row in rows)
    models = {model["name"]: model for model in report["models"]}
    assert models["mixed_rl"]["role"] == "baseline"
    assert models["mixed_rl"]["compute"]["post_training"]["flops"] == mixed["flops"]
    assert models["student"]["compute"]["post_training"]["flops"] == mixed["target_flops"]
    assert "| mixed_rl |" in (run / "bench" / "report.md").read_text()


def check_learning_curves(run: Path) -> None:
    """The curves stage scored each snapshot of the student and the baseline on dev, every point at the
    FLOPs of the steps before it: the teachers' RL and MOPD's steps for the student, its own for the baseline."""
    curves = json.loads((run / "curves" / "curves.json").read_text())
    assert curves["split"] == "dev" and curves["overlap"]["overlap"] == 0 and curves["overlap"]["rows_without_audit"] == 0
    compute = {s: json.loads((run / s / "stage.json").read_text())["compute"] for s in ("teachers", "distill", "baselines/mixed_rl")}
    student, mixed = curves["series"]["student"]["points"], curves["series"]["mixed_rl"]["points"]
    assert [p["step"] for p in student] == [0, 1, 2]  # the base, the snapshot after step 1, the model
    assert student[0]["flops"] == compute["teachers"]["flops"]
    assert student[-1]["flops"] == pytest.approx(compute["teachers"]["flops"] + compute["distill"]["flops"])
    last, every = compute["baselines/mixed_rl"]["steps"], load_recipe(ROOT / "recipes/smoke.yaml").baselines.mixed_rl.curve_every
    assert [p["step"] for p in mixed] == sorted({0, *range(every, last + 1, every), last})
    assert mixed[0]["flops"] == 0 and mixed[-1]["flops"] == pytest.approx(compute["baselines/mixed_rl"]["flops"])
    assert all(a["flops"] < b["flops"] for series in (student, mixed) for a, b in itertools.pairwise(series))
    assert curves["bar"] == pytest.approx(0.9 * curves["teachers_pooled"])
    for step in range(every, last, every):
        assert (run / "baselines" / "mixed_rl" / "curve" / f"step-{step:06d}" / "model.safetensors").is_file()
    assert (run / "curves" / "curves.png").is_file() and "Learning curves" in (run / "curves" / "curves.md").read_text()


def check_training_records_and_their_audit(run: Path, report: dict) -> None:
    """Each stage recorded the content keys of what it trained on, and the bench audited against them."""
    recipe = load_recipe(ROOT / "recipes/smoke.yaml")
    sft = recipe.base.sft
    envs = {domain: get_env(domain, **recipe.env_options(domain)) for domain in mix_domains(sft.mix)}
    assert read_trained_on(run / "base") == set(task_keys(sft_tasks(envs, sft.examples, sft.mix, recipe.seed)))
    specs = load_teacher_specs(recipe)
    for cell in CELLS:
        env = teacher_env(specs[cell], recipe)
        assert read_trained_on(run / "teachers" / cell) == set(task_keys(teacher_tasks(env, specs[cell], recipe)))
        close(env)
    spec = recipe.distill
    source = task_source(build_route_table(spec.mix, {c: c for c in spec.mix}), spec, recipe.seed,
                         {d: recipe.env_options(d) for d in DOMAINS}, None)  # fmt: skip
    drawn = {key for step in range(1, spec.steps + 1) for key in task_keys(source(step))}
    assert read_trained_on(run / "distill") == drawn
    for env in envs.values():
        close(env)

    # the bench stage audited every cell against those records: nothing of its test suite was trained on
    assert report["label"] is None
    for row in report["results"]:
        cell = f"{row['domain']}-{row['effort']}"
        stages = {"base": 0, f"teachers/{cell}": 0, "distill": 0} if row["model"] == "student" else None
        assert row["audit"]["overlap"] == 0 and row["audit"]["tasks"] == 1, row
        assert stages is None or row["audit"]["stages"] == stages
    assert "overlap 0/1" in (run / "bench" / "report.md").read_text()

    # a key planted in the student's MOPD record is found there: the audit reads the run's files
    suite = load_suite(recipe.bench.suite)
    env = make_env(suite, "general", recipe.env_options("general"))
    tasks = suite.tasks(env, "low")
    write_trained_on(run / "distill", read_trained_on(run / "distill") | {task_keys(tasks)[0]})
    audit = audit_jobs([("student", run / "distill" / "model", "general-low", tasks)])[("student", "general-low")]
    assert (audit["overlap"], audit["stages"]["distill"]) == (1, 1)
    close(env)
