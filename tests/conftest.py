"""Fixtures shared across test modules (built once per session: the machine has 2 cores)."""

import pytest
import torch

SET_NUM_THREADS = torch.set_num_threads


def pytest_collection_modifyitems(items):
    """Slow tests first: under `make test` (two workers, a file each) the longest files then start
    together and the rest fills in beside them, instead of one running alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tests are tiny: one intra-op thread avoids oversubscribing the 2 cores (far faster here).

    vLLM's in-process CPU worker replaces torch.set_num_threads with a no-op and sets its own
    count, so each module restores the function before setting one thread.
    """
    torch.set_num_threads = SET_NUM_THREADS
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from mopd.envs.tokenizer import build_tiny_tokenizer

    return build_tiny_tokenizer(tasks_per_cell=20)
