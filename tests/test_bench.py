"""`mopd bench`: suites (determinism, declared splits, clear errors), the training-data audit,
checkpoints checked before any sampling, same scores at temperature 0, accuracy within budget, a
run's base/teachers/student, and the report on disk.

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

from mopd.base.sft import expert_transcripts, mix_domains, train_contents
from mopd.bench import plots
from mopd.bench.audit import audit_jobs
from mopd.bench.report import TABLES, accuracy_interval, difference, machine_text, markdown
from mopd.bench.run import (
    ModelRef,
    bench_command,
    bench_run_dir,
    cell_metrics,
    env_options,
    run_bench,
    run_bench_stage,
    run_models,
    settings_recipe,
    task_family,
)
from mopd.bench.suite import BenchError, SuiteError, close, distinct_draw, load_suite, make_env, select
from mopd.distill.routing import build_route_table
from mopd.distill.trainer import task_source
from mopd.envs import get_env, prompt_contents, text_contents
from mopd.envs.base import DOMAINS, Task, Verdict
from mopd.envs.code import completion_of, function_from_meta
from mopd.envs.effort import EffortSpec
from mopd.envs.splits import RECORDS, TRAINED_TEXT, split_of, task_keys, write_trained_on
from mopd.envs.tokenizer import build_tiny_tokenizer
from mopd.model import K3HybridForCausalLM, preset_config
from mopd.pipeline import StageContext
from mopd.recipe import ROOT, Recipe, load_recipe, load_teacher_specs
from mopd.rl.grpo import teacher_env, teacher_tasks
from mopd.rollout import engine_cache
from mopd.rollout.engine_cache import EngineCache
from mopd.rollout.episodes import Rollout
from mopd.rollout.interface import PromptTooLongError
from mopd.stats import t_quantile

TINY_BUDGETS = {
    "low": {"budget_tokens": 4, "answer_tokens": 4},
    "high": {"budget_tokens": 8, "answer_tokens": 4},
    "max": {"budget_tokens": 12, "answer_tokens": 4},
}
LABEL = "overlapping or unaudited: some tasks were trained on, or what a model trained on is unknown"
SUITE = {
    "name": "unit",
    "split": "test",
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
@pytest.mark.parametrize(
    ("suite_path", "split"),
    [("eval/tiny.yaml", "test"), ("eval/tiny-dev.yaml", "dev"), ("eval/smoke.yaml", "test"), ("eval/smoke-dev.yaml", "dev")],
)
def test_suites_declare_their_split(suite_path, split):
    suite = load_suite(suite_path)
    assert suite.split == split and suite.domains and suite.efforts and suite.n > 0


@pytest.mark.parametrize("recipe", ["recipes/tiny.yaml", "recipes/smoke.yaml"])
def test_recipes_report_on_their_test_suite(recipe):
    assert load_suite(load_recipe(ROOT / recipe).bench.suite).split == "test"


def test_same_suite_and_seed_give_the_same_tasks_at_every_effort():
    """With the tiny recipe's env options, as `mopd bench --run runs/tiny` builds its envs."""
    suite, recipe = load_suite("eval/tiny.yaml"), load_recipe(ROOT / "recipes/tiny.yaml")
    suite = suite.model_copy(update={"n": 16})  # the property, not the size, is under test
    for domain in suite.domains:
        first, second = (make_env(suite, domain, recipe.env_options(domain)) for _ in range(2))
        tasks = {effort: suite.tasks(first, effort) for effort in suite.efforts}
        again = {effort: suite.tasks(second, effort) for effort in suite.efforts}
        assert tasks == again
        keys = {effort: task_keys(cell) for effort, cell in tasks.items()}
        assert all(k == keys["low"] for k in keys.values()), "every effort answers the same questions"
        assert {split_of(key) for key in keys["low"]} == {"test"}
        other_seed = suite.model_copy(update={"seeds": [s + 1 for s in suite.seeds]})
        assert task_keys(other_seed.tasks(first, "low")) != keys["low"]


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
        ({"split": "eval"}, r"bad.yaml: field `split`: .*'train', 'dev', 'test' or 'external'"),
        ({"n": 0}, r"bad.yaml: field `n`"),
        ({"typo": 1}, r"bad.yaml: unknown field `typo`"),
    ],
)
def test_bad_suites_are_named_errors(tmp_path, change, message):
    path = write_suite(tmp_path / "bad.yaml", {**SUITE, **change})
    with pytest.raises(SuiteError, match=message):
        load_suite(path)


def test_a_suite_must_declare_its_split(tmp_path):
    path = write_suite(tmp_path / "bad.yaml", {k: v for k, v in SUITE.items() if k != "split"})
    with pytest.raises(SuiteError, match=r"bad.yaml: .*`split`"):
        load_suite(path)


def test_suite_files_that_are_not_suites(tmp_path):
    with pytest.raises(SuiteError, match="no such file"):
        load_suite(tmp_path / "missing.yaml")
    (tmp_path / "broken.yaml").write_text("name: [unclosed\n")
    with pytest.raises(SuiteError, match=r"broken\.yaml: not valid YAML"):
        load_suite(tmp_path / "broken.yaml")


def test_command_line_selection_checks_domains_and_efforts():
    suite = load_suite("eval/tiny-dev.yaml")
    narrowed = select(suite, ["general"], ["max"], n=3, samples=2)
    assert list(narrowed.domains) == ["general"] and narrowed.efforts == ["max"]
    assert (narrowed.n, narrowed.samples) == (3, 2)
    with pytest.raises(SuiteError, match="unknown domain 'chess'"):
        select(suite, ["chess"])
    with pytest.raises(SuiteError, match="unknown effort 'medium'"):
        select(suite, efforts=["medium"])
    with pytest.raises(SuiteError, match=r"smoke\.yaml has no effort 'max'; it has \['low'\]"):
        select(load_suite("eval/smoke.yaml"), efforts=["max"], source="eval/smoke.yaml")
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
    for one, two in zip(alone["results"], shared["results"], strict=True):
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
    starts, create_engine = [], engine_cache.create_engine
    monkeypatch.setattr(engine_cache, "create_engine", lambda path, **kw: starts.append(path) or create_engine(path, **kw))
    cache = EngineCache("hf")
    for path in (checkpoints[0], teacher, checkpoints[1], teacher):
        engine = cache.load(Path(path))
    assert starts == [checkpoints[0]]
    assert torch.equal(engine.model.lm_head.weight, K3HybridForCausalLM.from_pretrained(teacher).lm_head.weight)


def test_the_engines_hold_the_recipes_max_model_len(checkpoints, suite_file):
    """The recipe's `max_model_len` reaches the bench's engine: a prompt with a max-effort turn (18 tokens) fits 2,048
    but not 20, and the refusal names the recipe's length."""
    short = Recipe(name="unit", efforts=TINY_BUDGETS, max_model_len=20)
    with pytest.raises(PromptTooLongError, match="exceeds max_model_len 20"):
        run_bench([checkpoints[0]], suite=suite_file, backend="hf", recipe=short, progress=False)


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
        allow_degraded_sandbox=False, allow_overlap=False, limit=None,
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
    assert {"cpu_count", "torch_threads", "torch", "platform"} <= set(report["machine"])  # describe_machine's
    for row in report["results"]:  # one task a cell: no interval, but its mean is the accuracy
        assert row["task_families"] == ["add"] and len(row["task_keys"]) == len(row["task_rewards"]) == 1
        assert row["accuracy_interval"]["mean"] == row["accuracy"] and "accuracy_se" not in row
    text = (command_out / "report.md").read_text()
    assert "Brackets are 95% intervals (`mopd.stats`)" in text and "## Accuracy by family" in text
    assert "| cell | base | trained |" in text and "| general/low |" in text
    # checkpoints from outside a run: no lineage to audit, and the report says so
    assert all("not inside a run directory" in r["audit"]["unavailable"] for r in report["results"])
    assert "| general/low | audit unavailable, 1 distinct | audit unavailable, 1 distinct |" in text
    assert "- base: audit unavailable: " in text
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
    for stage in ("base", "teachers/general-low", "teachers/code-max", "distill"):
        for record in RECORDS:
            write_trained_on(root / stage, [], record)  # it trained on no dev or test content
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
    differences = [s - t for s, t in zip(per_task["student"], per_task["general-low"], strict=True)]  # two distinct contents
    half = t_quantile(0.975, len(differences) - 1) * statistics.stdev(differences) / math.sqrt(len(differences))
    middle = statistics.fmean(differences)
    assert cells[5] == f"{middle:+.2f} [{middle - half:+.2f}, {middle + half:+.2f}]"
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


def test_a_cells_accuracy_interval_is_t_over_contents_or_wilson_for_an_external_proportion():
    """Ten tasks, 5 right, contents a, a, b, ..., i with a's two tasks right: the 9 contents weigh once, 4 of 9
    right, mean 0.4444 ± t_{.975,8}·s/√9 = 0.4444 ± 2.3060·0.52705/3 = [0.0393, 0.8496]; each content once with
    0/1 answers, an external suite's 3 of 5 is the Wilson interval [0.2307, 0.8824] (p̂ + z²/2n ± ..., z = 1.96)."""
    generated = accuracy_interval([1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0], list("aabcdefghi"), 1, external=False)
    assert (generated.mean, generated.low, generated.high) == (
        pytest.approx(4 / 9), pytest.approx(0.0393, abs=1e-4), pytest.approx(0.8496, abs=1e-4))
    wilson = accuracy_interval([1.0, 1.0, 0.0, 0.0, 1.0], ["a", "b", "c", "d", "e"], 1, external=True)
    assert (wilson.mean, wilson.low, wilson.high) == (0.6, pytest.approx(0.2307, abs=1e-4), pytest.approx(0.8824, abs=1e-4))
    two_samples = accuracy_interval([1.0, 0.5, 0.0, 0.5], ["a", "b", "c", "d"], 2, external=True)  # mean@2: t over problems
    assert two_samples.df == 3 and two_samples.mean == 0.5
    assert math.isnan(accuracy_interval([1.0, 0.0], ["a", "a"], 1, external=False).low)  # one content: no interval


def test_a_difference_is_paired_task_by_task_and_a_repeated_content_counts_once():
    ours = {"task_rewards": [1.0, 1.0, 0.0, 0.0], "task_keys": ["a", "b", "c", "d"]}
    same_but_one = {"task_rewards": [1.0, 0.0, 0.0, 0.0], "task_keys": ["a", "b", "c", "d"]}
    gap = difference(ours, same_but_one)  # per-task differences 0, 1, 0, 0: mean 0.25, se 0.25, df 3
    assert (gap.mean, gap.se, gap.df) == (0.25, pytest.approx(0.25), 3)
    assert gap.low == pytest.approx(0.25 - t_quantile(0.975, 3) * 0.25)
    assert difference(ours, ours).text() == "0.00 [0.00, 0.00]"  # the same outcome on every task: no noise
    repeated = {"task_keys": ["a", "a", "c", "d"]}
    clustered_gap = difference(ours | repeated, same_but_one | repeated)  # contents a, c, d: differences 0.5, 0, 0
    assert (clustered_gap.mean, clustered_gap.df) == (pytest.approx(0.5 / 3), 2)
    assert difference(ours, {"accuracy": 0.25}) is None  # an older report: no per-task rewards
    assert difference(ours, {**same_but_one, "task_keys": ["a", "b", "c", "e"]}) is None  # other tasks: not paired


def test_the_machine_line_reads_describe_machines_keys_and_older_reports():
    new = {"cpu_count": 2, "torch_threads": 1, "torch": "2.13", "platform": "Linux", "load_average": [1.5, 1.0, 0.5]}
    assert machine_text(new) == "2 CPUs, torch 2.13 on 1 thread(s), Linux, load average 1.5 at the end"
    old = {"cpu_count": 2, "threads": 1, "torch": "2.13", "platform": "Linux"}  # docs/example-bench's keys
    assert machine_text(old) == "2 CPUs, torch 2.13 on 1 thread(s), Linux"
    example = json.loads((ROOT / "docs" / "example-bench" / "report.json").read_text())
    assert "Not available: the report's rows carry no per-task families" in markdown(example)


def test_report_scores_teachers_against_the_base_and_each_model_across_efforts():
    """Four tasks a cell, contents k1, k1, k2, k3: a difference's interval is over the three contents, paired.
    code/high: teacher − base per content 0, 1, 1: 0.67 ± t_{.975,2}·0.57735/√3 = 0.67 ± 1.43, between the
    content-weighted accuracies beside it (base 0.5, 0, 0 → 0.17; teacher 0.5, 1, 1 → 0.83: k1 weighs once, not the
    task means 0.25 and 0.75); code/max: −0.5, −1, 0: −0.50 ± 4.3027·0.5/√3."""
    rewards = {  # each teacher answers only its own cell; code-max's teacher is worse than the base
        "base": {"low": [0, 0, 0, 0], "high": [0, 1, 0, 0], "max": [1, 1, 1, 0]},
        "student": {"low": [1, 0, 1, 0], "high": [1, 1, 0, 0], "max": [1, 1, 1, 0]},
        "code-low": {"low": [1, 1, 1, 1]}, "code-high": {"high": [0, 1, 1, 1]}, "code-max": {"max": [1, 0, 0, 0]},
    }  # fmt: skip
    other_metrics = dict.fromkeys((key for _, keys, _ in TABLES for key in keys), 0.0)
    tasks = {"task_keys": ["k1", "k1", "k2", "k3"], "task_families": ["linear", "linear", "poly", "poly"]}
    results = [
        {**other_metrics, **tasks, "model": model, "domain": "code", "effort": effort,
         "accuracy": statistics.fmean(scores), "task_rewards": [float(x) for x in scores]}
        for model, by_effort in rewards.items()
        for effort, scores in by_effort.items()
    ]  # fmt: skip
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
        ["code/low", "0.00", "1.00", "+1.00 [+1.00, +1.00]", "yes"],
        ["code/high", "0.17", "0.83", "+0.67 [-0.77, +2.10]", "no"],  # k1's two tasks weigh as one content
        ["code/max", "0.67", "0.17", "-0.50 [-1.74, +0.74]", "no"],
    ]
    assert "± 2 SE" not in text and "beyond 2 SE" not in text
    assert rows("Accuracy by effort") == [  # efforts in their own order, not the report's
        ["base", "code", "0.00", "0.25", "0.75", "yes"],
        ["student", "code", "0.50", "0.50", "0.75", "no"],
        ["teachers", "code", "1.00", "0.75", "0.25", "no"],
    ]
    by_family = rows("Accuracy by family")  # every effort pooled, then each: two contents k2, k3 of poly
    assert [row[:4] for row in by_family] == [
        ["code", family, effort, "6" if effort == "all" else "2"]
        for family in ("linear", "poly") for effort in ("all", "low", "high", "max")
    ]  # fmt: skip
    assert by_family[4][4:] == ["0.17 [0.00, 1.00]", "0.67 [0.67, 0.67]", "0.33 [0.00, 1.00]"]  # base, teacher, student
    assert by_family[0][4] == "0.50 (no interval: one draw)"  # linear: the one content k1
    assert "## pass@k" not in text  # one sample per task: pass@1 is the accuracy table


# ----------------------------------------------------------------------------- the training-data audit
def stage_keys(recipe: Recipe) -> dict[str, tuple[list[str], set[str]]]:
    """Per training stage of `recipe`, drawn by the stages' own functions: the keys of the tasks it
    trains on, and the contents its trained text states (the base: its experts' transcripts)."""
    sft = recipe.base.sft
    envs = {domain: get_env(domain, **recipe.env_options(domain)) for domain in mix_domains(sft.mix)}
    transcripts = [episode for _, episode in expert_transcripts(envs, sft.examples, sft.mix, recipe.seed)]
    keys = {"base": (task_keys(task for task, _ in transcripts),
                     set().union(*(train_contents(task, turns) for task, turns in transcripts)))}  # fmt: skip
    for cell, spec in load_teacher_specs(recipe).items():
        envs[cell] = teacher_env(spec, recipe)
        tasks = teacher_tasks(envs[cell], spec, recipe)
        keys[f"teachers/{cell}"] = (task_keys(tasks), prompt_contents(tasks))
    spec = recipe.distill
    table = build_route_table(spec.mix, {cell: cell for cell in spec.mix})  # drawing reads only the weights
    source = task_source(table, spec, recipe.seed, {d: recipe.env_options(d) for d in DOMAINS}, None)
    prompts = [task for step in range(1, spec.steps + 1) for task in source(step)]
    keys["distill"] = (task_keys(prompts), prompt_contents(prompts))
    for env in envs.values():
        close_env(env)
    return keys


def close_env(env) -> None:
    if hasattr(env, "close"):
        env.close()


def records_run(root: Path, recipe: Recipe, keys: dict[str, tuple[list[str], set[str]]]) -> Path:
    """A run directory holding only the stages' training records (the audit reads no weights)."""
    root.mkdir(parents=True)
    (root / "recipe.json").write_text(json.dumps(recipe.model_dump(mode="json")))
    for stage, (tasks, text) in keys.items():
        write_trained_on(root / stage, tasks)
        write_trained_on(root / stage, text, TRAINED_TEXT)
    return root


@pytest.mark.parametrize("recipe_path", ["recipes/smoke.yaml", "recipes/tiny.yaml"])
def test_the_recipes_test_suites_audit_to_zero_overlap(tmp_path, recipe_path):
    """Every stage of the recipe draws from train only: its bench suite (test) shares no content with
    what the base, any teacher or the student trained on, cell by cell, model by model."""
    recipe = load_recipe(ROOT / recipe_path)
    keys = stage_keys(recipe)
    assert all(tasks for tasks, _ in keys.values()) and keys["base"][1]  # the base's traces state contents
    assert {split_of(k) for tasks, text in keys.values() for k in [*tasks, *text]} == {"train"}
    run = records_run(tmp_path / "run", recipe, keys)
    suite = load_suite(recipe.bench.suite)
    envs = {domain: make_env(suite, domain, recipe.env_options(domain)) for domain in suite.domains}
    cells = {f"{d}-{e}": suite.tasks(envs[d], e) for d in suite.domains for e in suite.efforts}
    jobs = [("base", run / "base", cell, tasks) for cell, tasks in cells.items()]
    jobs += [(cell, run / "teachers" / cell, cell, tasks) for cell, tasks in cells.items()]
    jobs += [("student", run / "distill" / "model", cell, tasks) for cell, tasks in cells.items()]
    audits = audit_jobs(jobs)
    assert len(audits) == 3 * len(cells)
    for (model, cell), audit in audits.items():
        assert (audit["overlap"], audit["tasks"]) == (0, suite.n * len(suite.seeds)), (model, cell)
        assert audit["distinct"] == len(set(task_keys(cells[cell])))
    student = audits[("student", next(iter(cells)))]
    assert set(student["stages"]) == {"base", f"teachers/{next(iter(cells))}", "distill"}
    for env in envs.values():
        close_env(env)


def planted_run(
    root: Path, checkpoint: Path, recipe: Recipe, cell: str, planted: dict[str, list[str]], text: dict[str, list[str]] | None = None
) -> Path:
    """A finished run (base, the cell's teacher, student) whose stages recorded `planted` task keys and
    `text` content keys found in their trained text (else none)."""
    for stage in ("base", f"teachers/{cell}", "distill/model"):
        shutil.copytree(checkpoint, root / stage)
    (root / "recipe.json").write_text(json.dumps(recipe.model_dump(mode="json")))
    for stage in ("base", f"teachers/{cell}", "distill"):
        write_trained_on(root / stage, planted.get(stage, []))
        write_trained_on(root / stage, (text or {}).get(stage, []), TRAINED_TEXT)
    return root


def audit_suite(path: Path, domain: str, families: list[str] | None = None, split: str = "test") -> Path:
    spec = {"families": families} if families else {}
    return write_suite(path, {**SUITE, "split": split, "efforts": ["low"], "domains": {domain: spec}})


def suite_keys(suite_file: Path, recipe: Recipe, domain: str) -> list[str]:
    suite = load_suite(suite_file)
    env = make_env(suite, domain, recipe.env_options(domain))
    try:
        return task_keys(suite.tasks(env, "low"))
    finally:
        close_env(env)


def unit_tiny_recipe() -> Recipe:
    """The tiny recipe's env options (what the audit must hold for), with budgets that sample fast
    on one engine here (no Ray workers)."""
    tiny = load_recipe(ROOT / "recipes/tiny.yaml")
    return tiny.model_copy(update={"efforts": tiny_recipe().efforts, "bench": tiny.bench.model_copy(update={"workers": 1})})


@pytest.mark.parametrize(("domain", "stage"), [("code", "teachers/code-low"), ("agent", "distill")])
def test_a_planted_overlap_fails_before_sampling_naming_cell_model_and_stage(
    tmp_path, checkpoints, no_sampling, domain, stage
):
    recipe = unit_tiny_recipe()
    suite = audit_suite(tmp_path / "unit.yaml", domain)
    first = suite_keys(suite, recipe, domain)[0]
    run = planted_run(tmp_path / "run", checkpoints[0], recipe, f"{domain}-low", {stage: [first]})
    with pytest.raises(BenchError) as err:
        bench_run_dir(run, suite=str(suite), backend="hf", progress=False)
    message = str(err.value)
    assert "is a test suite, but some of its tasks were trained on" in message and "--allow-overlap" in message
    assert f"model 'student' cell {domain}-low: 1/2 tasks trained on in {stage} (1)" in message
    assert ("model 'base'" in message) is (stage == "base")
    assert (f"model '{domain}-low'" in message) is stage.startswith("teachers/")


def test_a_question_another_family_trained_on_is_caught_and_allow_overlap_labels_the_report(
    tmp_path, checkpoints
):
    """General keys hash the question and answer, not the family: "Compute 9 + 7." drawn by `chain`
    for training is the same task as `add`'s. With --allow-overlap the bench runs, labelled."""
    recipe = unit_tiny_recipe()
    suite = audit_suite(tmp_path / "unit.yaml", "general", families=["add"])
    added = suite_keys(suite, recipe, "general")
    chain = get_env("general", **{**recipe.env_options("general"), "families": ["chain"]})
    chained = {task.meta["content_hash"]: task for task in chain.sample(300, 0, "test", "low")}
    shared = [key for key in added if key in chained]
    assert shared and {chained[key].meta["family"] for key in shared} == {"chain"}
    run = planted_run(tmp_path / "run", checkpoints[0], recipe, "general-low", {"base": shared})
    with pytest.raises(BenchError, match=rf"model 'base' cell general-low: {len(shared)}/2 tasks trained on in base"):
        bench_run_dir(run, suite=str(suite), backend="hf", progress=False)

    report = bench_run_dir(run, suite=str(suite), backend="hf", progress=False, allow_overlap=True)
    assert report["label"] == LABEL
    assert {r["model"]: r["audit"]["overlap"] for r in report["results"]} == dict.fromkeys(
        ("base", "general-low", "student"), len(shared)
    )
    text = (run / "bench" / "report.md").read_text()
    titles = [line for line in text.splitlines() if line.startswith("#")]
    assert all(title.endswith(f"— {LABEL}") for title in titles), titles
    assert f"| general/low | overlap {len(shared)}/2, 2 distinct | overlap {len(shared)}/2, 2 distinct | overlap {len(shared)}/2, 2 distinct |" in text


def test_a_train_suite_is_an_in_distribution_evaluation_labelled_training_tasks(tmp_path, checkpoints):
    recipe = unit_tiny_recipe()
    suite = audit_suite(tmp_path / "unit.yaml", "general", split="train")
    trained = suite_keys(suite, recipe, "general")
    run = planted_run(tmp_path / "run", checkpoints[0], recipe, "general-low", {"base": trained})
    report = bench_run_dir(run, suite=str(suite), efforts=["low"], n=1, backend="hf", progress=False)
    assert report["label"] == "training tasks"
    assert [(r["audit"]["overlap"], r["audit"]["tasks"]) for r in report["results"]] == [(1, 1)] * 3
    titles = [line for line in markdown(report).splitlines() if line.startswith("#")]
    assert titles[0].startswith("# Effort benchmark: suite `unit`, train split — training tasks")
    assert all(title.endswith("— training tasks") for title in titles)


def test_a_run_without_records_is_audit_unavailable_not_zero(tmp_path, checkpoints):
    run = planted_run(tmp_path / "run", checkpoints[0], unit_tiny_recipe(), "general-low", {})
    (run / "distill" / "trained_on.txt").unlink()  # a student distilled before records existed
    jobs = [(name, path, "general-low", []) for name, path in
            (("base", run / "base"), ("teacher", run / "teachers" / "general-low"), ("student", run / "distill" / "model"),
             ("stray", run / "bench"), ("outside", checkpoints[0]))]  # fmt: skip
    audits = audit_jobs(jobs)
    assert audits[("base", "general-low")] == {"tasks": 0, "distinct": 0, "overlap": 0, "stages": {"base": 0}}
    assert audits[("teacher", "general-low")]["stages"] == {"base": 0, "teachers/general-low": 0}
    assert "distill wrote no training record" in audits[("student", "general-low")]["unavailable"]
    assert "is not a base/, teachers/<cell>/, distill/ or baselines/mixed_rl/ checkpoint" in audits[("stray", "general-low")]["unavailable"]
    assert "not inside a run directory" in audits[("outside", "general-low")]["unavailable"]


def test_a_test_function_in_an_sft_failed_attempt_is_refused_by_sft_and_by_the_audit(tmp_path, checkpoints, no_sampling):
    """Issue #42's leak: a failed-attempt demo that shows a test function. The base's SFT refuses such
    an example; a base that trained on one anyway (its text record names the function, as the SFT of
    earlier code wrote none) fails the bench of a test suite holding that function."""
    recipe = unit_tiny_recipe()
    suite = audit_suite(tmp_path / "unit.yaml", "code")
    env = make_env(load_suite(suite), "code", recipe.env_options("code"))
    try:
        held_out = load_suite(suite).tasks(env, "low")[0]
        task = env.sample(1, 0, "train", "high")[0]
    finally:
        close_env(env)
    examples = task.meta["examples"]
    turns = [
        {"role": "assistant", "content": completion_of(function_from_meta(held_out.meta), examples, "high")},
        {"role": "observation", "content": "f(1) returned 2, expected 3"},
        {"role": "assistant", "content": completion_of(function_from_meta(task.meta), examples, "high")},
    ]
    with pytest.raises(ValueError, match=rf"SFT example of task {task.id} \(code-high\) states held-out contents \['{held_out.meta['content_hash']} \(test\)'\]"):
        train_contents(task, turns)

    stated = text_contents("code", "".join(turn["content"] for turn in turns))
    assert stated == {held_out.meta["content_hash"], task.meta["content_hash"]}
    run = planted_run(tmp_path / "run", checkpoints[0], recipe, "code-low", {"base": [task.meta["content_hash"]]},
                      text={"base": sorted(stated)})  # fmt: skip
    with pytest.raises(BenchError) as err:
        bench_run_dir(run, suite=str(suite), backend="hf", progress=False)
    assert "model 'base' cell code-low: 1/2 tasks trained on in base (1)" in str(err.value)


def test_a_stage_without_its_text_record_fails_a_test_bench_unless_allowed(tmp_path, checkpoints, monkeypatch):
    recipe = unit_tiny_recipe()
    suite = audit_suite(tmp_path / "unit.yaml", "general")
    run = planted_run(tmp_path / "run", checkpoints[0], recipe, "general-low", {})
    (run / "teachers" / "general-low" / TRAINED_TEXT).unlink()  # a teacher trained before text records existed
    with pytest.raises(BenchError, match=r"what some models trained on is unknown: .*teachers/general-low wrote no training record"):
        bench_run_dir(run, suite=str(suite), backend="hf", progress=False)
    report = bench_run_dir(run, suite=str(suite), backend="hf", progress=False, allow_overlap=True, n=1)
    assert report["label"] == LABEL
    assert {r["model"] for r in report["results"] if "unavailable" in r["audit"]} == {"general-low", "student"}


def test_a_cell_holds_each_content_once_while_the_split_has_enough_then_repeats_them_in_turn():
    def draw(count: int, seed: int) -> list[Task]:  # contents a, b, a, c, b, d, ... of which 4 are distinct
        keys = ["a", "b", "a", "c", "b", "d"] + ["a"] * 100
        return [Task(f"s{seed}-{i}", "general", "low", "q", {"content_hash": keys[i] * 16}) for i in range(count)]

    three = distinct_draw(draw, [7], 3)
    assert [t.meta["content_hash"][0] for t in three] == ["a", "b", "c"]
    six = distinct_draw(draw, [7], 6)
    assert [t.meta["content_hash"][0] for t in six] == ["a", "b", "c", "d", "a", "b"]  # then in turn
    assert len({t.id for t in six}) == 6
    two_seeds = distinct_draw(draw, [7, 8], 2)  # the second seed takes what the first left
    assert [t.meta["content_hash"][0] for t in two_seeds] == ["a", "b", "c", "d"]
    spent = distinct_draw(draw, [7, 8], 4)  # the first took all four: the second repeats them in turn
    assert [t.meta["content_hash"][0] for t in spent] == ["a", "b", "c", "d", "a", "b", "c", "d"]


def test_the_tiny_test_suite_asks_each_code_function_once_before_any_twice():
    recipe, suite = load_recipe(ROOT / "recipes/tiny.yaml"), load_suite(ROOT / "eval/tiny.yaml")
    env = make_env(suite, "code", recipe.env_options("code"))
    try:
        cells = {effort: task_keys(suite.tasks(env, effort)) for effort in ("low", "max")}
    finally:
        close_env(env)
    keys = cells["low"]
    distinct = len(set(keys))
    assert cells["max"] == keys and len(keys) == suite.n
    assert len(set(keys[:distinct])) == distinct  # the split's functions first, each once
    assert distinct < suite.n and max(keys.count(k) for k in keys) == math.ceil(suite.n / distinct)


# ----------------------------------------------------------------------------- accuracy within budget
def test_accuracy_within_budget_counts_over_budget_answers_as_wrong():
    """The verifier accepts both samples of the first task, but one thought past the budget."""
    task = Task("t", "general", "low", "Compute 1 + 1.")

    def sample(reward: float, thinking: int) -> Rollout:
        budget = 4
        return Rollout(task, [1], [2, 3], verdict=Verdict(reward), thinking_tokens=thinking,
                       closed_think=True, over_budget=thinking > budget, loss_mask=[1, 1])  # fmt: skip

    groups = [[sample(1.0, 3), sample(1.0, 9)], [sample(0.0, 2), sample(1.0, 7)]]
    metrics = cell_metrics(groups, [0.1] * 4, 1.0, EffortSpec(budget_tokens=4))
    assert metrics["raw_accuracy"] == 0.75 and metrics["accuracy"] == 0.25
    assert metrics["over_budget_rate"] == 0.5
    assert metrics["task_rewards"] == [0.5, 0.0]  # paired comparisons use the within-budget scores
    assert metrics["task_families"] == ["general", "general"]  # a task without a family: its domain's
    assert (metrics["raw_pass_at_k"], metrics["pass_at_k"]) == (1.0, 0.5)


def test_each_generated_task_names_its_family_and_an_external_one_its_category_or_domain():
    suite = load_suite(ROOT / "eval" / "tiny.yaml")
    recipe = load_recipe(ROOT / "recipes" / "tiny.yaml")
    for domain in DOMAINS:
        env = make_env(suite, domain, recipe.env_options(domain))
        assert {task_family(t) for t in suite.tasks(env, "low")} == set(env.families)
        close(env)
    assert task_family(Task("bfcl-1", "bfcl", "low", "?", {"category": "parallel"})) == "parallel"
    assert task_family(Task("humaneval-0", "humaneval", "low", "?", {})) == "humaneval"


def test_a_student_is_audited_against_the_teachers_its_run_trained_not_every_cells(tmp_path, checkpoints):
    """A recipe with one teacher (`teachers.cells: [general-low]`): the student's tasks of another cell have no teacher
    of their own to audit, and must not read as a missing record; a listed teacher's missing record still does."""
    recipe = unit_tiny_recipe()
    recipe = recipe.model_copy(update={"teachers": recipe.teachers.model_copy(update={"cells": ["general-low"]})})
    run = planted_run(tmp_path / "run", checkpoints[0], recipe, "general-low", {})
    audits = audit_jobs([("student", run / "distill" / "model", cell, []) for cell in ("general-low", "general-high")])
    assert audits[("student", "general-high")]["stages"] == {"base": 0, "distill": 0}
    assert audits[("student", "general-low")]["stages"] == {"base": 0, "teachers/general-low": 0, "distill": 0}
    (run / "teachers" / "general-low" / "trained_on.txt").unlink()
    assert "teachers/general-low" in audit_jobs([("student", run / "distill" / "model", "general-low", [])])[("student", "general-low")]["unavailable"]


def test_a_suite_names_the_recipe_a_model_from_outside_a_run_is_benchmarked_under(tmp_path):
    """`mopd bench models/smollm2-135m --suite eval/smollm2.yaml` meets the recipe's budgets and code tasks, not the
    defaults; a run's own recipe wins; a recipe path that is not a file is refused, naming the field."""
    suite = load_suite(ROOT / "eval" / "smollm2.yaml")
    recipe, settings = settings_recipe(None, [ModelRef("pretrained", tmp_path / "outside")], suite)
    smollm2 = load_recipe(ROOT / "recipes" / "smollm2.yaml")
    assert recipe.efforts == smollm2.efforts and recipe.efforts != Recipe(name="bench").efforts
    assert env_options(suite, "code", recipe)["difficulty"] == [2, 2] and "recipes/smollm2.yaml` (the suite's recipe)" in settings
    run = tmp_path / "run"
    (run / "base").mkdir(parents=True)
    (run / "recipe.json").write_text(json.dumps(Recipe(name="mine").model_dump(mode="json")))
    assert settings_recipe(None, [ModelRef("base", run / "base")], suite)[1] == "recipe `mine` (the models' run)"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**yaml.safe_load((ROOT / "eval" / "smollm2.yaml").read_text()), "recipe": "nope.yaml"}))
    with pytest.raises(SuiteError, match=r"bad.yaml: field `recipe`: 'nope.yaml' is not a file"):
        load_suite(bad)
