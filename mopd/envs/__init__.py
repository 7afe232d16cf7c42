"""Task domains with physical verifiers; `get_env` builds one by name without importing the others."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from mopd.envs.base import DOMAINS

ENV_CLASSES = {
    "general": ("mopd.envs.general", "GeneralEnv"),
    "code": ("mopd.envs.code", "CodeEnv"),
    "agent": ("mopd.envs.agent", "AgentEnv"),
}
REMOVED_OPTIONS = {
    "disjoint_eval": "removed: train, dev and test are always disjoint by content (mopd.envs.splits); "
    "an in-distribution score is a bench suite with `split: train`",
}


def env_class(domain: str) -> type:
    if domain not in ENV_CLASSES:
        raise ValueError(f"unknown domain {domain!r}; choose one of {list(DOMAINS)}")
    module, name = ENV_CLASSES[domain]
    return getattr(importlib.import_module(module), name)


def check_env_options(domain: str, options: dict[str, Any]) -> None:
    """Raise a ValueError naming any option the domain's env does not take."""
    known = set(inspect.signature(env_class(domain)).parameters)
    for name in options:
        if name in REMOVED_OPTIONS:
            raise ValueError(f"envs.{domain}.{name}: {REMOVED_OPTIONS[name]}")
        if name not in known:
            raise ValueError(f"envs.{domain}.{name}: unknown option; {domain} takes {sorted(known)}")
    if domain == "agent" and "scaffolds" in options:  # a name, not a knob: refused here, with the recipe's field
        from mopd.envs.agent.scaffolds import check_choice

        check_choice(options["scaffolds"], "envs.agent.scaffolds")


def text_contents(domain: str, text: str) -> set[str]:
    """The content keys a text of `domain` states (its module's `contents`; `mopd.envs.splits`)."""
    env_class(domain)  # names an unknown domain
    return importlib.import_module(ENV_CLASSES[domain][0]).contents(text)


def prompt_contents(tasks) -> set[str]:
    """The contents the prompts of RL or MOPD tasks state (their system line and question); what
    the model then writes is its own, and the observations show the task's own content."""
    return set().union(*(text_contents(t.domain, (t.meta.get("system") or "") + "\n" + t.prompt) for t in tasks))


def get_env(domain: str, **options: Any) -> Any:
    """The environment of `domain`, built with its keyword options (families, difficulty knobs…)."""
    check_env_options(domain, options)
    return env_class(domain)(**options)
