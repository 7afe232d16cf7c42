"""Budget forcing: a turn whose thinking reaches its effort's budget without `</think>` is closed by the engine.

For an effort with `on_budget: force` one assistant turn is sampled in two engine calls, each one batch:

    1. every turn, up to its thinking limit (the opening tag and the budget);
    2. the turns cut there: one whose thinking is still open gets the chat format's `forced_close` appended
       (`</think>`, after a short cue for a model without effort tokens) and writes its answer in `answer_tokens`;
       one that closed its thinking itself goes on to the end of its turn, within the turn's usual limit.

Forced tokens are the engine's, not the model's: a sample's `forced` mask marks them and they carry log-prob 0, so
the rollout's loss mask leaves them out of every loss. Turns of efforts that fail are sampled in the first call
with their whole turn limit, exactly as without forcing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from mopd.envs.base import THINK_OPEN, split_thinking
from mopd.envs.chat import ChatFormat
from mopd.envs.effort import EffortSpec
from mopd.rollout.interface import RolloutEngine, Sample, Sampling

SECOND_CALL_SEED = 500_009  # the second call's seeds start here, apart from the first call's seed + request index


def sample_turns(
    engine: RolloutEngine, contexts: list[list[int]], specs: Sequence[EffortSpec], chat: ChatFormat, sampling: Sampling
) -> list[Sample]:
    """One assistant turn per context under its effort's spec; `sampling.max_tokens` holds each turn's whole limit."""
    limits = sampling.max_tokens_for(len(contexts))
    forcing = [spec.on_budget == "force" for spec in specs]
    first = [
        thinking_limit(spec, chat) if force else limit for spec, force, limit in zip(specs, forcing, limits, strict=True)
    ]
    turns = [only(group) for group in engine.generate(contexts, n=1, sampling=replace(sampling, max_tokens=first))]
    going = [i for i, turn in enumerate(turns) if forcing[i] and turn.finish_reason == "length"]
    heads = {i: closed(turns[i], chat) for i in going}
    rests = {i: rest_limit(turns[i], heads[i], specs[i], len(contexts[i]), engine) for i in going}
    going = [i for i in going if rests[i] > 0]
    if not going:
        return turns
    second = replace(sampling, max_tokens=[rests[i] for i in going], seed=second_seed(sampling.seed))
    tails = engine.generate([contexts[i] + heads[i].token_ids for i in going], n=1, sampling=second)
    for i, group in zip(going, tails, strict=True):
        turns[i] = joined(heads[i], only(group))
    return turns


def thinking_limit(spec: EffortSpec, chat: ChatFormat) -> int:
    return len(chat.encode(THINK_OPEN)) + spec.budget_tokens


def closed(turn: Sample, chat: ChatFormat) -> Sample:
    """The turn as the second call continues it: with the forced close appended where its thinking is open."""
    if split_thinking(chat.tokenizer.decode(turn.token_ids, skip_special_tokens=True)) is not None:
        return turn
    close = chat.encode(chat.forced_close)
    return replace(
        turn,
        token_ids=turn.token_ids + close,
        logprobs=turn.logprobs + [0.0] * len(close),
        forced=forced_mask(turn) + [1] * len(close),
    )


def rest_limit(turn: Sample, head: Sample, spec: EffortSpec, context: int, engine: RolloutEngine) -> int:
    """Tokens the second call may sample: a forced turn's answer, or what is left of a self-closed turn's limit;
    never past the engine's `max_model_len` (the forced cue can make a turn longer than `spec.max_new_tokens`)."""
    wanted = spec.answer_tokens if any(head.forced) else spec.max_new_tokens - len(turn.token_ids)
    room = getattr(engine, "max_model_len", None)
    return wanted if room is None else min(wanted, room - context - len(head.token_ids))


def joined(head: Sample, tail: Sample) -> Sample:
    return replace(
        head,
        token_ids=head.token_ids + tail.token_ids,
        logprobs=head.logprobs + tail.logprobs,
        forced=forced_mask(head) + [0] * len(tail.token_ids),
        finish_reason=tail.finish_reason,
        policy_version=tail.policy_version,
    )


def forced_mask(sample: Sample) -> list[int]:
    return sample.forced or [0] * len(sample.token_ids)


def second_seed(seed: int | None) -> int | None:
    return None if seed is None else seed + SECOND_CALL_SEED


def only(group: list[Sample]) -> Sample:
    (sample,) = group
    return sample
