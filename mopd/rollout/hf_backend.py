"""The HF transformers rollout backend: same interface as the vLLM one; the benchmark baseline and the
fallback where vLLM is not installed.

Prompts are batched by length, so no batch ever needs padding (the KDA state must not see pad tokens).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

import torch

from mopd.model.config import read_model_config
from mopd.rollout.interface import (
    DEFAULT_SAMPLING,
    Sample,
    Sampling,
    check_prompt_lengths,
    check_score_inputs,
)


class HFEngine:
    def __init__(self, model_dir: str | Path, max_model_len: int = 2048, dtype: str = "float32", **_):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.config = read_model_config(model_dir)
        self.max_model_len = max_model_len
        self.policy_version = 0
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        has_tokenizer = (Path(model_dir) / "tokenizer_config.json").is_file()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir) if has_tokenizer else None

    @torch.inference_mode()
    def generate(
        self, prompt_ids: list[list[int]], n: int = 1, sampling: Sampling = DEFAULT_SAMPLING
    ) -> list[list[Sample]]:
        budgets = sampling.max_tokens_for(len(prompt_ids))
        check_prompt_lengths(prompt_ids, budgets, self.max_model_len)
        if sampling.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer in the checkpoint directory; use stop_token_ids")
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        samples: list[list[Sample]] = [[] for _ in prompt_ids]
        for indices in _same_length_groups(prompt_ids):
            rows = [i for i in indices for _ in range(n)]
            tokens, logprobs = self._sample_batch([prompt_ids[i] for i in rows], max(budgets[i] for i in rows), sampling)
            for row, i in enumerate(rows):
                samples[i].append(self._finish(tokens[row], logprobs[row], budgets[i], sampling))
        return samples

    @torch.inference_mode()
    def score(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[list[float]]:
        check_score_inputs(prompt_ids, completion_ids)
        full = [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids, strict=True)]
        check_prompt_lengths(full, [0] * len(full), self.max_model_len)
        scores: list[list[float]] = [[] for _ in full]
        for indices in _same_length_groups(full):
            batch = torch.tensor([full[i] for i in indices])
            logits = self.model(input_ids=batch, use_cache=False).logits.float()
            token_logprobs = logits[:, :-1].log_softmax(-1).gather(-1, batch[:, 1:, None]).squeeze(-1)
            for row, i in enumerate(indices):
                scores[i] = token_logprobs[row, -len(completion_ids[i]) :].tolist()
        return scores

    def prompt_logprobs(self, prompt_ids: list[list[int]]) -> list[list[float]]:
        return self.score([p[:1] for p in prompt_ids], [p[1:] for p in prompt_ids])

    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> int:
        result = self.model.load_state_dict(dict(state_dict), strict=False)
        if result.unexpected_keys:
            raise KeyError(f"update_weights: unknown parameter names {result.unexpected_keys[:5]}")
        self.policy_version += 1
        return self.policy_version

    def close(self) -> None:
        """Nothing to shut down: the model is freed with the engine."""

    def _sample_batch(self, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling):
        batch = torch.tensor(prompts)
        greedy = sampling.temperature == 0
        out = self.model.generate(
            input_ids=batch,
            attention_mask=torch.ones_like(batch),
            max_new_tokens=max_new_tokens,
            do_sample=not greedy,
            temperature=None if greedy else sampling.temperature,
            top_p=None if greedy else sampling.top_p,
            top_k=None,
            eos_token_id=None if sampling.ignore_eos else self._stop_ids(sampling),
            stop_strings=list(sampling.stop) or None,
            tokenizer=self.tokenizer,
            pad_token_id=self.config.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        new_tokens = out.sequences[:, batch.shape[1] :]
        logits = torch.stack(out.logits, dim=1).float()
        logprobs = logits.log_softmax(-1).gather(-1, new_tokens[..., None]).squeeze(-1)
        return new_tokens.tolist(), logprobs.tolist()

    def _finish(self, tokens: list[int], logprobs: list[float], budget: int, sampling: Sampling) -> Sample:
        """Cut one generated row where vLLM would have stopped it: budget, stop token, stop string."""
        tokens, logprobs, reason = tokens[:budget], logprobs[:budget], "length"
        stop_ids = set() if sampling.ignore_eos else set(self._stop_ids(sampling))
        for k, token in enumerate(tokens):
            if token in stop_ids or self._ends_in_stop_string(tokens[: k + 1], sampling.stop):
                tokens, logprobs, reason = tokens[: k + 1], logprobs[: k + 1], "stop"
                break
        return Sample(tokens, logprobs, reason, self.policy_version)

    def _ends_in_stop_string(self, tokens: list[int], stop: tuple[str, ...] | list[str]) -> bool:
        return bool(stop) and any(s in self.tokenizer.decode(tokens) for s in stop)

    def _stop_ids(self, sampling: Sampling) -> list[int]:
        eos = self.config.eos_token_id
        eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        return [*sampling.stop_token_ids, *eos_ids]


def _same_length_groups(sequences: list[list[int]]) -> list[list[int]]:
    groups: dict[int, list[int]] = defaultdict(list)
    for i, seq in enumerate(sequences):
        groups[len(seq)].append(i)
    return list(groups.values())
