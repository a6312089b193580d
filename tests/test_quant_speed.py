"""Speed note: dequantizing a 4096x4096 tensor of every type (printed; see ``pytest -s``).

Only a generous bound is asserted (CI has 2 shared cores); the numbers are for reading.
"""

from __future__ import annotations

import time

import numpy as np

from deimos.gguf.constants import GGMLType
from deimos.quant import dequantize, formats, get_format

SHAPE = (4096, 4096)


def test_dequantize_4096x4096_speed() -> None:
    rng = np.random.default_rng(0)
    lines = []
    slowest = 0.0
    for t, f in sorted(formats().items(), key=lambda kv: kv[0].name):
        blocks = f.random_blocks(SHAPE[0] * SHAPE[1] // f.block_size, rng)
        t0 = time.perf_counter()
        y = dequantize(blocks, t, SHAPE, "speed")
        dt = time.perf_counter() - t0
        assert y.shape == SHAPE
        slowest = max(slowest, dt)
        lines.append(f"{t.name:8s} {dt * 1e3:7.1f} ms  {y.size / dt / 1e6:6.0f} Melem/s  "
                     f"{blocks.nbytes / dt / 1e9:5.2f} GB/s in")
    print("\ndequantize 4096x4096 (numpy, CPU):\n" + "\n".join(lines))
    assert slowest < 10.0, f"slowest type took {slowest:.1f} s"


def test_random_blocks_speed_q4_K() -> None:
    """The synth writer's need: an 8B model's worth of Q4_K blocks in seconds."""
    f = get_format(GGMLType.Q4_K)
    n = 1 << 20  # 268M weights, 151 MB
    t0 = time.perf_counter()
    f.random_blocks(n, np.random.default_rng(0))
    dt = time.perf_counter() - t0
    per_8b = dt * 8e9 / (n * 256)
    print(f"\nrandom_blocks Q4_K: {n} blocks in {dt:.2f} s -> ~{per_8b:.1f} s per 8B weights")
    assert per_8b < 120
