"""Fixtures shared by several test modules."""

from __future__ import annotations

import os

# Under pytest-xdist each worker gets its share of the CPUs for torch's (and OpenMP's) thread
# pools, and so do the servers and tools the tests start (they inherit the environment):
# two workers on two cores each spinning two OpenMP threads ran some tests 90x slower.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_SHARE = max(1, len(os.sched_getaffinity(0)) // _WORKERS)
if _WORKERS > 1:
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, str(_SHARE))

import pytest
import torch

if _WORKERS > 1:
    torch.set_num_threads(_SHARE)

# Triton reads TRITON_INTERPRET when a kernel is defined: set here, before any test module
# imports a kernel module, so that the order of the modules in a worker cannot leave some
# kernels compiled for a GPU and others interpreted (kernel_device says the same; a module
# that imported deimos.quant.triton first broke the next module's kernels).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def module_one_thread():
    """torch on one thread for a whole module (tiny matrices: the thread pool only costs, 25x
    on a shared 2-core machine); the count restored after the module."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
