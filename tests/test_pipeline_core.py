"""Stage skipping by hash, crash safety of atomic writes, and resumable metrics logs."""

import json
from pathlib import Path

import pytest

from mopd.artifacts import MetricsLog, atomic_dir, config_hash, current_umask, write_text_atomic
from mopd.pipeline import Pipeline, Stage, build_stages
from mopd.recipe import Recipe, load_recipe

ROOT = Path(__file__).resolve().parent.parent


def counting_stage(name, calls, config=None, needs=(), fail=False):
    def run(ctx):
        calls.append(name)
        (ctx.dir / "out.txt").write_text(f"{name} from {sorted(ctx.inputs)}")
        if fail:
            raise RuntimeError("boom")

    return Stage(name, config or {}, run, needs)


def test_complete_stages_are_skipped_and_changes_rerun_downstream(tmp_path):
    recipe = Recipe(name="t")
    calls = []
    stages = lambda lr: [counting_stage("a", calls, {"lr": lr}), counting_stage("b", calls, needs=("a",))]  # noqa: E731
    assert Pipeline(recipe, tmp_path, stages(1)).run() == {"a": "done", "b": "done"}
    assert Pipeline(recipe, tmp_path, stages(1)).run() == {"a": "skipped", "b": "skipped"}
    assert Pipeline(recipe, tmp_path, stages(2)).run() == {"a": "done", "b": "done"}
    assert calls == ["a", "b", "a", "b"]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert set(manifest["stages"]) == {"a", "b"} and manifest["stages"]["b"]["status"] == "done"


def test_max_model_len_reaches_the_hash_of_every_stage_that_samples():
    """An engine's `max_model_len` decides where an agent episode ends truncated, so a stage that samples reruns when
    it changes; base does not sample; at its default it stays out, so earlier runs keep their finished stages."""

    def configs(*overrides):
        return {s.name: s.config for s in build_stages(load_recipe(ROOT / "recipes/tiny.yaml", overrides), ROOT)}

    default, explicit, longer = configs(), configs("max_model_len=2048"), configs("max_model_len=4096")
    assert explicit == default
    assert [n for n in default if config_hash(default[n]) != config_hash(longer[n])] == ["teachers", "distill", "bench"]


def test_a_failed_stage_is_not_marked_complete(tmp_path):
    calls = []
    with pytest.raises(RuntimeError):
        Pipeline(Recipe(name="t"), tmp_path, [counting_stage("a", calls, fail=True)]).run()
    assert not (tmp_path / "a" / "stage.json").exists()
    assert Pipeline(Recipe(name="t"), tmp_path, [counting_stage("a", calls)]).run() == {"a": "done"}


def resuming_stage(config, seen, crash=False):
    """Counts steps in a checkpoint file of its directory, resuming from what is there."""

    def run(ctx):
        checkpoint = ctx.dir / "checkpoint.txt"
        seen.append(checkpoint.read_text() if checkpoint.exists() else "")
        checkpoint.write_text(seen[-1] + "step ")
        if crash:
            raise RuntimeError("killed")

    return Stage("distill", config, run)


def test_a_crashed_stage_resumes_but_a_changed_config_starts_afresh(tmp_path):
    recipe, seen = Recipe(name="t"), []
    with pytest.raises(RuntimeError):
        Pipeline(recipe, tmp_path, [resuming_stage({"lr": 1}, seen, crash=True)]).run()
    Pipeline(recipe, tmp_path, [resuming_stage({"lr": 1}, seen)]).run()
    Pipeline(recipe, tmp_path, [resuming_stage({"lr": 2}, seen)]).run()
    assert seen == ["", "step ", ""]  # resumed after the crash; lr=2 did not resume lr=1's checkpoint
    assert (tmp_path / "distill.previous" / "checkpoint.txt").read_text() == "step step "
    with pytest.raises(RuntimeError):
        Pipeline(recipe, tmp_path, [resuming_stage({"lr": 3}, seen, crash=True)]).run()
    Pipeline(recipe, tmp_path, [resuming_stage({"lr": 4}, seen)]).run()
    assert seen[-2:] == ["", ""]  # a crashed lr=3 is not resumed by lr=4 either


def test_atomic_dir_keeps_the_old_artifact_when_writing_fails(tmp_path):
    target = tmp_path / "ckpt"
    with atomic_dir(target) as d:
        (d / "w.bin").write_text("v1")
    with pytest.raises(OSError), atomic_dir(target) as d:
        (d / "w.bin").write_text("half")
        raise OSError("disk full")
    assert (target / "w.bin").read_text() == "v1"
    assert target.stat().st_mode & 0o777 == 0o777 & ~current_umask()
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temp dirs left behind


def test_write_text_atomic_replaces_whole_files(tmp_path):
    path = tmp_path / "x.json"
    write_text_atomic(path, "one")
    write_text_atomic(path, "two")
    assert path.read_text() == "two" and len(list(tmp_path.iterdir())) == 1
    assert path.stat().st_mode & 0o777 == 0o666 & ~current_umask()


def test_metrics_log_resume_drops_steps_after_the_checkpoint(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    for step in range(1, 6):
        log.log(step, reward=step / 10)
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "rew')  # torn by a kill
    log.resume_after(3)
    for step in range(4, 7):
        log.log(step, reward=step / 10)
    assert [r["step"] for r in log.records()] == [1, 2, 3, 4, 5, 6]


def test_config_hash_ignores_key_order():
    assert config_hash({"a": 1, "b": [1, 2]}) == config_hash({"b": [1, 2], "a": 1})
    assert config_hash({"a": 1}) != config_hash({"a": 2})


def test_stage_json_holds_the_compute_a_stage_reports_with_its_seconds(tmp_path):
    from mopd.compute import estimate_flops, steps_compute

    records = [{"step": 1, "tokens_sampled": 10, "tokens_trained": 30, "cpu_s": 1.5, "time/step": 2.0},
               {"step": 2, "tokens_sampled": 20, "tokens_trained": 50, "tokens_scored": 50, "cpu_s": 0.5}]  # fmt: skip
    compute = steps_compute(records, active_params=100, teacher_active_params=200, wall_keys=("time/step",))
    assert (compute["tokens_sampled"], compute["tokens_trained"], compute["tokens_scored"]) == (30, 80, 50)
    assert compute["flops"] == estimate_flops(30, 80, 50, 100, 200) == 6 * 100 * 80 + 2 * 100 * 30 + 2 * 200 * 50
    assert (compute["cpu_s"], compute["wall_s"]) == (2.0, 2.0)

    stage = Stage("train", {}, lambda ctx: compute)
    Pipeline(Recipe(name="t", device="cpu"), tmp_path, [stage]).run()
    written = json.loads((tmp_path / "train" / "stage.json").read_text())["compute"]
    assert written == {**compute, "wall_s": written["wall_s"], "device": "cpu"}  # its steps' CPU, the stage's seconds
    assert written["wall_s"] == json.loads((tmp_path / "train" / "stage.json").read_text())["seconds"]
