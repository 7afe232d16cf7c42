"""Ray for the stages that fan work out: starting it, sizing the worker pool, and the work queue.

    start_ray(recipe)                       connect to the recipe's cluster, or start a local one
    slots(resources)                        how many workers needing these resources fit at once
    run_in_slots(queue, slots, start, wait_one)   the queue in order, never more than `slots` at once

The teachers (one cell per worker) and the benchmark (one model × cell per worker) share them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

import ray


def start_ray(recipe) -> bool:
    """Connect to (or start) Ray as the recipe says; True when this call started it."""
    if ray.is_initialized():
        return False
    # Ray starts workers at nice 15; here the workers are the job itself, so on a shared box they
    # would starve behind every other process.
    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(
        address=recipe.ray.address,
        num_cpus=recipe.ray.num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    return True


def slots(resources: Iterable) -> int:
    """How many workers the cluster runs at once when each needs the most any of `resources` asks."""
    total = ray.cluster_resources()
    fits = [
        int(total.get(name, 0) // need)
        for r in resources
        for name, need in (("CPU", r.num_cpus), ("GPU", r.num_gpus))
        if need > 0
    ]
    return max(1, min(fits, default=1))  # never zero: Ray queues a worker until the cluster grows


def run_in_slots(
    queue: list[str], slots: int, start: Callable[[str], None], wait_one: Callable[[], str]
) -> None:
    """Start the queue in order, never more than `slots` running; `wait_one` blocks until one finishes and names it."""
    waiting, running = list(queue), set()
    while waiting or running:
        while waiting and len(running) < slots:
            item = waiting.pop(0)
            start(item)
            running.add(item)
        running.remove(wait_one())
