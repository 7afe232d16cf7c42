"""The chat template (text, Jinja twin, loss masks) and the effort protocol (budgets, shaping)."""

import dataclasses
import re

import pytest
from jinja2 import TemplateError

from mopd.envs.base import EFFORTS, Verdict, split_thinking
from mopd.envs.chat import (
    CHAT_TEMPLATE,
    END,
    OBSERVATION,
    messages_for,
    render_completion,
    render_prompt,
    render_turns,
    strip_turn_end,
    tokenize_segments,
)
from mopd.envs.effort import EffortSpec, default_effort_specs, effort_spec, shape_reward, thinking_tokens
from mopd.envs.general import OWN_FAMILIES, GeneralEnv, add_trace
from mopd.envs.tokenizer import build_tokenizer, task_corpus

AGENT_TURNS = [
    {"role": "assistant", "content": "<think>look up Y</think><tool_call>SELECT 1</tool_call>"},
    {"role": "observation", "content": "[(1,)]"},
    {"role": "assistant", "content": "<think>done</think>1"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(task_corpus(domains=("general",), tasks_per_cell=100))


def hard_env():
    return GeneralEnv(
        families=list(OWN_FAMILIES),
        add_digits=(6, 6),
        mul_digits=(4, 4),
        chain_terms=(6, 6),
        chain_digits=(3, 3),
        high_chain_terms=6,
    )


# ---------------------------------------------------------------------------------- template
def test_prompt_plus_completion_splits_back_into_thinking_and_answer():
    env = GeneralEnv(families=["add"])
    task = env.sample(1, seed=0, effort="max")[0]
    prompt, completion = render_prompt(task.prompt, "max"), render_completion(env.solve(task))
    assert prompt.endswith("<|assistant|><|effort:max|>") and prompt.startswith("<|bos|><|user|>")
    thinking, answer = split_thinking(completion)
    assert strip_turn_end(answer) == task.meta["answer"]
    assert thinking == add_trace(task.meta["terms"], task.meta["ops"])
    assert env.verify(task, completion).passed


@pytest.mark.parametrize("effort", EFFORTS)
@pytest.mark.parametrize("system", [None, "You answer with a number."])
def test_jinja_template_on_the_tokenizer_renders_exactly_the_same_text(tokenizer, effort, system):
    assert tokenizer.chat_template == CHAT_TEMPLATE
    prompt_only = tokenizer.apply_chat_template(
        messages_for("Compute 2 + 3.", system=system),
        effort=effort,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert prompt_only == render_prompt("Compute 2 + 3.", effort, system)
    for turns, open_turn in ((AGENT_TURNS, False), (AGENT_TURNS[:2], True)):
        rendered = "".join(s.text for s in render_turns("Find Y.", turns, effort, system))
        templated = tokenizer.apply_chat_template(
            messages_for("Find Y.", turns, system),
            effort=effort,
            tokenize=False,
            add_generation_prompt=open_turn,
        )
        assert templated == rendered
        ids = tokenizer.apply_chat_template(
            messages_for("Find Y.", turns, system), effort=effort, add_generation_prompt=open_turn
        )["input_ids"]
        assert ids == tokenize_segments(tokenizer, render_turns("Find Y.", turns, effort, system))[0]


def test_transcript_masks_train_only_on_assistant_tokens(tokenizer):
    segments = render_turns("Find Y.", AGENT_TURNS, "high", system="Use SQL.")
    input_ids, loss_mask = tokenize_segments(tokenizer, segments)
    whole = "".join(s.text for s in segments)
    assert input_ids == tokenizer.encode(whole, add_special_tokens=False)
    trained = tokenizer.decode([i for i, m in zip(input_ids, loss_mask) if m])
    assert trained == AGENT_TURNS[0]["content"] + END + AGENT_TURNS[2]["content"] + END
    observation = tokenizer.convert_tokens_to_ids(OBSERVATION)
    assert loss_mask[input_ids.index(observation)] == 0
    assert "[(1,)]" not in trained and "Find Y." not in trained


def test_template_rejects_bad_turns_and_efforts(tokenizer):
    for bad in ({}, {"effort": "medium"}):
        with pytest.raises(TemplateError, match=re.escape("pass effort=low|high|max")):
            tokenizer.apply_chat_template(messages_for("x"), tokenize=False, **bad)
    with pytest.raises(ValueError, match="effort 'medium'"):
        render_prompt("x", "medium")
    with pytest.raises(ValueError, match="turn 0: role"):
        render_turns("x", [{"role": "user", "content": "again"}], "low")
    with pytest.raises(ValueError, match="turn 1: 'content'"):
        render_turns("x", [AGENT_TURNS[0], {"role": "observation", "content": None}], "low")


# ------------------------------------------------------------------------------------ effort
def test_shape_reward_zeroes_over_budget_and_unclosed_thinking_and_penalises_length_at_low():
    passed, spec = Verdict(1.0), EffortSpec(budget_tokens=10, length_penalty=0.5)
    assert shape_reward(passed, None, spec) == 0.0
    assert shape_reward(passed, 11, spec) == 0.0
    assert shape_reward(passed, 0, spec) == 1.0
    assert shape_reward(passed, 10, spec) == pytest.approx(0.5)
    assert shape_reward(Verdict(0.0), 2, spec) == 0.0
    assert shape_reward(passed, 96, default_effort_specs()["high"]) == 1.0
    assert default_effort_specs()["low"].length_penalty > 0
    with pytest.raises(ValueError, match="effort 'medium'"):
        effort_spec("medium")


def test_thinking_tokens_count_the_think_block_only(tokenizer):
    assert thinking_tokens("<think>1+2+0=3</think>3", tokenizer) == len("1+2+0=3")  # one token per digit/sign
    assert thinking_tokens("<think></think>3", tokenizer) == 0
    assert thinking_tokens("<think>1+2", tokenizer) is None


def test_budgets_fit_hard_traces_at_high_and_max_but_never_at_low(tokenizer):
    specs, env = default_effort_specs(), hard_env()
    tasks = env.sample(60, seed=0, split="eval")
    for effort in ("high", "max"):
        counts = [thinking_tokens(env.solve(dataclasses.replace(t, effort=effort)), tokenizer) for t in tasks]
        print(f"hard-instance {effort} traces: {min(counts)}..{max(counts)} thinking tokens")
        assert min(counts) > specs["low"].budget_tokens
        assert max(counts) <= specs[effort].budget_tokens


def test_expert_is_right_and_within_budget_on_a_thousand_tasks_across_efforts(tokenizer):
    """Right and within budget: the shaped reward is the verdict less only the length penalty
    (low effort thinks a little on short sums, and pays for it)."""
    env, specs = GeneralEnv(), default_effort_specs()
    tasks = [t for effort in EFFORTS for t in env.sample(334, seed=9, effort=effort)][:1000]
    right = []
    for task in tasks:
        completion, spec = env.solve(task), specs[task.effort]
        thinking = thinking_tokens(completion, tokenizer)
        shaped = shape_reward(env.verify(task, completion), thinking, spec)
        right.append(shaped == pytest.approx(1.0 - spec.length_penalty * thinking / spec.budget_tokens))
    rate = sum(right) / len(right)
    print(f"expert right and within budget on 1000 general tasks: {rate:.4f}")
    assert rate >= 0.99
