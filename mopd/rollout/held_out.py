"""Checkpoints answering held-out tasks: the scoring that teacher evaluation (`mopd.rl.evaluate`),
pair mode's eval and `mopd bench` each do.

    TaskScorer(backend).rollouts(checkpoint, envs, tasks, efforts, n=, temperature=, seed=)
                             each task's n verified, shaped rollouts by the checkpoint (`run_rollouts`),
                             in task order; one engine at a time (`EngineCache`: a checkpoint of the
                             loaded one's architecture is swapped in), each checkpoint's own tokenizer
    task_rewards(groups)     each task's mean shaped reward, in task order: what a paired comparison pairs
    reward_summary(groups)   the mean shaped reward, pass rate, token counts and over-budget rate of all rollouts
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from statistics import fmean
from typing import Any

from mopd.envs.base import Task
from mopd.envs.effort import EffortSpec
from mopd.rollout.engine_cache import EngineCache
from mopd.rollout.episodes import Rollout, run_rollouts


class TaskScorer:
    """Checkpoints answering task lists through one engine; `close` (or leaving a `with`) shuts it down."""

    def __init__(self, backend: str, **engine_kwargs):
        self.engines, self.tokenizers = EngineCache(backend, **engine_kwargs), {}

    def rollouts(
        self, checkpoint: str | Path, envs: Mapping[str, Any], tasks: list[Task], efforts: Mapping[str, EffortSpec],
        *, n: int = 1, temperature: float = 1.0, seed: int | None = None,
    ) -> list[list[Rollout]]:  # fmt: skip
        """Each task's `n` rollouts by `checkpoint`, sampled at `temperature` from `seed` (`run_rollouts`)."""
        return run_rollouts(
            self.engine(Path(checkpoint)), self.tokenizer(Path(checkpoint)), envs, tasks, efforts,
            n=n, temperature=temperature, seed=seed,
        )  # fmt: skip

    def engine(self, checkpoint: Path):
        """The engine serving `checkpoint`: the loaded one with `checkpoint`'s weights read in (again, if it was
        the last one: a caller that asks afresh gets the checkpoint's weights as they are on disk), or a new one."""
        return self.engines.load(Path(checkpoint))

    def tokenizer(self, checkpoint: Path):
        from transformers import AutoTokenizer

        if checkpoint not in self.tokenizers:
            self.tokenizers[checkpoint] = AutoTokenizer.from_pretrained(checkpoint)
        return self.tokenizers[checkpoint]

    def close(self) -> None:
        if self.engines.engine is not None:
            self.engines.engine.close()
        self.engines.engine = None

    def __enter__(self) -> TaskScorer:
        return self

    def __exit__(self, *_) -> None:
        self.close()


def task_rewards(groups: list[list[Rollout]]) -> list[float]:
    return [fmean(r.reward for r in group) for group in groups]


def reward_summary(groups: list[list[Rollout]]) -> dict[str, float]:
    flat = [r for group in groups for r in group]
    return {
        "reward": fmean(r.reward for r in flat),
        "pass_rate": fmean(r.verdict.passed for r in flat),
        "thinking_tokens": fmean(r.thinking_tokens for r in flat),
        "answer_tokens": fmean(r.answer_tokens for r in flat),
        "over_budget_rate": fmean(r.over_budget for r in flat),
        "rollouts": len(flat),
    }
