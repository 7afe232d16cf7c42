"""The chat template (text, Jinja twin, loss masks), the effort protocol (budgets, shaping) and the
splits every env keeps: train, dev and test share no content under the recipes' own env options."""

import dataclasses
import itertools
import re

import pytest
from jinja2 import TemplateError

from mopd.envs import get_env
from mopd.envs.agent import database_key
from mopd.envs.base import DOMAINS, EFFORTS, Verdict, split_thinking
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
from mopd.envs.code import function_from_meta
from mopd.envs.effort import EffortSpec, default_effort_specs, effort_spec, shape_reward, thinking_tokens
from mopd.envs.general import OWN_FAMILIES, GeneralEnv, add_trace, task_key
from mopd.envs.splits import SPLITS, content_hash, normalize, split_of
from mopd.envs.tokenizer import build_tokenizer, task_corpus
from mopd.recipe import ROOT, RecipeError, load_recipe

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
    trained = tokenizer.decode([i for i, m in zip(input_ids, loss_mask, strict=True) if m])
    assert trained == AGENT_TURNS[0]["content"] + END + AGENT_TURNS[2]["content"] + END
    observation = tokenizer.convert_tokens_to_ids(OBSERVATION)
    assert loss_mask[input_ids.index(observation)] == 0
    assert "[(1,)]" not in trained and "Find Y." not in trained


def test_template_rejects_bad_turns_and_efforts(tokenizer):
    for bad, reason in (({}, "effort is missing"), ({"effort": "medium"}, 'effort "medium" is not one of')):
        with pytest.raises(TemplateError, match=re.escape(reason) + ".*" + re.escape("pass effort=low|high|max")):
            tokenizer.apply_chat_template(messages_for("x"), tokenize=False, add_generation_prompt=True, **bad)
    with pytest.raises(TemplateError, match="effort is missing"):
        tokenizer.apply_chat_template(messages_for("x", [{"role": "assistant", "content": "y"}]), tokenize=False)
    # no assistant header, no effort needed (vLLM's server warms its template up on such a message)
    assert tokenizer.apply_chat_template(messages_for("x"), tokenize=False) == "<|bos|><|user|>x<|end|>"
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
    tasks = env.sample(60, seed=0, split="dev")
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


# ------------------------------------------------------------------------------------ splits
DRAWS = {"general": {"train": 1500, "dev": 150, "test": 150}, "code": {"train": 300, "dev": 60, "test": 60},
         "agent": {"train": 60, "dev": 20, "test": 20}}
# Measured: at the tiny recipe's difficulty 1, list_reduce has 13 functions, 11 train, 2 test, none dev.
EMPTY_SPLITS = {("tiny", "code", "dev"): "list_reduce"}


@pytest.fixture(scope="module", params=["tiny", "smoke"])
def recipe(request):
    return load_recipe(ROOT / "recipes" / f"{request.param}.yaml")


def recomputed_key(task) -> str:
    """The key from what decides the task: question and answer, the function, the database."""
    if task.domain == "general":
        return task_key(task.prompt, task.meta["answer"])
    if task.domain == "code":
        return content_hash(function_from_meta(task.meta).source)
    return database_key(task.meta["db"])


def task_content(task) -> tuple[str, ...]:
    """The task as the model sees it; an agent question is asked of its own database."""
    prompt = normalize(task.prompt)
    return (prompt, task.meta["content_hash"]) if task.domain == "agent" else (prompt,)


@pytest.mark.parametrize("domain", DOMAINS)
def test_the_recipes_train_dev_and_test_draws_share_no_content(recipe, domain):
    env = get_env(domain, **recipe.env_options(domain))
    drawn = {}
    for split in SPLITS:
        empty = EMPTY_SPLITS.get((recipe.name, domain, split))
        if empty:
            with pytest.raises(ValueError, match=f"code/{empty}: .* too few distinct {split} functions"):
                env.sample(len(env.families), 1001, split)
            env = get_env(domain, **{**recipe.env_options(domain), "families": [f for f in env.families if f != empty]})
        drawn[split] = env.sample(DRAWS[domain][split], 1001, split)
        assert all(recomputed_key(t) == t.meta["content_hash"] and split_of(t.meta["content_hash"]) == split
                   for t in drawn[split])
    keys = {split: {t.meta["content_hash"] for t in tasks} for split, tasks in drawn.items()}
    contents = {split: {task_content(t) for t in tasks} for split, tasks in drawn.items()}
    for one, other in itertools.combinations(SPLITS, 2):
        assert not keys[one] & keys[other] and not contents[one] & contents[other], (one, other)
    assert all(len(keys[split]) > 1 for split in SPLITS)


@pytest.mark.parametrize("domain", DOMAINS)
def test_no_env_takes_an_eval_split_or_the_disjoint_eval_switch(domain):
    with pytest.raises(ValueError, match=r"split='eval': must be one of \['train', 'dev', 'test'\]"):
        get_env(domain).sample(1, seed=0, split="eval")
    with pytest.raises(ValueError, match=f"envs.{domain}.disjoint_eval: removed"):
        get_env(domain, disjoint_eval=False)
    with pytest.raises(RecipeError, match=f"smoke.yaml: field `envs`.*envs.{domain}.disjoint_eval: removed"):
        load_recipe(ROOT / "recipes" / "smoke.yaml", [f"envs.{domain}.disjoint_eval=false"])
