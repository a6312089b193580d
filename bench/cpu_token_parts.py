"""A decode layer's CPU side (deimos.runtime.cpu_experts, ``CpuExperts.token``) split into
ggml's compute, the activation planes' quantization and the rest (numpy and ctypes around
them): the host work on a captured offload step's critical path besides ggml itself.

    python bench/cpu_token_parts.py [--misses 3] [--calls 300] [--threads 1] [--reps 2]
        [--planes 1] [--two-graphs]

One qwen3moe 30B-A3B-sized layer (128 experts, n_embd 2048, n_ff_exp 768, gate/up Q4_K,
down Q6_K: the Q4_K_M mix) of random valid blocks; each call on random distinct experts.
Times are per call (one layer of one token), the last of ``--reps`` passes. ``--planes``:
the activation planes (default the offload's, ``CPU_PLANES``); with one, the engine computes a
token in one graph that quantizes x and h itself (``_GgmlFused``); ``--two-graphs`` times the
two-graph layout with its planes made here instead (``_GgmlToken``, the engine's before). A
measurement, not a test.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deimos.gguf.constants import GGMLType  # noqa: E402
from deimos.models.gpu.offload import CPU_PLANES  # noqa: E402
from deimos.quant import get_format  # noqa: E402
from deimos.runtime.cpu_experts import (  # noqa: E402
    CpuExperts,
    ExpertMatrix,
    LayerExperts,
    _GgmlGraphs,
    _Planes,
)

E, F, D = 128, 768, 2048


def layer(rng) -> LayerExperts:
    def mat(t, n_out, n_in, name):
        f = get_format(t)
        raw = f.random_blocks(E * n_out * n_in // f.block_size, rng)
        return ExpertMatrix(np.ascontiguousarray(raw.reshape(E, n_out, -1)), t, n_out, n_in, name)

    return LayerExperts(mat(GGMLType.Q4_K, F, D, "gate"), mat(GGMLType.Q4_K, F, D, "up"),
                        mat(GGMLType.Q6_K, D, F, "down"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--misses", type=int, default=3, help="missed experts a call")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1, help="ggml threads")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--planes", type=int, default=CPU_PLANES, help="activation planes (1-3)")
    ap.add_argument("--two-graphs", action="store_true", help="one plane in the two-graph layout")
    a = ap.parse_args()
    if not 1 <= a.misses <= E or a.calls < 1 or a.threads < 1 or a.reps < 1 or a.planes not in (1, 2, 3):
        ap.error(f"--misses must be in 1..{E}, --calls, --threads and --reps >= 1, --planes 1-3")
    rng = np.random.default_rng(0)
    cpu = CpuExperts([layer(rng)], n_threads=a.threads, planes=a.planes, fused=not a.two_graphs)
    x = rng.standard_normal(D).astype(np.float32)
    out = np.zeros(D, np.float32)
    w = np.full(a.misses, 1 / a.misses, np.float32)
    spent = {"compute": 0.0, "planes": 0.0}
    compute, quantize = _GgmlGraphs._compute, _Planes.quantize_into

    def timed(key, fn):
        def run(*args):
            t = time.perf_counter()
            fn(*args)
            spent[key] += time.perf_counter() - t
        return run

    _GgmlGraphs._compute = timed("compute", compute)
    _Planes.quantize_into = timed("planes", quantize)
    try:
        for _ in range(a.reps):
            spent.update(compute=0.0, planes=0.0)
            t0 = time.perf_counter()
            for _ in range(a.calls):
                cpu.token(0, x, np.sort(rng.choice(E, a.misses, replace=False)), w, out)
            per = (time.perf_counter() - t0) / a.calls
    finally:
        _GgmlGraphs._compute, _Planes.quantize_into = compute, quantize
    c, q = spent["compute"] / a.calls, spent["planes"] / a.calls
    how = f"{a.planes} plane{'s' if a.planes > 1 else ''}" + (", two graphs" if a.two_graphs else "")
    print(f"{a.misses} misses, {a.threads} ggml threads, {how}: a call {per * 1e6:.0f} us = ggml compute "
          f"{c * 1e6:.0f} + activation planes {q * 1e6:.0f} + the rest {(per - c - q) * 1e6:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
