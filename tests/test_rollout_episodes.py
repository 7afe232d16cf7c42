"""The shared rollout loop: single- and multi-turn episodes, masks, verdicts and shaped rewards.

A scripted engine replays the expert's turns through the real interface (token ids in, token
ids out), so the loop, the template, the environments and the verifiers are all exercised.
"""

import pytest

from mopd.envs import get_env
from mopd.envs.chat import END
from mopd.envs.effort import default_effort_specs
from mopd.rollout.episodes import run_rollouts
from mopd.rollout.interface import Sample


class ScriptedEngine:
    """Answers each context with the next scripted assistant turn of its task."""

    policy_version = 3

    def __init__(self, tokenizer, scripts):
        self.tokenizer, self.scripts, self.calls, self.contexts = tokenizer, scripts, [], []

    def generate(self, prompt_ids, n=1, sampling=None):
        self.calls.append(sampling)
        self.contexts.append([len(ids) for ids in prompt_ids])
        out = []
        for ids in prompt_ids:
            text = self.tokenizer.decode(ids)
            key = next(k for k in self.scripts if k in text)
            turn = text.count("<|observation|>")
            tokens = self.tokenizer.encode(self.scripts[key][turn] + END, add_special_tokens=False)
            out.append([Sample(tokens, [-0.5] * len(tokens), "stop", self.policy_version)])
        return out


def expert_turns(env, task):
    """The expert's assistant turns (one for single-turn domains)."""
    solution = env.solve(task)
    if isinstance(solution, str):
        return [solution]
    return [turn["content"] for turn in solution if turn["role"] == "assistant"]


@pytest.mark.parametrize("domain", ["general", "code", "agent"])
def test_expert_rollouts_earn_full_reward_through_the_loop(domain, tiny_tokenizer):
    env = get_env(domain)
    tasks = env.sample(3, seed=5, split="dev", effort="high")
    scripts = {task.prompt: expert_turns(env, task) for task in tasks}
    engine = ScriptedEngine(tiny_tokenizer, scripts)
    groups = run_rollouts(engine, tiny_tokenizer, {domain: env}, tasks, default_effort_specs(), n=2)
    assert [len(g) for g in groups] == [2, 2, 2]
    for group in groups:
        for rollout in group:
            assert rollout.verdict.reward == 1.0 and rollout.reward == 1.0, rollout.verdict.details
            assert rollout.closed_think and not rollout.over_budget and rollout.policy_version == 3
            assert len(rollout.token_ids) == len(rollout.logprobs) == len(rollout.loss_mask)


def test_agent_observations_are_masked_and_carry_no_logprobs(tiny_tokenizer):
    env = get_env("agent")
    task = env.sample(1, seed=1, split="train", effort="max")[0]
    turns = expert_turns(env, task)
    engine = ScriptedEngine(tiny_tokenizer, {task.prompt: turns})
    (rollout,) = run_rollouts(engine, tiny_tokenizer, {"agent": env}, [task], default_effort_specs())[0]
    assert len(engine.calls) == len(turns) >= 2
    roles = [t["role"] for t in rollout.turns]
    assert roles.count("observation") == len(turns) - 1
    generated = [tok for tok, m in zip(rollout.token_ids, rollout.loss_mask, strict=True) if m]
    expected = [tok for t in turns for tok in tiny_tokenizer.encode(t + END, add_special_tokens=False)]
    assert generated == expected  # exactly the engine's tokens are trainable, nothing else
    assert all(lp == 0.0 for lp, m in zip(rollout.logprobs, rollout.loss_mask, strict=True) if not m)
    observed = tiny_tokenizer.decode([tok for tok, m in zip(rollout.token_ids, rollout.loss_mask, strict=True) if not m])
    assert rollout.turns[1]["content"] in observed


def test_an_episode_whose_next_turn_cannot_fit_the_engine_ends_truncated_and_is_verified(tiny_tokenizer):
    """The engine's `max_model_len` bounds an agent episode: a second turn goes ahead when context + a whole max-effort
    turn fits, and otherwise the episode ends after its first turn, truncated, with a verdict (no error mid-stage) and
    without the observation that left no room."""
    env = get_env("agent")
    task = env.sample(1, seed=1, split="train", effort="max")[0]
    efforts = default_effort_specs()
    unbounded = ScriptedEngine(tiny_tokenizer, {task.prompt: expert_turns(env, task)})
    run_rollouts(unbounded, tiny_tokenizer, {"agent": env}, [task], efforts)
    second_context = unbounded.contexts[1][0]
    room = second_context + efforts["max"].max_new_tokens
    for max_model_len, calls in ((room, len(unbounded.calls)), (room - 1, 1)):
        engine = ScriptedEngine(tiny_tokenizer, {task.prompt: expert_turns(env, task)})
        engine.max_model_len = max_model_len
        (rollout,) = run_rollouts(engine, tiny_tokenizer, {"agent": env}, [task], efforts)[0]
        assert len(engine.calls) == calls
        assert rollout.truncated == (calls == 1) and rollout.verdict is not None
    assert [t["role"] for t in rollout.turns] == ["assistant"]  # the observation that left no room is not kept
    assert len(rollout.token_ids) == len(tiny_tokenizer.encode(rollout.turns[0]["content"] + END, add_special_tokens=False))
    assert rollout.reward < 1.0  # one turn of the expert's several does not finish the task


def test_budgets_and_shaping_follow_the_effort_protocol(tiny_tokenizer):
    env = get_env("general")
    task = env.sample(1, seed=0, split="dev", effort="low")[0]
    answer = task.meta["answer"]
    long_thought = "<think>" + " 1 + 1 = 2." * 40 + f"</think>{answer}"
    scripts = {task.prompt: [long_thought]}
    specs = default_effort_specs()
    engine = ScriptedEngine(tiny_tokenizer, scripts)
    (rollout,) = run_rollouts(engine, tiny_tokenizer, {"general": env}, [task], specs)[0]
    assert engine.calls[0].max_tokens == [specs["low"].max_new_tokens]
    assert rollout.verdict.reward == 1.0 and rollout.over_budget and rollout.reward == 0.0
    engine = ScriptedEngine(tiny_tokenizer, {task.prompt: [f"no think block {answer}"]})
    (rollout,) = run_rollouts(engine, tiny_tokenizer, {"general": env}, [task], specs)[0]
    assert not rollout.closed_think and rollout.reward == 0.0


def test_token_counts_come_from_the_sampled_ids(tiny_tokenizer):
    from mopd.envs.chat import NativeChat, chat_format

    count_tokens = chat_format(tiny_tokenizer).count_tokens
    assert isinstance(chat_format(tiny_tokenizer), NativeChat)
    think, close, end, digit = tiny_tokenizer.convert_tokens_to_ids(["<think>", "</think>", END, "7"])
    assert count_tokens([think, digit, digit, close, digit, end]) == (2, 1)
    assert count_tokens([digit, close, end]) == (1, 0)  # the prompt may open <think>
    assert count_tokens([think, digit, digit, digit]) == (3, 0)  # never closed: all thinking


def test_code_attempts_run_the_examples_between_turns(tiny_tokenizer):
    """Above low effort a failed attempt gets the examples' result as an observation, and the
    hidden tests judge the last attempt."""
    env = get_env("code", families=["arith"], n_examples=1)
    task = env.sample(1, seed=2, split="dev", effort="high")[0]
    right = env.solve(task)
    wrong = right.replace("return y", "return y + 1")
    engine = ScriptedEngine(tiny_tokenizer, {task.prompt: [wrong, right]})
    (rollout,) = run_rollouts(engine, tiny_tokenizer, {"code": env}, [task], default_effort_specs())[0]
    assert [t["role"] for t in rollout.turns] == ["assistant", "observation", "assistant"]
    assert "returned" in rollout.turns[1]["content"] and rollout.verdict.reward == 1.0
    observed = tiny_tokenizer.decode([tok for tok, m in zip(rollout.token_ids, rollout.loss_mask, strict=True) if not m])
    assert rollout.turns[1]["content"] in observed
    engine = ScriptedEngine(tiny_tokenizer, {task.prompt: [wrong, wrong]})
    (rollout,) = run_rollouts(engine, tiny_tokenizer, {"code": env}, [task], default_effort_specs())[0]
    assert len(engine.calls) == 2 and rollout.verdict.reward == 0.0
