"""Helpers the benchmarks share: a call in a fresh (spawned) process, Linux resident-memory readings, and a
sweep comparison's summary files."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from mopd.artifacts import write_json_atomic, write_text_atomic


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


def write_summary(out: Path, summary: dict[str, Any], render: Callable[[dict[str, Any]], str]) -> None:
    """`out/summary.json` and its markdown `out/summary.md`, which is also printed."""
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "summary.json", summary)
    write_text_atomic(out / "summary.md", render(summary))
    print(render(summary))
