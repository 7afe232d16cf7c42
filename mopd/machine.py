"""What a benchmark ran on; every benchmark JSON carries it, since numbers mean little without it."""

from __future__ import annotations

import os
import platform
from typing import Any


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
