"""One sampling interface for teacher RL, MOPD and benchmarks; vLLM (default) and HF backends."""

from mopd.rollout.engine import create_engine
from mopd.rollout.interface import (
    DEFAULT_SAMPLING,
    CheckpointError,
    PromptTooLongError,
    RolloutEngine,
    Sample,
    Sampling,
    load_k3_config,
)

__all__ = [
    "DEFAULT_SAMPLING",
    "CheckpointError",
    "PromptTooLongError",
    "RolloutEngine",
    "Sample",
    "Sampling",
    "create_engine",
    "load_k3_config",
]
