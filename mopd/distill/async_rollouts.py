"""One-step-off sampling for MOPD: the next step's rollouts are generated while this step trains.

    main thread   take(n) ─ start(n+1) ─ score(n) ─ train(n) ─ wait() ─ update_weights ─ take(n+1) …
    producer                └──────── run_rollouts(n+1) on the weights of step n-1 ────┘

Weights are pushed only between batches (after `wait`), never while the engine generates, so a
batch comes whole from one policy version: one optimizer step behind the trainer (lag 1). Without
overlap (`max_staleness: 0`) `start` does nothing and `take` samples in the calling thread: the
synchronous loop, sample → score → train → sync, unchanged.

The producer thread runs torch with as many threads as the thread that made it (OpenMP settings
are per thread; a new thread would otherwise take the machine's default).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from mopd.rollout.episodes import Rollout


class RolloutProducer:
    """Rollouts by step: sampled on demand, or (with `overlap`) one step ahead on a background thread."""

    def __init__(self, sample: Callable[[int], list[Rollout]], overlap: bool):
        self.sample, self.overlap = sample, overlap
        self.pending: dict[int, Future[list[Rollout]]] = {}
        self.pool = ThreadPoolExecutor(
            1, thread_name_prefix="mopd-rollouts", initializer=torch.set_num_threads, initargs=(torch.get_num_threads(),)
        ) if overlap else None  # fmt: skip

    def start(self, step: int) -> None:
        """Begin sampling `step` on the engine's current weights (nothing without overlap)."""
        if self.pool is not None:
            self.pending[step] = self.pool.submit(self.sample, step)

    def take(self, step: int) -> list[Rollout]:
        """The rollouts of `step`: the batch started earlier, or sampled now."""
        future = self.pending.pop(step, None)
        return future.result() if future is not None else self.sample(step)

    def wait(self) -> None:
        """Block until no batch is being generated: the engine's weights may then be replaced."""
        for future in self.pending.values():
            future.exception()  # waits; a failed batch raises when it is taken

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
