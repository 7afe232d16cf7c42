"""The rollout engine as a Ray actor: the same interface, called with `.remote(...)` and `ray.get`.

    engine = rollout_actor(model_dir, backend="vllm")
    samples = ray.get(engine.generate.remote(prompt_ids, 4, Sampling(max_tokens=256)))
    ray.get(engine.update_weights.remote(state_dict))
"""

from __future__ import annotations

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


def rollout_actor(model_dir: str | Path, backend: str = "vllm", num_cpus: float = 1, **engine_kwargs):
    """Start an engine in a Ray actor (Ray must be initialised) and return the actor handle."""
    import ray

    return ray.remote(num_cpus=num_cpus)(EngineActor).remote(str(model_dir), backend, **engine_kwargs)
