"""The rollout engine as a Ray actor: the same interface, called with `.remote(...)` and `ray.get`.

    engine = rollout_actor(model_dir, backend="vllm")
    samples = ray.get(engine.generate.remote(prompt_ids, 4, Sampling(max_tokens=256)))
    ray.get(engine.update_weights.remote(state_dict))

`RemoteEngine` wraps such an actor as a local `RolloutEngine`: the caller's code is unchanged, and a
thread blocked on the actor's generation holds no core of this process (MOPD's one-step-off sampler).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch

from mopd.rollout.engine import create_engine
from mopd.rollout.interface import DEFAULT_SAMPLING, Sample, Sampling


class EngineActor:
    def __init__(self, model_dir: str | Path, backend: str = "vllm", **engine_kwargs):
        self.engine = create_engine(model_dir, backend, **engine_kwargs)

    def generate(self, prompt_ids: list[list[int]], n: int = 1, sampling: Sampling = DEFAULT_SAMPLING) -> list[list[Sample]]:
        return self.engine.generate(prompt_ids, n, sampling)

    def score(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[list[float]]:
        return self.engine.score(prompt_ids, completion_ids)

    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> int:
        return self.engine.update_weights(state_dict)

    def policy_version(self) -> int:
        return self.engine.policy_version

    def max_model_len(self) -> int | None:
        return getattr(self.engine, "max_model_len", None)

    def describe(self) -> dict:
        """Where and how this engine runs (benchmarks check it): process, CPUs, torch threads, dtype."""
        llm = getattr(self.engine, "llm", None)
        dtype = llm.llm_engine.model_config.dtype if llm is not None else next(self.engine.model.parameters()).dtype
        return {"pid": os.getpid(), "cpus": sorted(os.sched_getaffinity(0)), "torch_threads": torch.get_num_threads(),
                "dtype": str(dtype).removeprefix("torch.")}  # fmt: skip

    def close(self) -> None:
        self.engine.close()


def rollout_actor(model_dir: str | Path, backend: str = "vllm", num_cpus: float = 1, **engine_kwargs):
    """Start an engine in a Ray actor (Ray must be initialised) and return the actor handle."""
    import ray

    return ray.remote(num_cpus=num_cpus)(EngineActor).remote(str(model_dir), backend, **engine_kwargs)


class RemoteEngine:
    """A `RolloutEngine` whose engine runs in a Ray actor (`rollout_actor`): generation and scoring happen in
    that process; weights travel to it through Ray's object store."""

    def __init__(self, actor):
        import ray

        self.actor, self._ray = actor, ray
        self.policy_version, self.max_model_len = ray.get([actor.policy_version.remote(), actor.max_model_len.remote()])

    def generate(self, prompt_ids: list[list[int]], n: int = 1, sampling: Sampling = DEFAULT_SAMPLING) -> list[list[Sample]]:
        return self._ray.get(self.actor.generate.remote(prompt_ids, n, sampling))

    def score(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[list[float]]:
        return self._ray.get(self.actor.score.remote(prompt_ids, completion_ids))

    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> int:
        weights = {name: tensor.detach().cpu() for name, tensor in state_dict.items()}
        self.policy_version = self._ray.get(self.actor.update_weights.remote(weights))
        return self.policy_version

    def close(self) -> None:
        try:
            self._ray.get(self.actor.close.remote())
        finally:
            self._ray.kill(self.actor)
