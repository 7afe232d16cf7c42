"""`mopd bench`: suites (determinism, held-out seeds, clear errors), checkpoints checked before any
sampling, same scores at temperature 0, a run's base/teachers/student, and the report on disk.

The models are a random tiny K3 hybrid (4 layers) with the tiny tokenizer, sampled by the HF
backend under tiny budgets, so a whole benchmark takes seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
from pathlib import Path

import pytest
import torch
import yaml

from mopd.bench import plots
from mopd.bench.report import TABLES, difference_se, markdown
from mopd.bench.run import (
    EngineCache,
    ModelRef,
    bench_command,
    bench_run_dir,
    run_bench,
    run_bench_stage,
    run_models,
    task_standard_error,
)
from mopd.bench.suite import BenchError, SuiteError, check_held_out, load_suite, make_env, select
from mopd.envs import get_env
from mopd.envs.tokenizer import build_tiny_tokenizer
from mopd.model import K3HybridForCausalLM, preset_config
from mopd.pipeline import StageContext
from mopd.recipe import ROOT, Recipe, load_recipe
from mopd.rollout import engine as engine_module

TINY_BUDGETS = {
    "low": {"budget_tokens": 4, "answer_tokens": 4},
    "high": {"budget_tokens": 8, "answer_tokens": 4},
    "max": {"budget_tokens": 12, "answer_tokens": 4},
}
SUITE = {
    "name": "unit",
    "seeds": [1001],
    "n": 2,
    "temperature": 0.0,
    "efforts": ["low", "high"],
    "domains": {"general": {"families": ["add"], "options": {"add_digits": [1, 2]}}},
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    set_num_threads(1)  # many engineers share the CPUs: one thread is far faster here
    yield
    torch.set_num_threads = set_num_threads  # vLLM's in-process CPU worker replaced it with a no-op
    set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer(tasks_per_cell=10)


def write_checkpoint(path: Path, tokenizer, seed: int, layers: int = 4) -> Path:
    torch.manual_seed(seed)
    model = K3HybridForCausalLM(preset_config("tiny", vocab_size=len(tokenizer), num_hidden_layers=layers))
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids(["<|end|>", "<|eos|>"])
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("ckpt")
    return write_checkpoint(root / "a", tokenizer, 0), write_checkpoint(root / "b", tokenizer, 1)


@pytest.fixture
def suite_file(tmp_path):
    return write_suite(tmp_path / "unit.yaml", SUITE)


def write_suite(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def tiny_recipe() -> Recipe:
    return Recipe(name="unit", efforts=TINY_BUDGETS)


@pytest.fixture
def no_sampling(monkeypatch):
    """Any attempt to sample fails the test: errors must come before the first rollout."""

    def sampled(*args, **kwargs):
        raise AssertionError("sampling started before the input was checked")

    monkeypatch.setattr("mopd.bench.run.run_rollouts", sampled)


# ----------------------------------------------------------------------------- suites
@pytest.mark.parametrize("recipe", ["recipes/tiny.yaml", "recipes/smoke.yaml"])
def test_recipe_suites_load_and_hold_out_the_training_seed(recipe):
    loaded = load_recipe(ROOT / recipe)
    suite = load_suite(loaded.bench.suite)
    check_held_out(suite, {loaded.seed})
    assert suite.domains and suite.efforts and suite.n > 0


def test_same_suite_and_seed_give_the_same_tasks_at_every_effort():
    suite = load_suite("eval/tiny.yaml")
    for domain in suite.domains:
        first, second = make_env(suite, domain), make_env(suite, domain)
        tasks = {effort: suite.tasks(first, effort) for effort in suite.efforts}
        again = {effort: suite.tasks(second, effort) for effort in suite.efforts}
        assert tasks == again
        prompts = {effort: [t.prompt for t in cell] for effort, cell in tasks.items()}
        assert all(p == prompts["low"] for p in prompts.values()), "every effort answers the same questions"
        other_seed = suite.model_copy(update={"seeds": [s + 1 for s in suite.seeds]})
        assert [t.prompt for t in other_seed.tasks(first, "low")] != prompts["low"]


def test_a_suite_seed_that_is_a_training_seed_is_refused(tmp_path):
    path = write_suite(tmp_path / "leaky.yaml", {**SUITE, "seeds": [5, 0]})
    with pytest.raises(SuiteError, match=r"leaky.yaml: seeds \[0\] are also training seeds"):
        check_held_out(load_suite(path), {Recipe(name="r").seed}, source=str(path))


@pytest.mark.parametrize("suite_path", ["eval/tiny.yaml", "eval/smoke.yaml"])
def test_suite_tasks_share_no_content_with_the_training_tasks(suite_path):
    """The suite's eval tasks and the tasks training draws with the recipe's seed are disjoint."""
    suite = load_suite(suite_path)
    seed = Recipe(name="r").seed
    for domain in suite.domains:
        env = make_env(suite, domain)
        train_env = get_env(domain)  # training draws from the domain's default families
        held_out = {content(t) for t in suite.tasks(env, "high")}  # content does not depend on the effort
        trained = {content(t) for t in train_env.sample(300, seed, "train", "high")}
        assert held_out and not held_out & trained


def content(task) -> str:
    meta = {k: v for k, v in task.meta.items() if k not in ("id", "content_hash")}
    return task.prompt + json.dumps(meta, sort_keys=True, default=str)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"domains": {"chess": {}}}, r"bad.yaml: field `domains`: .*unknown domains \['chess'\]"),
        ({"domains": {"general": {"families": ["add", "sudoku"]}}}, r"bad.yaml: domains.general: .*sudoku"),
        (
            {"domains": {"code": {"families": ["no_such_family"]}}},
            r"bad.yaml: domains.code: .*no_such_family",
        ),
        ({"efforts": ["medium"]}, r"bad.yaml: field `efforts`: .*medium"),
        ({"seeds": [3, 3]}, r"bad.yaml: field `seeds`: .*repeat"),
        ({"n": 0}, r"bad.yaml: field `n`"),
        ({"typo": 1}, r"bad.yaml: unknown field `typo`"),
    ],
)
def test_bad_suites_are_named_errors(tmp_path, change, message):
    path = write_suite(tmp_path / "bad.yaml", {**SUITE, **change})
    with pytest.raises(SuiteError, match=message):
        load_suite(path)


def test_suite_files_that_are_not_suites(tmp_path):
    with pytest.raises(SuiteError, match="no such file"):
        load_suite(tmp_path / "missing.yaml")
    (tmp_path / "broken.yaml").write_text("name: [unclosed\n")
    with pytest.raises(SuiteError, match=r"broken\.yaml: not valid YAML"):
        load_suite(tmp_path / "broken.yaml")


def test_command_line_selection_checks_domains_and_efforts():
    suite = load_suite("eval/smoke.yaml")
    narrowed = select(suite, ["general"], ["max"], n=3, samples=2)
    assert list(narrowed.domains) == ["general"] and narrowed.efforts == ["max"]
    assert (narrowed.n, narrowed.samples) == (3, 2)
    with pytest.raises(SuiteError, match="unknown domain 'chess'"):
        select(suite, ["chess"])
    with pytest.raises(SuiteError, match="unknown effort 'medium'"):
        select(suite, efforts=["medium"])
    with pytest.raises(SuiteError, match="--n: must be positive"):
        select(suite, n=0)


# ----------------------------------------------------------------------------- checkpoints
def test_missing_and_corrupt_checkpoints_fail_before_sampling(tmp_path, checkpoints, suite_file, no_sampling):
    good = checkpoints[0]
    cases = {}
    cases["missing"] = tmp_path / "nowhere"
    cases["no config"] = copy_without(good, tmp_path / "no_config", "config.json")
    cases["no weights"] = copy_without(good, tmp_path / "no_weights", "model.safetensors")
    cases["no tokenizer"] = copy_without(good, tmp_path / "no_tok", "tokenizer.json", "tokenizer_config.json")
    cases["bad json"] = copy_without(good, tmp_path / "bad_json")
    (cases["bad json"] / "config.json").write_text("{ not json")
    cases["garbage weights"] = copy_without(good, tmp_path / "garbage")
    (cases["garbage weights"] / "model.safetensors").write_bytes(
        b"\x10\x00\x00\x00\x00\x00\x00\x00not a header"
    )
    cases["truncated weights"] = copy_without(good, tmp_path / "truncated")
    weights = cases["truncated weights"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    cases["cut tail"] = copy_without(good, tmp_path / "cut_tail")
    weights = cases["cut tail"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    expected = {
        "missing": "no such checkpoint directory",
        "no config": "no config.json",
        "no weights": "no weights",
        "no tokenizer": "tokenizer",
        "bad json": "not valid JSON",
        "garbage weights": "corrupt checkpoint",
        "truncated weights": "corrupt checkpoint",
        "cut tail": "corrupt checkpoint.*not fully covered",
    }
    for case, path in cases.items():
        with pytest.raises(BenchError, match=expected[case]) as err:
            run_bench([good, f"broken={path}"], suite=suite_file, backend="hf", recipe=tiny_recipe())
        assert "'broken'" in str(err.value) and str(path) in str(err.value), case


def copy_without(source: Path, target: Path, *names: str) -> Path:
    shutil.copytree(source, target)
    for name in names:
        (target / name).unlink()
    return target


def test_bad_suite_or_flags_fail_before_sampling(tmp_path, checkpoints, no_sampling):
    bad = write_suite(tmp_path / "bad.yaml", {**SUITE, "domains": {"general": {"families": ["nope"]}}})
    with pytest.raises(SuiteError, match=r"domains\.general"):
        run_bench([checkpoints[0]], suite=bad, backend="hf", recipe=tiny_recipe())
    good = write_suite(tmp_path / "good.yaml", SUITE)
    with pytest.raises(SuiteError, match="unknown domain 'chess'"):
        run_bench([checkpoints[0]], domains=["chess"], suite=good, backend="hf", recipe=tiny_recipe())
    with pytest.raises(SuiteError, match="training seeds"):
        run_bench([checkpoints[0]], suite=good, backend="hf", recipe=Recipe(name="r", seed=1001))
    with pytest.raises(BenchError, match="two models are named"):
        run_bench(
            [f"x={checkpoints[0]}", f"x={checkpoints[1]}"], suite=good, backend="hf", recipe=tiny_recipe()
        )


# ----------------------------------------------------------------------------- benchmarking
def write_terse_checkpoint(path: Path, tokenizer) -> Path:
    """A checkpoint that closes its thinking or ends its turn at once, whatever the vocabulary: its
    last hidden state is one signed number, and only `</think>` (+) and `<|end|>` (-) read it."""
    write_checkpoint(path, tokenizer, seed=1)
    model = K3HybridForCausalLM.from_pretrained(path)
    with torch.no_grad():
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight.zero_()
        close, end = tokenizer.convert_tokens_to_ids(["</think>", "<|end|>"])
        model.lm_head.weight[close, 0], model.lm_head.weight[end, 0] = 100.0, -100.0
    model.save_pretrained(path)
    return path


def test_temperature_zero_gives_the_same_scores(tmp_path, checkpoints, tokenizer, suite_file):
    """One checkpoint always samples the same tokens; another checkpoint samples different ones."""
    terse = write_terse_checkpoint(tmp_path / "terse", tokenizer)
    models = [f"first={checkpoints[0]}", f"again={checkpoints[0]}", f"other={terse}"]
    report = run_bench(models, suite=suite_file, backend="hf", recipe=tiny_recipe(), progress=False)
    outcome = {name: scores(report, name) for name in ("first", "again", "other")}
    assert outcome["first"] == outcome["again"]
    assert outcome["first"] != outcome["other"]
    # "again" and "other" were swapped into the first engine (update_weights); a fresh engine agrees
    fresh = run_bench(
        [f"other={terse}"], suite=suite_file, backend="hf", recipe=tiny_recipe(), progress=False
    )
    assert scores(fresh, "other") == outcome["other"]
    rows = [r for r in report["results"] if r["model"] == "first"]
    assert [(r["domain"], r["effort"], r["tasks"]) for r in rows] == [
        ("general", "low", 2),
        ("general", "high", 2),
    ]
    for row in rows:
        assert 0 <= row["accuracy"] <= row["pass_at_k"] <= 1
        assert row["thinking_tokens_mean"] <= row["thinking_tokens_p90"] or row["thinking_tokens_mean"] == 0
        assert row["tokens_per_s"] > 0 and row["latency_s_mean"] > 0


def test_vllm_default_backend_scores_like_hf(checkpoints, suite_file):
    """The default engine (vLLM, one start, the second model swapped in) matches HF's greedy samples."""
    models = [f"a={checkpoints[0]}", f"b={checkpoints[1]}"]
    by_vllm = run_bench(models, suite=suite_file, recipe=tiny_recipe(), progress=False)
    by_hf = run_bench(models, suite=suite_file, backend="hf", recipe=tiny_recipe(), progress=False)
    assert by_vllm["backend"] == "vllm"
    for name in ("a", "b"):
        assert scores(by_vllm, name) == scores(by_hf, name)


def test_two_workers_sample_what_one_engine_does(checkpoints, tmp_path, capsys):
    """Two one-thread engines on Ray actors (the tiny recipe's bench) draw the very tokens one engine
    draws at temperature 1: sampling is seeded per request. The report keeps the models' order."""
    suite = write_suite(tmp_path / "two.yaml", {**SUITE, "n": 3, "temperature": 1.0, "efforts": ["low", "high", "max"]})
    models = [f"a={checkpoints[0]}", f"b={checkpoints[1]}"]
    alone = run_bench(models, suite=suite, recipe=tiny_recipe(), progress=False)
    shared = run_bench(models, suite=suite, recipe=tiny_recipe(), progress=False, workers=2)
    assert (alone["workers"], shared["workers"]) == (1, 2)
    assert "on 2 workers at once" in markdown(shared) and "workers at once" not in markdown(alone)
    assert [(r["model"], r["effort"]) for r in shared["results"]] == [(r["model"], r["effort"]) for r in alone["results"]]
    for one, two in zip(alone["results"], shared["results"]):
        assert (one["task_rewards"], one["generated_tokens_mean"]) == (two["task_rewards"], two["generated_tokens_mean"])
    assert sum(r["generated_tokens_mean"] for r in alone["results"]) > 0
    printed = capsys.readouterr().err
    assert all(f"{m} general-{e}: accuracy" in printed for m in "ab" for e in ("low", "high", "max"))


def test_workers_must_be_positive(checkpoints, suite_file, no_sampling):
    with pytest.raises(BenchError, match="--workers"):
        run_bench([checkpoints[0]], suite=suite_file, recipe=tiny_recipe(), workers=0)


def test_vllm_engine_restarts_for_another_architecture(checkpoints, tokenizer, suite_file, tmp_path):
    """A model the loaded engine cannot take by update_weights gets a new engine, the old one shut
    down first (a base → teacher → MOPD student run crashed on a late teardown of the old engine:
    "pipeline model parallel group is not initialized"; this smaller case did not reproduce it)."""
    deeper = write_checkpoint(tmp_path / "deeper", tokenizer, 2, layers=8)
    models = [f"a={checkpoints[0]}", f"b={checkpoints[1]}", f"deeper={deeper}"]
    report = run_bench(models, suite=suite_file, recipe=tiny_recipe(), progress=False)
    assert {r["model"] for r in report["results"]} == {"a", "b", "deeper"}
    assert all(r["tokens_per_s"] > 0 for r in report["results"])


def test_a_checkpoint_saved_with_use_cache_off_is_swapped_in_not_restarted(checkpoints, tokenizer, tmp_path, monkeypatch):
    """transformers' Trainer saves with `use_cache` off: a run's teachers differed from its base and
    student in that key alone, and each switch between them started a new engine (~40 s of the tiny
    run's bench)."""
    teacher = write_checkpoint(tmp_path / "teacher", tokenizer, 2)
    config = json.loads((teacher / "config.json").read_text())
    (teacher / "config.json").write_text(json.dumps({**config, "use_cache": False}))
    starts, create_engine = [], engine_module.create_engine
    monkeypatch.setattr(engine_module, "create_engine", lambda path, **kw: starts.append(path) or create_engine(path, **kw))
    cache = EngineCache("hf")
    for path in (checkpoints[0], teacher, checkpoints[1], teacher):
        engine = cache.load(Path(path))
    assert starts == [checkpoints[0]]
    assert torch.equal(engine.model.lm_head.weight, K3HybridForCausalLM.from_pretrained(teacher).lm_head.weight)


def scores(report: dict, model: str) -> list[tuple]:
    keys = (
        "accuracy",
        "pass_at_k",
        "thinking_tokens_mean",
        "answer_tokens_mean",
        "generated_tokens_mean",
        "over_budget_rate",
        "closed_think_rate",
    )
    return [tuple(r[k] for k in keys) for r in report["results"] if r["model"] == model]


def test_mean_and_pass_at_k_over_samples(tmp_path, checkpoints, suite_file):
    report = run_bench(
        [checkpoints[1]],
        suite=suite_file,
        samples=3,
        efforts=["low"],
        backend="hf",
        recipe=tiny_recipe(),
        temperature=1.0,
        progress=False,
    )
    (row,) = report["results"]
    assert (row["tasks"], row["samples"]) == (2, 3)
    assert row["accuracy"] <= row["pass_at_k"]


@pytest.fixture(scope="module")
def command_out(tmp_path_factory, checkpoints):
    """`mopd bench base=A trained=B ...` run once for the report and plot tests."""
    out = tmp_path_factory.mktemp("bench_out")
    suite = write_suite(out / "unit.yaml", SUITE)
    args = argparse.Namespace(
        models=[f"base={checkpoints[0]}", f"trained={checkpoints[1]}"], run=None, suite=str(suite),
        efforts="low,high", domains="general", n=1, samples=None, out=str(out), backend="hf", workers=None,
    )  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("mopd.bench.run.recipe_of", lambda refs: tiny_recipe())
        assert bench_command(args) == 0
    return out


def test_the_command_writes_report_markdown_and_plots(command_out):
    report = json.loads((command_out / "report.json").read_text())
    assert [m["name"] for m in report["models"]] == ["base", "trained"]
    assert {(r["model"], r["effort"], r["tasks"]) for r in report["results"]} == {
        (model, effort, 1) for model in ("base", "trained") for effort in ("low", "high")
    }
    assert {"cpu_count", "torch", "platform"} <= set(report["machine"])
    text = (command_out / "report.md").read_text()
    assert "| cell | base | trained |" in text and "| general/low |" in text
    for png in ("accuracy_vs_effort.png", "accuracy_vs_tokens.png", "ratio_heatmap.png"):
        assert (command_out / png).read_bytes().startswith(b"\x89PNG"), png
        assert f"]({png})" in text


def test_plots_have_labelled_axes_and_legends(command_out):
    report = json.loads((command_out / "report.json").read_text())
    for plot in (plots.plot_accuracy_vs_effort, plots.plot_accuracy_vs_tokens):
        figure = plot(report)
        axes = figure.axes
        assert all(ax.get_xlabel() for ax in axes) and axes[0].get_ylabel()
        legend_labels = [t.get_text() for legend in figure.legends for t in legend.get_texts()]
        assert legend_labels == ["base", "trained"]
    heat = plots.plot_ratio_heatmap(report)
    assert heat.axes[0].get_xlabel() == "effort" and heat.axes[0].get_ylabel() == "domain"
    assert "trained / base" in heat.axes[0].get_title()


# ----------------------------------------------------------------------------- a recipe run
def fake_run(root: Path, checkpoint: Path, recipe: Recipe) -> Path:
    """A finished run directory laid out as the pipeline writes it (one checkpoint everywhere)."""
    for stage in ("base", "teachers/general-low", "teachers/code-max", "distill/model"):
        shutil.copytree(checkpoint, root / stage)
    (root / "recipe.json").write_text(json.dumps(recipe.model_dump(mode="json")))
    return root


def test_run_models_finds_base_teachers_and_student(tmp_path, checkpoints):
    run = fake_run(tmp_path / "run", checkpoints[0], tiny_recipe())
    (run / "teachers" / "agent-max").mkdir()  # an unfinished teacher: no checkpoint yet
    refs = run_models(run)
    assert [(r.name, r.role, r.cell) for r in refs] == [
        ("base", "base", None), ("general-low", "teacher", "general-low"),
        ("code-max", "teacher", "code-max"), ("student", "student", None),
    ]  # fmt: skip
    assert refs[-1] == ModelRef("student", run / "distill" / "model", "student")
    with pytest.raises(BenchError, match="no base, teacher or student checkpoint"):
        run_models(tmp_path)


def test_bench_run_dir_puts_student_against_each_cells_teacher(tmp_path, checkpoints, suite_file):
    run = fake_run(tmp_path / "run", checkpoints[0], tiny_recipe())
    report = bench_run_dir(run, suite=str(suite_file), efforts=["low"], backend="hf", progress=False)
    evaluated = {(r["model"], r["domain"], r["effort"]) for r in report["results"]}
    assert evaluated == {
        ("base", "general", "low"),
        ("general-low", "general", "low"),
        ("student", "general", "low"),
    }
    assert (run / "bench" / "ratio_heatmap.png").is_file()
    text = markdown(report)
    assert "| cell | base | teacher | student |" in text
    accuracy = {r["model"]: r["accuracy"] for r in report["results"]}
    ratio = accuracy["student"] / accuracy["general-low"] if accuracy["general-low"] > 0 else None
    section = text.split("## Student against its teachers (accuracy)")[1]
    row = next(line for line in section.splitlines() if line.startswith("| general/low |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[1:4] == [
        f"{accuracy['general-low']:.2f}",
        f"{accuracy['student']:.2f}",
        "—" if ratio is None else f"{ratio:.2f}",
    ]
    per_task = {r["model"]: r["task_rewards"] for r in report["results"]}
    assert all(len(rewards) == SUITE["n"] for rewards in per_task.values())
    gap, two_se = cells[5].split(" ± ")
    assert gap == f"{accuracy['student'] - accuracy['general-low']:+.2f}"
    differences = [s - t for s, t in zip(per_task["student"], per_task["general-low"])]
    assert two_se == f"{2 * statistics.stdev(differences) / math.sqrt(len(differences)):.2f}"
    with pytest.raises(BenchError, match=r"no recipe\.json"):
        bench_run_dir(tmp_path / "not_a_run")


def test_pipeline_stage_benchmarks_its_inputs_into_the_stage_dir(tmp_path, checkpoints):
    one_cell = write_suite(tmp_path / "one_cell.yaml", {**SUITE, "efforts": ["low"]})
    bench = {"suite": str(one_cell), "n": 1, "backend": "hf"}
    recipe = Recipe(name="unit", efforts=TINY_BUDGETS, bench=bench)
    stages = fake_run(
        tmp_path / "stages", checkpoints[0], recipe
    )  # the stage reads its inputs, wherever they are
    inputs = {name: stages / name for name in ("base", "teachers", "distill")}
    run_dir = tmp_path / "run"
    run_bench_stage(StageContext(recipe, run_dir, run_dir / "bench", inputs))
    report = json.loads((run_dir / "bench" / "report.json").read_text())
    assert [(m["name"], m["role"]) for m in report["models"]] == [
        ("base", "base"), ("general-low", "teacher"), ("code-max", "teacher"), ("student", "student"),
    ]  # fmt: skip
    evaluated = [(r["model"], r["domain"], r["effort"], r["tasks"]) for r in report["results"]]
    assert evaluated == [(name, "general", "low", 1) for name in ("base", "general-low", "student")]
    assert report["backend"] == "hf" and (run_dir / "bench" / "report.md").is_file()


def test_accuracy_standard_error_counts_tasks_not_samples():
    assert task_standard_error([[1.0, 1.0], [0.0, 0.0]]) == pytest.approx(0.5)  # two tasks: means 1 and 0
    assert task_standard_error([[1.0, 0.0], [1.0, 0.0]]) == 0.0  # the same mean on every task
    assert math.isnan(task_standard_error([[1.0, 0.0, 1.0]]))  # one task: no spread to measure


def test_difference_se_pairs_rows_scored_on_the_same_tasks():
    ours = {"accuracy": 0.5, "accuracy_se": 0.25, "task_rewards": [1.0, 1.0, 0.0, 0.0]}
    same_but_one = {"accuracy": 0.25, "accuracy_se": 0.25, "task_rewards": [1.0, 0.0, 0.0, 0.0]}
    assert difference_se(ours, same_but_one) == pytest.approx(statistics.stdev([0, 1, 0, 0]) / 2)  # 0.25
    assert difference_se(ours, ours) == 0.0  # the same outcome on every task: no noise in the difference
    unpaired = {"accuracy": 0.25, "accuracy_se": 0.25}  # an older report: no per-task rewards
    assert difference_se(ours, unpaired) == pytest.approx(math.hypot(0.25, 0.25))
    other_tasks = {**same_but_one, "task_rewards": [1.0, 0.0]}
    assert difference_se(ours, other_tasks) == pytest.approx(math.hypot(0.25, 0.25))


def test_report_scores_teachers_against_the_base_and_each_model_across_efforts():
    accuracies = {  # each teacher answers only its own cell; code-max's teacher is worse than code-high's
        "base": {"low": 0.2, "high": 0.3, "max": 0.7},
        "student": {"low": 0.5, "high": 0.6, "max": 0.7},
        "code-low": {"low": 0.52}, "code-high": {"high": 0.8}, "code-max": {"max": 0.55},
    }  # fmt: skip
    other_metrics = dict.fromkeys((key for _, keys, _ in TABLES for key in keys), 0.0)
    results = [
        {**other_metrics, "model": model, "domain": "code", "effort": effort, "accuracy": accuracy, "accuracy_se": 0.05}
        for model, by_effort in accuracies.items()
        for effort, accuracy in by_effort.items()
    ]
    models = [{"name": "base", "role": "base"}, {"name": "student", "role": "student"}] + [
        {"name": f"code-{e}", "role": "teacher", "cell": f"code-{e}"} for e in ("low", "high", "max")
    ]
    report = {
        "suite": {"name": "unit", "path": "unit.yaml", "n": 4, "seeds": [1001], "samples": 1, "temperature": 1.0},
        "machine": {"cpu_count": 2, "torch": "x", "platform": "y"},
        "backend": "hf",
        "efforts": {e: {"budget_tokens": b} for e, b in (("high", 96), ("low", 16), ("max", 384))},
        "models": models,
        "results": results,
    }
    text = markdown(report)

    def rows(title: str) -> list[list[str]]:
        section = text.split(f"## {title}")[1].split("##")[0]
        lines = [line for line in section.splitlines() if line.startswith("| ")][1:]
        return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]

    assert rows("Teachers against the base (accuracy)") == [
        ["code/low", "0.20", "0.52", "+0.32 ± 0.14", "yes"],
        ["code/high", "0.30", "0.80", "+0.50 ± 0.14", "yes"],
        ["code/max", "0.70", "0.55", "-0.15 ± 0.14", "no"],
    ]
    assert rows("Accuracy by effort") == [  # efforts in their own order, not the report's
        ["base", "code", "0.20", "0.30", "0.70", "yes"],
        ["student", "code", "0.50", "0.60", "0.70", "yes"],
        ["teachers", "code", "0.52", "0.80", "0.55", "no"],
    ]
    assert "## pass@k" not in text  # one sample per task: pass@1 is the accuracy table
