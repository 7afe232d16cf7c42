"""One rollout engine at a time, its weights swapped between checkpoints of one architecture
(`mopd bench` scores a run's base, teachers and student with it; pair mode its before and after)."""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from mopd.artifacts import config_hash, read_json
from mopd.rollout.engine import create_engine


class EngineCache:
    """One engine at a time. A checkpoint with the same architecture and tensor names as the loaded one
    is swapped in with `update_weights` (a run's base, teachers and student all are): starting a vLLM
    engine costs far more than copying a tiny model's weights."""

    def __init__(self, backend: str, **engine_kwargs):
        self.backend, self.engine_kwargs, self.engine, self.signature = backend, engine_kwargs, None, None

    def load(self, path: Path):
        signature = checkpoint_signature(path)
        if self.engine is not None and signature == self.signature:
            self.engine.update_weights(checkpoint_weights(path))
            return self.engine
        if self.engine is not None:
            self.engine.close()
        self.engine = None
        gc.collect()
        self.engine, self.signature = create_engine(path, backend=self.backend, **self.engine_kwargs), signature
        return self.engine


# Config keys that say nothing about the served model. `use_cache` is a generate-time default
# (transformers' Trainer saves it off: a run's teachers differ from its base and student in it alone).
NOT_ARCHITECTURE = ("_name_or_path", "transformers_version", "use_cache")


def checkpoint_signature(path: Path) -> str:
    """Equal for checkpoints that differ in weight values only."""
    from safetensors import safe_open

    config = {k: v for k, v in read_json(path / "config.json").items() if k not in NOT_ARCHITECTURE}
    names = []
    for weights in sorted(path.glob("*.safetensors")):
        with safe_open(weights, "pt") as f:
            names += f.keys()
    return config_hash(config, sorted(names))


def checkpoint_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {
        name: tensor
        for weights in sorted(path.glob("*.safetensors"))
        for name, tensor in load_file(weights).items()
    }
