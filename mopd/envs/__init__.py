"""Task domains with physical verifiers; `get_env` builds one by name without importing the others."""

from __future__ import annotations

import importlib
from typing import Any

from mopd.envs.base import DOMAINS

ENV_CLASSES = {
    "general": ("mopd.envs.general", "GeneralEnv"),
    "code": ("mopd.envs.code", "CodeEnv"),
    "agent": ("mopd.envs.agent", "AgentEnv"),
}


def env_class(domain: str) -> type:
    if domain not in ENV_CLASSES:
        raise ValueError(f"unknown domain {domain!r}; choose one of {list(DOMAINS)}")
    module, name = ENV_CLASSES[domain]
    return getattr(importlib.import_module(module), name)


def get_env(domain: str, **options: Any) -> Any:
    """The environment of `domain`, built with its keyword options (families, difficulty knobs…)."""
    return env_class(domain)(**options)
