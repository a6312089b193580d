"""The bandwidth roof of the device at hand: the rate of a large copy, measured.

A decode step reads every weight once, so a copy (one read and one write of each byte,
counted as both) is the rate it could reach at best. The H200's 4.3 TB/s was measured the
same way; on a CPU the same copy in main memory gives that machine's figure (the buffer is
far larger than any last-level cache).
"""

from __future__ import annotations

import time

import torch

COPY_BYTES = 256 << 20  # per buffer: past last-level caches (the H200 L2 is 60 MB; big CPUs: ~256)
COPY_REPEATS = 5


def copy_rate(device: str | torch.device, nbytes: int = COPY_BYTES,
              repeats: int = COPY_REPEATS) -> float:
    """Bytes read + written per second of ``dst.copy_(src)`` on ``device``: the best of
    ``repeats`` copies after one warm-up (first touch of the pages, lazy CUDA init)."""
    device = torch.device(device)
    n = max(nbytes // 4, 1)
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for i in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        if i:  # the first copy pays for page faults
            best = min(best, time.perf_counter() - t0)
    return 2 * n * 4 / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
