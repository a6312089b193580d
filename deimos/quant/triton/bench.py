"""Time the dequant-GEMV on the GPU: CUDA-graph replay of many calls, achieved GB/s of weights.

    python -m deimos.quant.triton.bench [--sweep]

``--sweep`` also times other launch configs (rows per program, warps) to check the rule.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from deimos.gguf.constants import GGMLType
from deimos.quant import get_format
from deimos.quant.triton import dequant_gemv as g
from deimos.quant.triton.layout import pack

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (1024, 4096)]
ROOF_GBS = 4300.0  # H200 device-to-device copy, measured


def time_graph(fn, calls: int = 50, reps: int = 20) -> float:
    """Seconds per call: a CUDA graph of ``calls`` launches, median of ``reps`` replays."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
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
    ap.add_argument("--sweep", action="store_true")
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
                xp = g.prepare_x(torch.randn(b, k, device="cuda", dtype=torch.float16))
                out = torch.empty(b, n, device="cuda")
                base = g.launch_config(t, n, k, b)
                cfgs = [base]
                if args.sweep and b == 1:
                    for bn in (4, 8, 32):
                        for nw in (2, 4, 8):
                            if bn >= nw:
                                cfgs.append(base._replace(block_n=bn, num_warps=nw))
                    cfgs.append(base._replace(num_warps=8))
                for cfg in cfgs:
                    sec = time_graph(lambda cfg=cfg: g._launch(w, xp, out, cfg))
                    gbs = w.nbytes / sec / 1e9
                    print(
                        f"{name:5} {n:>6}x{k:<6} b={b} N={cfg.block_n:<3} S={cfg.block_s} "
                        f"warps={cfg.num_warps}  {sec * 1e6:7.2f} us {gbs:6.0f} GB/s "
                        f"{gbs / ROOF_GBS:4.0%}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
