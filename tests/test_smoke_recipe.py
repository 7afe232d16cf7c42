"""`mopd run recipes/smoke.yaml`: every stage end to end, SIGKILLed twice on the way (the whole process
group: driver, Ray's gcs, raylet and workers), once while the teachers train and once while MOPD distils.

Each re-run of the same command skips the finished stages and resumes the killed one from its last
checkpoint; the final artifacts hold every step exactly once. Then the checks of a finished run: the
compute accounting, the mixed-RL baseline, the learning curves, the training records and the bench's
audit that reads them; and `mopd sweep` over that seed, which skips every stage and summarises it.
"""

import itertools
import json
import subprocess
import sys
import time
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
from tests.processes import alive, kill_run, run_processes, run_until

ROOT = Path(__file__).resolve().parent.parent
STAGES = ["base", "teachers", "distill", "baselines/mixed_rl", "curves", "bench"]
# nine teachers (two GRPO steps each, a checkpoint after each), four actors at a time: the first kill finds
# some finished, some half-trained and (usually) some not yet started; MOPD checkpoints after each of its 2 steps
OVERRIDES = ["distill.checkpoint_every=1"]
DISTILL_STEPS = load_recipe(ROOT / "recipes/smoke.yaml").distill.steps
STAGE_TIMEOUT = 900  # seconds for one run to reach its kill point (or to finish)


def start_run(out: Path, log: Path) -> subprocess.Popen:
    mopd = Path(sys.executable).parent / "mopd"
    with log.open("w") as f:
        return subprocess.Popen(
            # the overrides before --out: argparse takes no more positionals after an option
            [mopd, "run", "recipes/smoke.yaml", *OVERRIDES, "--out", str(out)],
            cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


# ----------------------------------------------------------------------------- artifacts
def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.is_file() else []


def steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in lines(path)]


def teacher_checkpoint(folder: Path) -> int:
    """Step of a teacher's newest complete TRL checkpoint (0: none), as `mopd.rl.grpo.last_checkpoint` sees it."""
    done = [p for p in folder.glob("checkpoints/checkpoint-*") if (p / "trainer_state.json").is_file()]
    return max((int(p.name.removeprefix("checkpoint-")) for p in done), default=0)


def distill_checkpoint(folder: Path) -> int:
    done = [p for p in folder.glob("checkpoints/step-*") if (p / "trainer_state.json").is_file()]
    return max((int(p.name.removeprefix("step-")) for p in done), default=0)


def teacher_state(run: Path) -> dict[str, dict]:
    out = {}
    for cell in CELLS:
        folder = run / "teachers" / cell
        out[cell] = {
            "finished": (folder / "teacher.json").is_file(),
            "checkpoint": teacher_checkpoint(folder),
            "attempts": len(lines(folder / "attempts.jsonl")),
        }
    return out


# ----------------------------------------------------------------------------- the test
@pytest.mark.slow
@pytest.mark.timeout(2700)  # three runs, each given STAGE_TIMEOUT
def test_the_smoke_recipe_killed_twice_resumes_to_every_stage_then_skips_them(tmp_path):
    run = tmp_path / "seed-0"
    started = time.monotonic()
    at_kill, killed, gone_in = kill_while_teachers_train(run, tmp_path / "run1.log")
    resumed_at, kept = kill_while_distilling(run, tmp_path / "run2.log")
    finish(run, tmp_path / "run3.log")
    elapsed = time.monotonic() - started

    manifest = json.loads((run / "manifest.json").read_text())
    assert {name: s["status"] for name, s in manifest["stages"].items()} == {
        "base": "skipped", "teachers": "skipped", **dict.fromkeys(STAGES[2:], "done")}  # fmt: skip
    for name, stage in manifest["stages"].items():
        assert json.loads((run / name / "stage.json").read_text())["hash"] == stage["hash"]
    check_every_teacher_step_once(run, at_kill)
    check_every_distill_step_once(run, resumed_at, kept)
    report = json.loads((run / "bench" / "report.json").read_text())
    assert report["results"] and (run / "bench" / "report.md").is_file()

    check_compute_accounting_and_the_mixed_rl_baseline(run, report)
    check_learning_curves(run)
    check_a_sweep_skips_every_stage_and_summarises(tmp_path, report)
    check_training_records_and_their_audit(run, report)
    print(
        f"three runs, two kills: {elapsed:.0f} s; {killed} processes gone {gone_in:.1f} s after the first kill;"
        f" distill resumed at step {resumed_at}; teachers at the first kill: {at_kill}"
    )


def kill_while_teachers_train(run: Path, log: Path) -> tuple[dict, int, float]:
    """Killed once a teacher is finished and another has metrics and a checkpoint but is not finished."""

    def teachers_finished_and_mid_training() -> bool:
        if (run / "teachers" / "stage.json").exists():
            return False
        state = teacher_state(run)
        return any(s["finished"] for s in state.values()) and any(
            s["checkpoint"] and not s["finished"] and lines(run / "teachers" / c / "metrics.jsonl")
            for c, s in state.items()
        )

    first = start_run(run, log)
    run_until(first, teachers_finished_and_mid_training, log, "a finished and a checkpointed, unfinished teacher",
              STAGE_TIMEOUT)  # fmt: skip
    killed, gone_in = kill_run(first)
    assert killed > 3  # the driver and Ray's processes (gcs, raylet, workers) were all there
    assert (run / "base" / "stage.json").is_file() and not (run / "teachers" / "stage.json").exists()
    at_kill = teacher_state(run)
    assert any(s["checkpoint"] and not s["finished"] for s in at_kill.values()), at_kill
    assert any(s["finished"] for s in at_kill.values()), at_kill
    return at_kill, killed, gone_in


def kill_while_distilling(run: Path, log: Path) -> tuple[int, list[str]]:
    """The same command: base skipped, teachers resumed; killed again once MOPD has a checkpoint."""
    distill = run / "distill"

    def distill_checkpointed() -> bool:
        return (
            not (distill / "stage.json").exists()
            and bool(lines(distill / "metrics.jsonl"))  # not parsed: the trainer may be writing a line
            and distill_checkpoint(distill) > 0
        )

    second = start_run(run, log)
    run_until(second, distill_checkpointed, log, "a distill checkpoint", STAGE_TIMEOUT)
    kill_run(second)
    assert "base: complete for these inputs" in log.read_text()
    assert (run / "teachers" / "stage.json").is_file() and not (distill / "stage.json").exists()
    resumed_at = distill_checkpoint(distill)
    kept = lines(distill / "metrics.jsonl")[:resumed_at]  # the steps the checkpoint already holds
    assert 1 <= resumed_at <= DISTILL_STEPS
    assert [json.loads(line)["step"] for line in kept] == list(range(1, resumed_at + 1))
    return resumed_at, kept


def finish(run: Path, log: Path) -> None:
    """The same command again, to the end: it leaves no process behind."""
    third = start_run(run, log)
    try:
        third.wait(timeout=STAGE_TIMEOUT)
    except subprocess.TimeoutExpired:
        kill_run(third)
        pytest.fail(f"the last run did not finish within {STAGE_TIMEOUT} s:\n{log.read_text()[-3000:]}")
    output = log.read_text()
    assert third.returncode == 0, output[-3000:]
    assert not alive(run_processes(third.pid)), "the finished run left processes behind"
    assert "base: complete for these inputs" in output and "teachers: complete for these inputs" in output


def check_every_teacher_step_once(run: Path, at_kill: dict) -> None:
    """Every step exactly once: finished teachers were skipped, half-trained ones resumed."""
    assert sorted(p.name for p in (run / "teachers").iterdir() if p.is_dir()) == sorted(CELLS)
    for cell in CELLS:
        folder = run / "teachers" / cell
        teacher = json.loads((folder / "teacher.json").read_text())
        assert (folder / "config.json").is_file() and (folder / "metrics.jsonl").is_file() and teacher["spec"] == cell
        assert steps(folder / "metrics.jsonl") == list(range(1, teacher["steps"] + 1)), cell
        attempts = [json.loads(line) for line in lines(folder / "attempts.jsonl")]
        before = at_kill[cell]
        if before["finished"]:
            assert len(attempts) == before["attempts"], f"{cell} was finished, yet trained again"
        else:
            assert len(attempts) == before["attempts"] + 1, (cell, attempts)
            assert attempts[-1]["resumed_from"] == before["checkpoint"], (cell, attempts, before)
        assert not (folder / "checkpoints").exists()
    resumable = [c for c, s in at_kill.items() if s["checkpoint"] and not s["finished"]]
    assert any(json.loads(lines(run / "teachers" / c / "attempts.jsonl")[-1])["resumed_from"] > 0 for c in resumable)


def check_every_distill_step_once(run: Path, resumed_at: int, kept: list[str]) -> None:
    """Steps 1..N exactly once, and the steps before the checkpoint were not redone."""
    distill = run / "distill"
    final = lines(distill / "metrics.jsonl")
    assert [json.loads(line)["step"] for line in final] == list(range(1, DISTILL_STEPS + 1))
    assert final[:resumed_at] == kept  # byte for byte: their timings would differ had they run again
    assert distill_checkpoint(distill) == DISTILL_STEPS and (distill / "model" / "config.json").is_file()


def check_a_sweep_skips_every_stage_and_summarises(out: Path, report: dict) -> None:
    """`mopd sweep` over seed 0 resumes that run (every stage skipped) and summarises it."""
    mopd = Path(sys.executable).parent / "mopd"
    again = subprocess.run([mopd, "sweep", "recipes/smoke.yaml", *OVERRIDES, "--seeds", "0", "--out", str(out)],
                           cwd=ROOT, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert all(f"{stage}: complete for these inputs" in again.stderr for stage in STAGES)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["seeds"] == [0] and summary["overlap"] == {"overlap": 0, "tasks": len(report["results"]),
                                                              "rows_without_audit": 0}  # fmt: skip
    row = next(r for r in report["results"] if (r["model"], r["domain"], r["effort"]) == ("base", "general", "low"))
    assert summary["cells"]["general-low"]["base"]["mean"] == row["accuracy"]
    assert (out / "summary.md").is_file() and (out / "summary.png").is_file()
    run = out / "seed-0"
    assert summary["curves"]["seeds"]["0"]["bar"] == json.loads((run / "curves" / "curves.json").read_text())["bar"]
    assert "## Compute to reach 90% of the teachers (dev suite" in (out / "summary.md").read_text()


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
