"""Fixtures shared by several test modules."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def module_one_thread():
    """torch on one thread for a whole module (tiny matrices: the thread pool only costs, 25x
    on a shared 2-core machine); the count restored after the module."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
