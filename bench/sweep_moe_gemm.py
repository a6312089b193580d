"""Tiles of the prefill MoE GEMM (quant.triton.moe_gemm) at a model's expert shapes: T tokens
routed to k of E experts at random, the gate GEMM (Q4_K, [F, D], x rows by token) and the down
GEMM (--down format, [D, F], x rows by pair), for each tile height block_m (the tile map's) and
tile (block_n, block_j, warps, stages), each checked against the launch rule's output.

Timing: CUDA-graph replay (quant.triton.bench.time_graph) of one launch over stacks of all E
experts (each expert 8 times a repeated random one: distinct addresses, no L2 reuse).

    python bench/sweep_moe_gemm.py [--arch qwen35moe|qwen3moe] [-t 512] [--budget 150]

Measures only; prints a table. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deimos.gguf.constants import GGMLType  # noqa: E402
from deimos.quant.triton.bench import expert_stack, time_graph  # noqa: E402
from deimos.quant.triton.dequant_gemv import words_per_group  # noqa: E402
from deimos.quant.triton.moe_gemm import (  # noqa: E402
    BLOCK_MS,
    MoeGemmConfig,
    moe_align,
    moe_block_m,
    moe_gemm,
    moe_gemm_config,
)

SHAPES = {"qwen35moe": (2048, 512, 256, 8), "qwen3moe": (2048, 768, 128, 8)}  # D, F, E, k


def tiles_for(t: GGMLType, block_m: int) -> list[MoeGemmConfig]:
    nk = 32 // words_per_group(t)
    out = []
    for block_n in (32, 64, 128):
        for cols in (128, 256):
            for warps in (4, 8):
                if cols // nk >= words_per_group(t):
                    out.append(MoeGemmConfig(block_n, cols // nk, warps, 3))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen35moe", choices=sorted(SHAPES))
    ap.add_argument("-t", type=int, default=512, help="tokens")
    ap.add_argument("--down", default="Q6_K")
    ap.add_argument("--budget", type=float, default=150.0, help="seconds; stop sweeping after")
    a = ap.parse_args()
    d, f, e, k = SHAPES[a.arch]
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    gate, down = expert_stack(GGMLType.Q4_K, f, d, e, 1), expert_stack(GGMLType[a.down], d, f, e, 3)
    slot_of = torch.arange(e, dtype=torch.int32, device=dev)
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(a.t)]).to(torch.int32).to(dev)
    x = (torch.randn(a.t, d, device=dev) * 0.5).half()
    xa = (torch.randn(a.t * k, f, device=dev) * 0.5).half()
    rule_m = moe_block_m(a.t * k, e)
    print(f"{a.arch}: T={a.t}, D={d}, F={f}, E={e}, k={k}; the rule's block_m {rule_m}")
    print("| GEMM | block_m | rule tile | rule us | best tile | best us | weight GB/s at best |")
    print("|---|---:|---|---:|---|---:|---:|")
    results = []
    for name, w, n, xin, rows in (("gate", gate, f, x, "token"), ("down", down, d, xa, "pair")):
        ref = None
        for bm in BLOCK_MS:
            tiles = moe_align(ids, e, bm)
            rule = moe_gemm_config(w.ggml_type, n, w.k, bm)

            def run(cfg, tiles=tiles, w=w, n=n, xin=xin, rows=rows):
                return moe_gemm(xin, w, n, tiles, slot_of, rows, x_permuted=False, cfg=cfg, mmq=False)

            if ref is None:
                ref = run(rule).double()
            times = {}
            for cfg in [rule, *tiles_for(w.ggml_type, bm)]:
                if cfg in times or time.perf_counter() - t0 > a.budget:
                    continue
                try:
                    got = run(cfg).double()
                except Exception as ex:  # a tile that does not compile or launch: skipped
                    print(f"  {name} bm={bm} {tuple(cfg)}: {type(ex).__name__}: {str(ex)[:60]}")
                    continue
                err = ((got - ref).norm() / ref.norm()).item()
                if not err < 1e-3:
                    print(f"  {name} bm={bm} {tuple(cfg)}: WRONG (rel {err:.1e})")
                    continue
                times[cfg] = time_graph(lambda cfg=cfg: run(cfg), calls=10, reps=10)
            if rule not in times:
                continue
            best = min(times, key=times.get)
            gbs = w.nbytes / times[best] / 1e9
            results.append((name, bm, best, times[best]))
            print(f"| {name} | {bm} | {tuple(rule)} | {times[rule] * 1e6:.1f} | {tuple(best)} | "
                  f"{times[best] * 1e6:.1f} | {gbs:.0f} |", flush=True)
    print(f"swept in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
