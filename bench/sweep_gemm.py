"""Time prefill's linears as the engine runs them (the weight dequantized to fp16 by
``dequantize_fp16``, then our ``matmul_f16``) under the launch rules and under other tiles
of each kernel, against cuBLAS on the same fp16 matrix; ``dequant_config`` and
``matmul_config`` are set from it.

    python bench/sweep_gemm.py MODEL.gguf [MODEL.gguf ...] [-m 512 ...]

For each (format, N, K) of the model's linears (fused q/k/v and gate/up as the engine runs
them): the dequantization's time and GB/s (packed bytes in, fp16 out), the matmul's time and
TFLOP/s, cuBLAS's, the best tiles, and the tiles that fail to compile or give a wrong
answer. Ends with the per-prefill total of each path. Measures only; needs a CUDA GPU.
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
from deimos.kernels.triton.matmul import MatmulConfig, matmul_config, matmul_f16
from deimos.models import load_model
from deimos.models.gpu.dequant import (
    DequantConfig,
    dequant_config,
    dequantize_fp16,
    permuted_columns,
)
from deimos.quant.triton.bench import time_graph


def matmul_candidates(m: int, n: int, k: int) -> list[MatmulConfig]:
    """Tiles of the fp16 matmul of the two-phase path (dequantize_fp16, then matmul_f16)."""
    out = [matmul_config(m, n, k), MatmulConfig(128, 128, 64, 8, 3), MatmulConfig(128, 256, 64, 8, 3),
           MatmulConfig(128, 128, 64, 4, 4), MatmulConfig(64, 128, 64, 4, 4), MatmulConfig(128, 64, 64, 4, 4),
           MatmulConfig(256, 128, 64, 8, 3), MatmulConfig(128, 128, 32, 4, 5)]
    if m <= 64:
        out += [MatmulConfig(16, 64, 128, 4, 4), MatmulConfig(32, 64, 64, 4, 4), MatmulConfig(64, 64, 64, 4, 4)]
    return list(dict.fromkeys(out))


def best_matmul(m: int, n: int, k: int, xh: torch.Tensor, w16: torch.Tensor,
                ref: torch.Tensor) -> tuple[float, MatmulConfig | None, float, list[str]]:
    """(best time, its tile, the rule's time, the tiles skipped) of matmul_f16(xh, w16)."""
    out = torch.empty(m, n, device="cuda")
    times, bad = {}, []
    for cfg in matmul_candidates(m, n, k):
        try:
            y = matmul_f16(xh, w16, out=out, cfg=cfg)
            torch.cuda.synchronize()
        except (triton.runtime.errors.OutOfResources, triton.compiler.errors.CompilationError,
                RuntimeError) as e:
            bad.append(f"mm{tuple(cfg)} {type(e).__name__}")
            continue
        err = ((y - ref).norm() / ref.norm()).item()
        if not err < 1e-3:
            bad.append(f"mm{tuple(cfg)} WRONG {err:.1e}")
            continue
        times[cfg] = time_graph(lambda cfg=cfg: matmul_f16(xh, w16, out=out, cfg=cfg), calls=5, reps=10)
    if not times:
        return float("nan"), None, float("nan"), bad
    best = min(times, key=times.get)
    return times[best], best, times.get(matmul_config(m, n, k), float("nan")), bad


DEQUANT_TILES = [DequantConfig(8, 128, 4), DequantConfig(4, 256, 4), DequantConfig(16, 64, 4),
                 DequantConfig(8, 256, 8), DequantConfig(16, 128, 8), DequantConfig(2, 512, 4),
                 DequantConfig(32, 32, 4), DequantConfig(4, 128, 2), DequantConfig(1, 256, 2)]


def best_dequant(w, w16: torch.Tensor) -> tuple[float, DequantConfig, float, list[str]]:
    """(best time, its tile, the rule's time, the tiles skipped) of the streaming fp16
    dequantization of w, each tile checked against the rule's output ``w16``."""
    times, bad = {}, []
    got = torch.empty_like(w16)
    cands = [dequant_config(w.n, w.k)] + DEQUANT_TILES
    for cfg in dict.fromkeys(cands):
        got.fill_(float("nan"))
        dequantize_fp16(w, out=got, permuted=True, cfg=cfg)
        err = ((got.float() - w16.float()).norm() / w16.float().norm()).item()
        if not err < 2e-3:
            bad.append(f"deq{tuple(cfg)} WRONG {err:.1e}")
            continue
        times[cfg] = time_graph(lambda cfg=cfg: dequantize_fp16(w, out=got, permuted=True, cfg=cfg),
                                calls=5, reps=10)
    best = min(times, key=times.get)
    print("      dequant tiles: " + "  ".join(f"{tuple(c)} {times[c] * 1e6:.0f}"
                                             for c in sorted(times, key=times.get)))
    return times[best], best, times.get(dequant_config(w.n, w.k), float("nan")), bad


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("-m", type=int, nargs="+", default=[512], help="prompt tokens (GEMM rows)")
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
        print(f"{'type':5} {'N x K':>14} {'calls':>5} {'deq us':>7} {'GB/s':>5} {'mm us':>7} {'TFLOP/s':>7} "
              f"{'cuBLAS':>7}  (rules; best tiles below)")
        tot = Counter()
        for key, lin in shapes:
            t, n, k = key
            w = lin.packed
            xh = torch.randn(m, k, device="cuda").half()[:, permuted_columns(w)]
            w16 = dequantize_fp16(w, permuted=True)
            ref = torch.matmul(xh, w16.T).float()
            t_deq = time_graph(lambda w=w, o=w16: dequantize_fp16(w, out=o, permuted=True), calls=5, reps=10)
            t_mm = time_graph(lambda a=xh, b=w16: torch.matmul(a, b.T), calls=5, reps=10)
            t_16, best16, t_16rule, bad16 = best_matmul(m, n, k, xh, w16, ref)
            t_dq, best_dq, _, bad_dq = best_dequant(w, w16)
            scratch = torch.empty_like(w16)
            t_copy = time_graph(lambda a=scratch, b=w16: a.copy_(b), calls=5, reps=10)
            del scratch
            moved = w.nbytes + 2 * n * k
            print(f"{t.name:5} {n:>7}x{k:<6} {calls[key]:>5} {t_deq * 1e6:7.0f} {moved / t_deq / 1e9:5.0f} "
                  f"{t_16rule * 1e6:7.0f} {2 * m * n * k / t_16rule / 1e12:7.0f} {t_mm * 1e6:7.0f}", flush=True)
            print(f"      fp16 matmul: best {tuple(best16)} {t_16 * 1e6:.0f} us")
            print(f"      dequant: best {tuple(best_dq)} {t_dq * 1e6:.0f} us ({moved / t_dq / 1e9:.0f} GB/s); "
                  f"torch's fp16 copy of the output {t_copy * 1e6:.0f} us ({4 * n * k / t_copy / 1e9:.0f} GB/s)")
            if bad16 + bad_dq:
                print("      skipped: " + "; ".join(bad16 + bad_dq))
            tot["ours (rules)"] += calls[key] * (t_deq + t_16rule)
            tot["ours (best tiles)"] += calls[key] * (t_dq + t_16)
            tot["our dequant + cuBLAS"] += calls[key] * (t_deq + t_mm)
            tot["cuBLAS alone"] += calls[key] * t_mm
        print("a prefill's linears: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in tot.items()))


if __name__ == "__main__":
    main()
