"""The machine a process runs on: what a benchmark ran on (every benchmark JSON carries it, since numbers mean
little without it), the device a recipe's `device` resolves to, and the process's memory allocator settings."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import platform
from typing import Any

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit machines


def describe_machine() -> dict[str, Any]:
    import torch

    return {
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor(),
        "load_average": os.getloadavg(),
    }


def resolve_device(device: str) -> str:
    """A recipe's `device`: "auto" is CUDA where torch sees a GPU, else the CPU; any other value as given."""
    import torch

    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def keep_freed_memory() -> bool:
    """Have this process's allocator keep freed blocks for reuse instead of giving them back to the OS.

    By default glibc's malloc maps each block of its dynamic threshold or more (from 128 KiB) afresh and trims the
    heap's top as soon as it is freed, so a training step that allocates the same large tensors every step (a
    49k-vocabulary's logits and their chunks, activations) page-faults all of that memory in again, step after step
    (`tests/test_machine.py` counts them). Blocks up to
    32 MiB now come from the heap, and the heap is not trimmed, so a process holds its peak memory. Returns whether it
    applied (False off glibc, where nothing changes)."""
    libc = ctypes.util.find_library("c")
    if libc is None or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(libc).mallopt
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) and mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def release_freed_memory() -> bool:
    """Give the OS back what this process has freed (glibc's `malloc_trim(0)`, after a garbage collection).

    glibc keeps much of what a finished stage freed: its threshold for mapping blocks afresh rises to the largest block
    freed, so later blocks come from heaps it trims only at their top (or, after `keep_freed_memory`, never). A
    pipeline that trains a base in-process and then starts teachers in Ray actors would otherwise hold the base's
    peak beside them (on a 24 GB machine, Ray's memory monitor then killed a SmolLM2 teacher). Returns whether it applied (False off glibc)."""
    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc is None or platform.libc_ver()[0] != "glibc":
        return False
    ctypes.CDLL(libc).malloc_trim(0)
    return True
