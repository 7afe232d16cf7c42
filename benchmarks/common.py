"""Helpers the benchmarks share: a call in a fresh (spawned) process, and Linux resident-memory readings."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path


def in_fresh_process(fn, *args):
    """`fn(*args)` in a freshly spawned process (its own imports, allocator and peak RSS); its result."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux ≥ 4.0: VmHWM := VmRSS


def rss_bytes(field: str) -> int:
    """A memory field of /proc/self/status (`VmRSS`, `VmHWM`, ...) in bytes."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024  # reported in kB
