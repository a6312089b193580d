"""Time the decode GEMV (gemv_q8, its launch rule) on the GPU: CUDA-graph replay of many calls,
achieved GB/s of weights. Other tiles, per matrix of a real model: bench/sweep_gemv.py.

    python -m deimos.quant.triton.bench [--types Q4_K,Q6_K,Q8_0]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from deimos.gguf.constants import GGMLType
from deimos.quant import get_format
from deimos.quant.triton.gemv_q8 import gemv_q8, q8_config, quantize_x
from deimos.quant.triton.layout import PackedWeight, pack

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (1024, 4096)]
ROOF_GBS = 4300.0  # H200 device-to-device copy, measured


def expert_stack(t: GGMLType, n: int, k: int, n_expert: int, seed: int, base: int = 8) -> PackedWeight:
    """A CUDA stack of ``n_expert`` random [n, k] experts in format ``t`` for the MoE sweeps:
    ``base`` random ones repeated (distinct addresses, so a step reads them from memory, not
    L2; ``n_expert`` a multiple of ``base``)."""
    fmt = get_format(t)
    blocks = fmt.random_blocks(base * n * k // fmt.block_size, np.random.default_rng(seed))
    w = pack(blocks.reshape(base * n, -1), t).to("cuda")
    reps = n_expert // base
    return PackedWeight(w.ggml_type, w.n * reps, w.k, {a: v.repeat(reps, 1) for a, v in w.tensors.items()})


def time_graph(fn, calls: int = 50, reps: int = 20) -> float:
    """Seconds per call: a CUDA graph of ``calls`` launches, median of ``reps`` replays.
    ``fn``: a callable, or a list of them the graph cycles through (e.g. one per weight copy,
    so that the weights come from memory rather than L2; at least one call of each)."""
    fns = list(fn) if isinstance(fn, (list, tuple)) else [fn]
    calls = max(calls, len(fns))
    for f in fns:
        f()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / calls)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="Q4_K,Q6_K,Q8_0")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    for name in args.types.split(","):
        t = GGMLType[name]
        fmt = get_format(t)
        for n, k in SHAPES:
            blocks = fmt.random_blocks(n * k // fmt.block_size, rng).reshape(n, -1)
            w = pack(blocks, t).to("cuda")
            for b in (1, 4):
                qx = quantize_x(torch.randn(b, k, device="cuda", dtype=torch.float16))
                out = torch.empty(b, n, device="cuda")
                cfg = q8_config(w.ggml_type, n, k, b)
                sec = time_graph(lambda w=w, qx=qx, out=out: gemv_q8(w, qx, out))
                gbs = w.nbytes / sec / 1e9
                print(f"{name:5} {n:>6}x{k:<6} b={b} {tuple(cfg)}  {sec * 1e6:7.2f} us {gbs:6.0f} GB/s "
                      f"{gbs / ROOF_GBS:4.0%}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
