"""Budget forcing (`on_budget: force`): a turn whose thinking reaches its budget unclosed is closed by the engine,
the model answers, the forced tokens stay out of every loss and of the sampled log-probs, and the answer is judged.
The default (`fail`) changes nothing: not the sampling, not a stage hash."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from mopd.artifacts import config_hash
from mopd.bench.report import markdown
from mopd.bench.run import cell_metrics
from mopd.cli import main
from mopd.envs import get_env
from mopd.envs.base import THINK_CLOSE, THINK_OPEN
from mopd.envs.chat import END, USER
from mopd.envs.effort import EffortSpec
from mopd.model import K3HybridForCausalLM, preset_config
from mopd.pipeline import build_stages
from mopd.recipe import load_recipe, load_teacher_specs
from mopd.rl.teachers import spec_hash
from mopd.rollout.episodes import run_rollouts
from mopd.rollout.hf_backend import HFEngine
from mopd.rollout.interface import Sample

ROOT = Path(__file__).resolve().parent.parent
BUDGET, ANSWER = 6, 4
FORCE = {"low": EffortSpec(budget_tokens=BUDGET, answer_tokens=ANSWER, on_budget="force")}
FAIL = {"low": EffortSpec(budget_tokens=BUDGET, answer_tokens=ANSWER)}


class ScriptedEngine:
    """Thinks without end; once the context ends in `</think>`, answers the task's sum. Honours max_tokens."""

    policy_version = 1

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, []
        self.close = tokenizer.convert_tokens_to_ids(THINK_CLOSE)

    def generate(self, prompt_ids, n=1, sampling=None):
        self.calls.append(sampling)
        return [[self.turn(ids, limit)] for ids, limit in zip(prompt_ids, sampling.max_tokens_for(len(prompt_ids)), strict=True)]

    def turn(self, context, limit) -> Sample:
        text = self.answer(context) + END if context[-1] == self.close else THINK_OPEN + "1+1=2, 2+1=3, 3+1=4, " * 9
        tokens = self.tokenizer.encode(text, add_special_tokens=False)
        reason = "length" if len(tokens) > limit else "stop"
        return Sample(tokens[:limit], [-0.25] * min(len(tokens), limit), reason, self.policy_version)

    def answer(self, context) -> str:
        question = self.tokenizer.decode(context).split(USER)[1].split(END)[0]  # "Compute 9 + 8."
        return str(sum(int(term) for term in re.findall(r"\d+", question)))


@pytest.fixture(scope="module")
def add_env():
    return get_env("general", families=["add"], add_digits=[1, 1])


def test_a_forced_turn_is_closed_masked_and_its_answer_judged(tiny_tokenizer, add_env):
    tasks = add_env.sample(3, seed=0, split="dev", effort="low")
    engine = ScriptedEngine(tiny_tokenizer)
    groups = run_rollouts(engine, tiny_tokenizer, {"general": add_env}, tasks, FORCE, seed=3)

    think_close = tiny_tokenizer.convert_tokens_to_ids(THINK_CLOSE)
    assert [call.max_tokens for call in engine.calls] == [[1 + BUDGET] * 3, [ANSWER] * 3]  # both calls batched
    for (rollout,) in groups:
        assert rollout.verdict.details["got"] == rollout.verdict.details["expected"], rollout.verdict.details
        assert rollout.reward == 1.0 and rollout.closed_think and not rollout.over_budget
        assert rollout.turn_forced == [True] and rollout.thinking_tokens == BUDGET
        forced = [k for k, f in enumerate(rollout.forced) if f]
        assert forced == [1 + BUDGET] and rollout.token_ids[forced[0]] == think_close
        assert [rollout.loss_mask[k] for k in forced] == [0] and [rollout.logprobs[k] for k in forced] == [0.0]
        assert sum(rollout.loss_mask) == len(rollout.token_ids) - 1  # every other token is the model's own

    metrics = cell_metrics(groups, [0.1] * 3, 1.0, FORCE["low"])
    assert metrics["forced_rate"] == 1.0 and metrics["accuracy"] == 1.0


def test_fail_samples_a_turn_in_one_call_and_leaves_it_over_budget(tiny_tokenizer, add_env):
    tasks = add_env.sample(2, seed=0, split="dev", effort="low")
    engine = ScriptedEngine(tiny_tokenizer)
    groups = run_rollouts(engine, tiny_tokenizer, {"general": add_env}, tasks, FAIL, seed=3)
    assert [call.max_tokens for call in engine.calls] == [[FAIL["low"].max_new_tokens] * 2]
    for (rollout,) in groups:
        assert not rollout.closed_think and rollout.reward == 0.0 and rollout.over_budget
        assert rollout.turn_forced == [False] and not any(rollout.forced) and all(rollout.loss_mask)
    assert cell_metrics(groups, [0.1] * 2, 1.0, FAIL["low"])["forced_rate"] == 0.0


# ----------------------------------------------------------------------------- both engines, a tiny real model
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, tiny_tokenizer):
    path = tmp_path_factory.mktemp("forcing_model")
    torch.manual_seed(0)
    K3HybridForCausalLM(preset_config("tiny", num_hidden_layers=2, vocab_size=len(tiny_tokenizer))).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


def vllm_engine(path):
    from mopd.rollout.vllm_backend import VllmEngine

    return VllmEngine(path, max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=1 << 26)


@pytest.mark.parametrize("make_engine", [lambda path: HFEngine(path, max_model_len=256), vllm_engine], ids=["hf", "vllm"])
def test_both_engines_close_an_unclosed_turn_and_sample_its_answer_after_it(make_engine, tiny_model, tiny_tokenizer, add_env):
    """An untrained model never closes its thinking within the budget: every turn is forced, and what it then
    writes is its own continuation of prompt + thinking + `</think>` (its log-probs are the engine's scores of it)."""
    tasks = add_env.sample(4, seed=0, split="dev", effort="low")
    engine = make_engine(tiny_model)
    try:
        groups = run_rollouts(engine, tiny_tokenizer, {"general": add_env}, tasks, FORCE, temperature=0.0)
        rollouts = [r for group in groups for r in group]
        scores = engine.score([r.prompt_ids for r in rollouts], [r.token_ids for r in rollouts])
    finally:
        engine.close()
    think_close = tiny_tokenizer.convert_tokens_to_ids(THINK_CLOSE)
    for rollout, score in zip(rollouts, scores, strict=True):
        assert rollout.turn_forced == [True] and rollout.closed_think and not rollout.over_budget
        assert rollout.forced.index(1) == len(rollout.token_ids) - len(rollout.forced) + rollout.token_ids.index(think_close)
        assert sum(rollout.forced) == 1 and rollout.thinking_tokens <= BUDGET
        assert len(rollout.token_ids) <= 1 + BUDGET + 1 + ANSWER
        own = [k for k, m in enumerate(rollout.loss_mask) if m]
        assert own == [k for k, f in enumerate(rollout.forced) if not f]
        assert rollout.logprobs[rollout.forced.index(1)] == 0.0
        torch.testing.assert_close(torch.tensor([rollout.logprobs[k] for k in own]), torch.tensor([score[k] for k in own]), atol=1e-3, rtol=0)
        assert "got" in rollout.verdict.details  # judged as an answer, not refused as unclosed thinking


# ----------------------------------------------------------------------------- the recipe field
def test_a_bad_on_budget_is_refused_naming_the_field(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nefforts: {low: {budget_tokens: 16}, high: {budget_tokens: 96, on_budget: stop}, max: {budget_tokens: 384}}\n")
    assert main(["validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "field `efforts.high.on_budget`" in err and "'force' or 'fail'" in err
    assert len(err.strip().splitlines()) == 1


# Recorded at 604e782, before `on_budget` existed: a recipe that keeps the default must keep every finished stage.
TINY_STAGES = {"base": "6a5a32e4d8b955bc", "teachers": "09f8fd71322ab48c", "distill": "f32fe82627035599", "bench": "eed6bdcd9283dc86"}
TINY_TEACHERS = {"general-low": "ffbcc866c24d3923", "agent-max": "1d406d55aa95e09a", "code-high": "171ba58adc9b3e11"}


def stage_hashes(recipe) -> dict[str, str]:
    return {stage.name: config_hash(stage.name, stage.config)[:16] for stage in build_stages(recipe, ROOT / "recipes")}


def teacher_hashes(recipe) -> dict[str, str]:
    specs = load_teacher_specs(recipe, ROOT / "recipes")
    return {cell: spec_hash(specs[cell], recipe, Path("/nonexistent/base"))[:16] for cell in TINY_TEACHERS}


def test_the_fail_default_keeps_the_tiny_recipes_stage_hashes_and_force_changes_the_sampling_stages():
    tiny = load_recipe(ROOT / "recipes/tiny.yaml")
    assert tiny.efforts["high"].on_budget == "fail"
    assert stage_hashes(tiny) == TINY_STAGES and teacher_hashes(tiny) == TINY_TEACHERS
    forced = stage_hashes(load_recipe(ROOT / "recipes/tiny.yaml", ["efforts.high.on_budget=force"]))
    assert {name for name in TINY_STAGES if forced[name] != TINY_STAGES[name]} == {"teachers", "distill", "bench"}


def test_the_report_shows_the_forced_share_where_an_effort_forces(tiny_tokenizer, add_env):
    tasks = add_env.sample(2, seed=0, split="dev", effort="low")
    report = fake_report(run_rollouts(ScriptedEngine(tiny_tokenizer), tiny_tokenizer, {"general": add_env}, tasks, FORCE), FORCE)
    assert "## Forced share" in markdown(report) and "| general/low | 1.00 |" in markdown(report)
    report["efforts"]["low"]["on_budget"] = "fail"
    assert "Forced share" not in markdown(report)


def fake_report(groups, efforts) -> dict:
    metrics = cell_metrics(groups, [0.1] * len(groups), 1.0, efforts["low"])
    row = {"model": "m", "domain": "general", "effort": "low", **metrics, "task_keys": [str(k) for k in range(len(groups))]}
    return {
        "suite": {"name": "s", "path": "s.yaml", "split": "dev", "n": len(groups), "seeds": [0], "samples": 1, "temperature": 0.0},
        "machine": {"cpu_count": 2, "torch": torch.__version__, "platform": "linux"},
        "backend": "hf", "efforts": {e: s.model_dump() for e, s in efforts.items()},
        "models": [{"name": "m", "role": "base", "path": "m"}], "results": [row],
    }  # fmt: skip


def test_pair_modes_on_budget_reaches_every_effort(tmp_path, monkeypatch):
    import mopd.distill.pair

    calls = []
    monkeypatch.setattr(mopd.distill.pair, "distill_pair", lambda *args, **kwargs: calls.append(kwargs) or tmp_path)
    argv = ["distill", "--teacher", "t", "--student", "s", "--out", str(tmp_path), "--domain", "general", "--effort", "low"]
    assert mopd.distill.pair.main([*argv, "--on-budget", "force", "--eval-tasks", "0"]) == 0
    assert mopd.distill.pair.main([*argv, "--eval-tasks", "0"]) == 0
    assert [{spec.on_budget for spec in call["efforts"].values()} for call in calls] == [{"force"}, {"fail"}]
