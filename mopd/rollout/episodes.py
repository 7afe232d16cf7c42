"""Tasks in, verified rollouts out: the loop that teacher RL, MOPD and the benchmarks share.

A task is rendered in the model's chat format (`mopd.envs.chat.chat_format`: our markup for the
models the pipeline grows, the model's own chat template for any other), the engine samples token ids, the domain's
verifier judges the decoded answer, and the effort protocol shapes the reward. Multi-turn
(agent) tasks alternate engine turns with environment observations; observation tokens are
appended to the context with loss mask 0 and log-prob 0, so no loss ever learns from them; so are the tokens budget
forcing appends to a turn whose thinking hit its budget unclosed (`mopd.rollout.forcing`, an effort's `on_budget`).
Token ids travel untouched: what the trainer sees is exactly what the engine sampled.
An environment with `step_many` / `verify_many` gets each turn's episodes as one batch (the code
sandbox runs them in parallel); others are stepped and verified one by one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mopd.envs.base import Task, Verdict, split_thinking
from mopd.envs.chat import ChatFormat, chat_format
from mopd.envs.effort import EffortSpec, shape_reward
from mopd.rollout.forcing import forced_mask, sample_turns
from mopd.rollout.interface import RolloutEngine, Sampling


@dataclass
class Rollout:
    task: Task
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # everything after the prompt
    logprobs: list[float] = field(default_factory=list)  # rollout log-probs; 0 on observation tokens
    loss_mask: list[int] = field(default_factory=list)  # 1 on tokens the policy generated
    forced: list[int] = field(default_factory=list)  # 1 on tokens budget forcing appended (loss mask 0, log-prob 0)
    policy_version: int = -1
    turns: list[dict[str, str]] = field(default_factory=list)  # assistant / observation texts
    turn_ids: list[list[int]] = field(default_factory=list)  # each assistant turn's ids (forced ones too)
    turn_forced: list[bool] = field(default_factory=list)  # each assistant turn: closed by budget forcing
    verdict: Verdict | None = None
    reward: float = 0.0  # shaped by the effort protocol
    thinking_tokens: int = 0  # the longest turn's thinking (the budget holds per turn)
    answer_tokens: int = 0
    closed_think: bool = False
    over_budget: bool = False
    truncated: bool = False  # a turn hit its token limit, or the episode's next turn did not fit the engine

    @property
    def completion(self) -> str:
        """The final assistant turn's text (what single-turn verifiers judge)."""
        return next((t["content"] for t in reversed(self.turns) if t["role"] == "assistant"), "")


def run_rollouts(
    engine: RolloutEngine,
    tokenizer: Any,
    envs: Mapping[str, Any],
    tasks: list[Task],
    efforts: Mapping[str, EffortSpec],
    n: int = 1,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int | None = None,
    max_turns: int = 32,  # a safety cap; multi-turn envs end episodes at their own turn limit
) -> list[list[Rollout]]:
    """n rollouts per task, verified and shaped; multi-turn envs (with `step`) take several turns."""
    chat = chat_format(tokenizer)
    rollouts = [
        [Rollout(task, chat.prompt_ids(task, efforts[task.effort].budget_tokens)) for _ in range(n)]
        for task in tasks
    ]
    flat = [r for group in rollouts for r in group]
    states = {id(r): envs[r.task.domain].reset(r.task) for r in flat if is_multi_turn(envs[r.task.domain])}
    active, room = flat, Room(efforts, getattr(engine, "max_model_len", None))
    for turn in range(max_turns):
        sampling = Sampling(
            temperature=temperature,
            top_p=top_p,
            max_tokens=[efforts[r.task.effort].max_new_tokens for r in active],
            stop_token_ids=chat.stop_ids,
            seed=None if seed is None else seed + turn * 1_000_003,  # the engine adds the request index
        )
        contexts, specs = [r.prompt_ids + r.token_ids for r in active], [efforts[r.task.effort] for r in active]
        for rollout, sample in zip(active, sample_turns(engine, contexts, specs, chat, sampling), strict=True):
            append_assistant_turn(rollout, sample, chat)
        active = observe([r for r in active if id(r) in states], envs, states, chat, room)
        if not active:
            break
    for env, batch in by_domain(flat, envs):
        verdicts = verify_all(env, [r.task for r in batch], [states.get(id(r), r.completion) for r in batch])
        for rollout, verdict in zip(batch, verdicts, strict=True):
            judge(rollout, verdict, efforts[rollout.task.effort], chat)
    return rollouts


def is_multi_turn(env: Any) -> bool:
    return callable(getattr(env, "step", None))


def append_assistant_turn(rollout: Rollout, sample: Any, chat: ChatFormat) -> None:
    forced = forced_mask(sample)
    rollout.token_ids += sample.token_ids
    rollout.logprobs += sample.logprobs
    rollout.loss_mask += [1 - f for f in forced]
    rollout.forced += forced
    rollout.turn_forced.append(any(forced))
    rollout.policy_version = sample.policy_version
    rollout.truncated |= sample.finish_reason == "length"
    text = chat.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
    rollout.turns.append({"role": "assistant", "content": text})
    rollout.turn_ids.append(list(sample.token_ids))


def by_domain(rollouts: list[Rollout], envs: Mapping[str, Any]) -> list[tuple[Any, list[Rollout]]]:
    domains = dict.fromkeys(r.task.domain for r in rollouts)
    return [(envs[domain], [r for r in rollouts if r.task.domain == domain]) for domain in domains]


def observe(
    rollouts: list[Rollout], envs: Mapping[str, Any], states: dict[int, Any], chat: ChatFormat, room: Room
) -> list[Rollout]:
    """Let the environments act on the last assistant turns; return the rollouts whose episodes go on.

    A turn cut at its token limit ends the episode; so does an observation after which a whole next turn would
    not fit the engine (truncated, the observation left out, verified as it stands). Each domain steps its
    rollouts as one batch.
    """
    going = set()
    for env, batch in by_domain([r for r in rollouts if not r.truncated], envs):
        outcomes = step_all(env, [states[id(r)] for r in batch], [r.turns[-1]["content"] for r in batch])
        for rollout, (observation, done) in zip(batch, outcomes, strict=True):
            if done or observation is None:
                continue
            role = rollout.task.meta.get("observation_role", "observation")  # an agent scaffold's (mopd.envs.agent.scaffolds)
            ids = chat.observation_ids(observation, rollout.task.effort, role)
            if room.for_next_turn(rollout, len(ids)):
                append_observation(rollout, observation, ids, role)
                going.add(id(rollout))
            else:
                rollout.truncated = True
    return [r for r in rollouts if id(r) in going]


@dataclass
class Room:
    """Whether an episode's next turn fits the engine's `max_model_len` (None: the engine does not say; no limit)."""

    efforts: Mapping[str, EffortSpec]
    max_model_len: int | None

    def for_next_turn(self, rollout: Rollout, observation_tokens: int) -> bool:
        if self.max_model_len is None:
            return True
        context = len(rollout.prompt_ids) + len(rollout.token_ids) + observation_tokens
        return context + self.efforts[rollout.task.effort].max_new_tokens <= self.max_model_len


def step_all(env: Any, states: list[Any], texts: list[str]) -> list[tuple[str | None, bool]]:
    if callable(getattr(env, "step_many", None)):
        return env.step_many(states, texts)
    return [env.step(state, text) for state, text in zip(states, texts, strict=True)]


def verify_all(env: Any, tasks: list[Task], attempts: list[Any]) -> list[Verdict]:
    if callable(getattr(env, "verify_many", None)):
        return env.verify_many(tasks, attempts)
    return [env.verify(task, attempt) for task, attempt in zip(tasks, attempts, strict=True)]


def append_observation(rollout: Rollout, observation: str, ids: list[int], role: str = "observation") -> None:
    rollout.token_ids += ids
    rollout.logprobs += [0.0] * len(ids)
    rollout.loss_mask += [0] * len(ids)
    rollout.forced += [0] * len(ids)
    rollout.turns.append({"role": role, "content": observation})


def judge(rollout: Rollout, verdict: Verdict, spec: EffortSpec, chat: ChatFormat) -> None:
    rollout.verdict = verdict
    rollout.closed_think = all(split_thinking(t["content"]) is not None for t in rollout.turns if t["role"] == "assistant")
    counts = [chat.count_tokens(ids) for ids in rollout.turn_ids]
    # the engine cut a forced turn's thinking at the budget; what it counts past it is the forced cue's or retokenizing's
    thinking = [min(t, spec.budget_tokens) if forced else t for (t, _), forced in zip(counts, rollout.turn_forced, strict=True)]
    rollout.thinking_tokens = max(thinking)
    rollout.answer_tokens = sum(answer for _, answer in counts)
    rollout.over_budget = rollout.thinking_tokens > spec.budget_tokens
    rollout.reward = shape_reward(rollout.verdict, rollout.thinking_tokens if rollout.closed_think else None, spec)
