"""The rollout engine as a Ray actor: the same interface, called with `.remote(...)` and `ray.get`.

    engine = rollout_actor(model_dir, backend="vllm")
    samples = ray.get(engine.generate.remote(prompt_ids, 4, Sampling(max_tokens=256)))
    ray.get(engine.update_weights.remote(state_dict))

`RemoteEngine` wraps such an actor as a local `RolloutEngine`: the caller's code is unchanged, and a
thread blocked on the actor's generation holds no core of this process (MOPD's one-step-off sampler).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch

from mopd.rollout.engine import create_engine
from mopd.rollout.interface import DEFAULT_SAMPLING, Sample, Sampling


class EngineActor:
    def __init__(self, model_dir: str | Path, backend: str = "vllm", threads: int | None = None, **engine_kwargs):
        if threads:  # the actor's CPUs, whatever OMP_NUM_THREADS the driver's environment passed down
            torch.set_num_threads(threads)
        self.engine = create_engine(model_dir, backend, **engine_kwargs)

    def generate(self, prompt_ids: list[list[int]], n: int = 1, sampling: Sampling = DEFAULT_SAMPLING) -> list[list[Sample]]:
        return self.engine.generate(prompt_ids, n, sampling)

    def score(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[list[float]]:
        return self.engine.score(prompt_ids, completion_ids)

    def update_weights(self, state_dict: Mapping[str, object]) -> int:
        return self.engine.update_weights({name: from_object_store(value) for name, value in state_dict.items()})

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
    """Start an engine in a Ray actor (Ray must be initialised) and return the actor handle; its torch threads are
    its `num_cpus` (at least one)."""
    import ray

    threads = max(1, int(num_cpus))
    return ray.remote(num_cpus=num_cpus)(EngineActor).remote(str(model_dir), backend, threads, **engine_kwargs)


class RemoteEngine:
    """A `RolloutEngine` whose engine runs in a Ray actor (`rollout_actor`): generation and scoring happen in
    that process; weights travel to it through Ray's object store.

    `update_weights` returns once the weights are in the object store: the actor loads them before the next
    call this process makes (an actor runs one caller's calls in the order they were made), so the trainer
    does not wait for the engine's reload, and a push that failed is raised by that next call."""

    def __init__(self, actor):
        import ray

        self.actor, self._ray = actor, ray
        self.policy_version, self.max_model_len = ray.get([actor.policy_version.remote(), actor.max_model_len.remote()])
        self.pushes: list = []

    def generate(self, prompt_ids: list[list[int]], n: int = 1, sampling: Sampling = DEFAULT_SAMPLING) -> list[list[Sample]]:
        call = self.actor.generate.remote(prompt_ids, n, sampling)
        self.settle_pushes()
        return self._ray.get(call)

    def score(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[list[float]]:
        call = self.actor.score.remote(prompt_ids, completion_ids)
        self.settle_pushes()
        return self._ray.get(call)

    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> int:
        weights = {name: to_object_store(tensor) for name, tensor in state_dict.items()}
        self.policy_version += 1
        self.pushes.append((self.actor.update_weights.remote(weights), self.policy_version))  # copied out here
        return self.policy_version

    def settle_pushes(self) -> None:
        pushes, self.pushes = self.pushes, []
        for push, expected in pushes:
            if (loaded := self._ray.get(push)) != expected:
                raise RuntimeError(f"sampler actor: policy version {loaded} after a weight push, expected {expected}")

    def close(self) -> None:
        try:
            self.settle_pushes()
            self._ray.get(self.actor.close.remote())
        finally:
            self._ray.kill(self.actor)


def to_object_store(tensor: torch.Tensor) -> object:
    """A tensor as Ray moves it fastest: a numpy array goes into the object store in one copy and is read
    there without another (a torch tensor is pickled, copied on both sides). dtypes numpy lacks (bfloat16)
    travel as tensors."""
    tensor = tensor.detach().cpu()
    return tensor if tensor.dtype == torch.bfloat16 else tensor.numpy()


def from_object_store(value: object) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    with warnings.catch_warnings():  # the object store's arrays are read-only; the engine copies them into its weights
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(value)
