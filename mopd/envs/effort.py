"""The effort protocol: a thinking budget per effort level and the reward shaping of teacher RL.

Budgets count tokens of the thinking text between `<think>` and `</think>`. The tiny defaults
(low 16, high 96, max 384) are chosen with the tiny tokenizer, which splits digits one by one:
the hardest default general instances (6-digit sums, 4-digit × 1-digit products, 6-term chains)
need 31–69 thinking tokens for their trace (the same lines at high and max), so it fits the high
and max budgets and never the low one; at low effort the model must answer without a scratchpad.
(Which work the expert writes at high is the environment's choice: the general domain leaves
chains longer than `high_chain_terms` to max.) `python -m benchmarks.effort_protocol --out FILE.json` measures this for every domain.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mopd.envs.base import EFFORTS, Verdict, split_thinking

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class EffortSpec(BaseModel):
    """Thinking budget and reward shaping of one effort level (a recipe field)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    budget_tokens: int = Field(gt=0, description="thinking tokens allowed inside <think>…</think>")
    answer_tokens: int = Field(64, gt=0, description="tokens allowed after </think>")
    length_penalty: float = Field(0.0, ge=0.0, le=1.0, description="reward × (1 − penalty × thinking/budget)")
    on_budget: Literal["force", "fail"] = Field(
        "fail", description="a turn whose thinking reaches the budget unclosed: force = the engine closes it and the "
        "model answers within answer_tokens (`mopd.rollout.forcing`); fail = it thinks on and is over budget"
    )

    @property
    def max_new_tokens(self) -> int:
        """Generation limit for one assistant turn: the think tags, the budget and the answer."""
        return self.budget_tokens + self.answer_tokens + 2


def hashed_effort(spec: EffortSpec, samples: bool = True) -> dict[str, Any]:
    """A spec's fields for a stage hash: every field stages hashed before `on_budget` existed, and `on_budget` only
    where it forces and the stage `samples`, so the default keeps finished stages and a stage that never samples
    (the base's SFT) ignores it."""
    return spec.model_dump(exclude=None if samples and spec.on_budget == "force" else {"on_budget"})


def default_effort_specs() -> dict[str, EffortSpec]:
    return {
        "low": EffortSpec(budget_tokens=16, length_penalty=0.1),
        "high": EffortSpec(budget_tokens=96),
        "max": EffortSpec(budget_tokens=384),
    }


def effort_spec(effort: str, specs: dict[str, EffortSpec] | None = None) -> EffortSpec:
    specs = specs if specs is not None else default_effort_specs()
    if effort not in specs:
        raise ValueError(
            f"effort {effort!r} has no spec; known: {sorted(specs)} (efforts are {list(EFFORTS)})"
        )
    return specs[effort]


def thinking_tokens(completion: str, tokenizer: PreTrainedTokenizerBase) -> int | None:
    """Tokens inside the think block of a completion; None when the block is not closed."""
    parts = split_thinking(completion)
    if parts is None:
        return None
    return len(tokenizer.encode(parts[0], add_special_tokens=False))


def shape_reward(verdict: Verdict, thinking_tokens: int | None, spec: EffortSpec) -> float:
    """Teacher-RL reward: 0 without a closed think block or over budget, else the (penalised) verdict.

    For a multi-turn transcript pass the longest turn's thinking: the budget holds per turn.
    """
    if thinking_tokens is None or thinking_tokens > spec.budget_tokens:
        return 0.0
    return verdict.reward * (1.0 - spec.length_penalty * thinking_tokens / spec.budget_tokens)
