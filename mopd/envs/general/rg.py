"""Reasoning-gym families, named `rg/<name>` (e.g. `rg/gcd`): items drawn from reasoning-gym's
datasets and scored by its own scorer. They have no trace, so the expert writes a short think block
and the gold answer."""

from __future__ import annotations

import functools
import json
from typing import Any

from mopd.envs.base import Task, Verdict

RG_PREFIX = "rg/"
RG_CHUNK = 256


def _config_key(config: dict[str, Any]) -> str:
    return json.dumps(config, sort_keys=True)


def _rg_create(name: str, config: dict[str, Any], seed: int, size: int) -> Any:
    import reasoning_gym

    try:
        return reasoning_gym.create_dataset(name, seed=seed, size=size, **config)
    except Exception as error:
        raise ValueError(
            f"general: reasoning-gym family {name!r} with options {config} failed: {error}"
        ) from error


@functools.lru_cache(maxsize=64)
def _rg_dataset(name: str, config_key: str) -> Any:
    """One scorer instance per (family, options); scoring does not depend on the seed."""
    return _rg_create(name, json.loads(config_key), seed=0, size=1)


def _verify_rg(task: Task, answer: str) -> Verdict:
    name = task.meta["family"].removeprefix(RG_PREFIX)
    entry = task.meta.get("rg_entry")
    if entry is None:
        raise ValueError(f"task {task.id}: reasoning-gym family {name!r} needs meta['rg_entry']")
    scorer = _rg_dataset(name, _config_key(task.meta.get("rg_config", {})))
    reward = float(scorer.score_answer(answer, entry))
    return Verdict(
        min(max(reward, 0.0), 1.0),
        {"family": task.meta["family"], "expected": entry["answer"], "got": answer},
    )
