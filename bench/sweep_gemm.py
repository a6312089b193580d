"""Time the prefill dequant-GEMM (``dequant_matmul``) of every distinct matrix of a model
under several tiles, against the path the engine's prefill runs by default (the weight
dequantized to fp16 by our kernel, then cuBLAS); the result is what ``gemm_config`` is set from.

    python bench/sweep_gemm.py MODEL.gguf [MODEL.gguf ...] [-m 512] [--quick]

For each (format, N, K) of the model's linears (fused q/k/v and gate/up as the engine runs
them): the fp16 round trip's time (dequantization and cuBLAS apart), the best tile's time and
TFLOP/s, and the tiles that fail to compile (shared memory) or give a wrong answer (each
output checked against the round trip's). Ends with the per-prefill total of each path.
Measures only; needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).parent))
from sweep_gemv import decode_linears, distinct_shapes

from deimos.gguf import GGUFFile
from deimos.models import load_model
from deimos.models.gpu.dequant import (
    GemmConfig,
    dequant_matmul,
    dequantize_fp16,
    gemm_config,
    permuted_columns,
)
from deimos.quant.triton.bench import time_graph


def candidates(m: int, n: int, k: int, quick: bool) -> list[GemmConfig]:
    out = [gemm_config(m, n, k)]
    if m <= 64:  # few rows: narrow M tiles, more programs along N
        tiles = [(16, 64, 2, 4), (16, 128, 2, 4), (32, 64, 2, 4), (64, 64, 2, 4), (16, 64, 4, 4),
                 (32, 128, 2, 4), (16, 32, 4, 2), (64, 128, 2, 4)]
    else:
        tiles = [(128, 128, 2, 4), (128, 64, 2, 4), (128, 128, 1, 4), (64, 128, 2, 4), (128, 128, 2, 8),
                 (128, 256, 1, 8), (128, 256, 2, 8), (256, 128, 1, 8), (64, 64, 2, 4), (128, 128, 4, 8),
                 (64, 256, 2, 8)]
    for bm, bn, bs, w in tiles[:5] if quick else tiles:
        for st in (3,) if quick else (2, 3, 4):
            out.append(GemmConfig(bm, bn, bs, w, st))
        out.append(GemmConfig(bm, bn, bs, w, 3, True))  # next step's code words prefetched
    return list(dict.fromkeys(out))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("-m", type=int, nargs="+", default=[512], help="prompt tokens (GEMM rows)")
    ap.add_argument("--quick", action="store_true", help="fewer tiles")
    args = ap.parse_args()
    model, loaded = None, None
    for path, m in ((p, m) for p in args.models for m in args.m):
        if loaded != path:
            model = None
            torch.cuda.empty_cache()
            model, loaded = load_model(GGUFFile(path), device="cuda"), path
        lins = decode_linears(model)
        calls, shapes = distinct_shapes(lins)
        print(f"\n{path}: M = {m}, {len(lins)} linears a step, {len(shapes)} shapes")
        print(f"{'type':5} {'N x K':>14} {'calls':>5} {'deq us':>7} {'cublas':>7} {'rule us':>8} "
              f"{'best us':>8} {'TFLOP/s':>7}  best tile")
        tot = Counter()
        for key, lin in shapes:
            t, n, k = key
            w = lin.packed
            x = torch.randn(m, k, device="cuda")
            cols = permuted_columns(w)
            xh = x.half()[:, cols]
            w16 = dequantize_fp16(w, permuted=True)
            ref = torch.matmul(xh, w16.T).float()
            t_deq = time_graph(lambda w=w, o=w16: dequantize_fp16(w, out=o, permuted=True), calls=5, reps=10)
            t_mm = time_graph(lambda a=xh, b=w16: torch.matmul(a, b.T), calls=5, reps=10)
            out = torch.empty(m, n, device="cuda")
            times, bad = {}, []
            for cfg in candidates(m, n, k, args.quick):
                try:
                    y = dequant_matmul(w, x, out=out, cols=cols, cfg=cfg)
                    torch.cuda.synchronize()
                except (triton.runtime.errors.OutOfResources, triton.compiler.errors.CompilationError,
                        RuntimeError) as e:  # a tile past the shared memory: skipped, named
                    bad.append(f"{tuple(cfg)} {type(e).__name__}")
                    continue
                err = ((y - ref).norm() / ref.norm()).item()
                if not err < 2e-3:
                    bad.append(f"{tuple(cfg)} WRONG {err:.1e}")
                    continue
                times[cfg] = time_graph(lambda cfg=cfg, w=w, x=x, out=out, cols=cols: dequant_matmul(
                    w, x, out=out, cols=cols, cfg=cfg),
                                        calls=5, reps=10)
            rule = gemm_config(m, n, k)
            best = min(times, key=times.get)
            flops = 2 * m * n * k
            print(f"{t.name:5} {n:>7}x{k:<6} {calls[key]:>5} {t_deq * 1e6:7.0f} {t_mm * 1e6:7.0f} "
                  f"{times.get(rule, float('nan')) * 1e6:8.0f} {times[best] * 1e6:8.0f} "
                  f"{flops / times[best] / 1e12:7.0f}  {tuple(best)}", flush=True)
            ranked = sorted(times, key=times.get)[:4]
            print("      top: " + "  ".join(f"{tuple(c)} {times[c] * 1e6:.0f}" for c in ranked))
            if bad:
                print("      skipped: " + "; ".join(bad))
            tot["dequant + cuBLAS"] += calls[key] * (t_deq + t_mm)
            tot["cuBLAS alone"] += calls[key] * t_mm
            tot["ours, rule"] += calls[key] * times.get(rule, float("nan"))
            tot["ours, best tiles"] += calls[key] * times[best]
        print("a prefill's linears: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in tot.items()))


if __name__ == "__main__":
    main()
