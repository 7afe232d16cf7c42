"""Fixtures shared across test modules (built once per session: the machine has 2 cores)."""

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    # Tests are tiny; one intra-op thread avoids oversubscribing the 2 cores (much faster here).
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from mopd.envs.tokenizer import build_tiny_tokenizer

    return build_tiny_tokenizer(tasks_per_cell=20)
