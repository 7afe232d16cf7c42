"""The one sampling interface of the pipeline: teacher RL, MOPD and the benchmarks all use it.

    create_engine(model_dir, backend)   -> a RolloutEngine (`mopd.rollout.interface`): vLLM or HF

The backends build on `interface` alone, and this module picks one, so no module imports its importer.
"""

from __future__ import annotations

from pathlib import Path

from mopd.rollout.interface import RolloutEngine


def create_engine(model_dir: str | Path, backend: str = "vllm", **kwargs) -> RolloutEngine:
    if backend == "vllm":
        from mopd.rollout.vllm_backend import VllmEngine

        return VllmEngine(model_dir, **kwargs)
    if backend == "hf":
        from mopd.rollout.hf_backend import HFEngine

        return HFEngine(model_dir, **kwargs)
    raise ValueError(f"unknown rollout backend {backend!r}; known: 'vllm', 'hf'")
