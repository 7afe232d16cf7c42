"""Ray for the stages that fan work out: starting it, sizing the worker pool, and the work queue.

    start_ray(recipe)                       connect to the recipe's cluster, or start a local one
    connect_ray(address, num_cpus)          the same from an address; ClusterStartError when Ray will not start
    slots(resources)                        how many workers needing these resources fit at once
    run_in_slots(queue, slots, start, wait_one)   the queue in order, never more than `slots` at once
    StatusLines()                           the driver's one line per running job, live or piped

The teachers (one cell per worker) and the benchmark (one model × cell per worker) share them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable

import ray
from rich.console import Console, Group
from rich.live import Live
from rich.text import Text


class ClusterStartError(RuntimeError):
    """Ray could not be started or reached: reported in one line, and a re-run resumes."""


def start_ray(recipe) -> bool:
    """Connect to (or start) Ray as the recipe says; True when this call initialised Ray in this process
    (the caller shuts it down)."""
    return connect_ray(recipe.ray.address, recipe.ray.num_cpus)


def connect_ray(address: str | None, num_cpus: int | None = None) -> bool:
    """Connect to the Ray cluster at `address` (None: start a local one); True when this call initialised
    Ray in this process (the caller shuts it down), False when it already was."""
    if ray.is_initialized():
        return False
    # Ray starts workers at nice 15; here the workers are the job itself, so on a shared box they
    # would starve behind every other process.
    os.environ.setdefault("RAY_worker_niceness", "0")
    try:
        ray.init(address=address, num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
    except Exception as err:  # Ray raises RuntimeError, ConnectionError or a bare Exception here
        raise ClusterStartError(start_failure(address, err)) from err
    return True


def start_failure(address: str | None, err: BaseException) -> str:
    """The one line a user reads when Ray will not start."""
    reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
    if address:
        where, hint = f"the Ray cluster at ray.address={address!r}", "check that the cluster is up and reachable"
    else:
        where, hint = "a local Ray node", "a loaded machine can time out Ray's start: retry when it is quieter"
    return f"could not start {where} ({reason}); {hint}. Finished stages are kept: re-run the same command to resume"


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


class StatusLines:
    """One status line per running job, shown by a driver that polls its jobs.

    On a terminal the lines are redrawn in place (rich Live). Piped to a file, a job's line is
    printed again only once it has changed and `every` seconds have passed since its last one, so
    the log is plain lines: no carriage returns, no cursor moves, no colours. A finished job's
    summary is printed once, above the live lines.
    """

    def __init__(
        self, console: Console | None = None, every: float = 30.0, clock: Callable[[], float] = time.monotonic
    ):
        self.console = console or Console(stderr=True)
        self.every, self.clock = every, clock
        self.lines: dict[str, str] = {}
        self.printed: dict[str, tuple[str, float]] = {}  # job -> (line, when), piped output only
        self.live = Live(console=self.console, auto_refresh=False) if self.console.is_terminal else None

    def __enter__(self) -> StatusLines:
        if self.live:
            self.live.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.live:
            self.live.stop()

    def update(self, job: str, line: str) -> None:
        self.lines[job] = line
        if self.live:
            self.redraw()
            return
        last = self.printed.get(job)
        now = self.clock()
        if last is None or (line != last[0] and now - last[1] >= self.every):
            self.print(line)
            self.printed[job] = (line, now)

    def finish(self, job: str, summary: str) -> None:
        self.lines.pop(job, None)
        self.printed.pop(job, None)
        self.print(summary)
        if self.live:
            self.redraw()

    def redraw(self) -> None:
        lines = (Text(line, no_wrap=True, overflow="ellipsis") for line in self.lines.values())
        self.live.update(Group(*lines), refresh=True)

    def print(self, line: str) -> None:
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)
