"""Time the float-weight linear (fp16 ``[N, K]`` weights): our tensor-core matmul
(``matmul_f16``) under its rule and a few tiles against torch.matmul (cuBLAS), at llama 8B's
shapes and a few row counts. Measures only; needs a CUDA GPU.

    python bench/sweep_dense.py [-m 1 16 128 512]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from sweep_gemm import matmul_candidates

from deimos.kernels.triton.matmul import (
    GemvConfig,
    MatmulConfig,
    gemv_config,
    gemv_f16,
    matmul_config,
    matmul_f16,
)
from deimos.quant.triton.bench import time_graph

GEMV_TILES = [GemvConfig(8, 256, 4), GemvConfig(4, 512, 4), GemvConfig(16, 128, 4), GemvConfig(8, 512, 8),
              GemvConfig(2, 1024, 4), GemvConfig(16, 256, 8), GemvConfig(4, 256, 2), GemvConfig(1, 1024, 4),
              GemvConfig(32, 128, 8)]
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", type=int, nargs="+", default=[1, 16, 128, 512])
    args = ap.parse_args()
    print(f"{'M':>4} {'N x K':>12} {'cublas us':>9} {'rule us':>8} {'best us':>8} {'GB/s':>6}  best tile")
    for m in args.m:
        for n, k in SHAPES:
            x = torch.randn(m, k, device="cuda").half()
            w = torch.randn(n, k, device="cuda").half()
            ref = torch.matmul(x, w.T).float()
            out = torch.empty(m, n, device="cuda")
            t_cublas = time_graph(lambda x=x, w=w: torch.matmul(x, w.T), calls=5, reps=10)
            tiles = matmul_candidates(m, n, k)
            if m <= 16:
                tiles += [MatmulConfig(16, 32, 256, 4, 3), MatmulConfig(16, 64, 256, 4, 3),
                          MatmulConfig(16, 32, 128, 2, 4), MatmulConfig(16, 16, 256, 2, 4)]
            times = {}
            for cfg in dict.fromkeys(tiles):
                try:
                    y = matmul_f16(x, w, out=out, cfg=cfg)
                except Exception as e:  # noqa: BLE001 - a tile that does not fit is skipped
                    print(f"      skipped {tuple(cfg)}: {type(e).__name__}")
                    continue
                if not ((y - ref).norm() / ref.norm()).item() < 1e-3:
                    print(f"      WRONG {tuple(cfg)}")
                    continue
                times[cfg] = time_graph(lambda cfg=cfg, x=x, w=w, o=out: matmul_f16(x, w, out=o, cfg=cfg),
                                        calls=5, reps=10)
            if m == 1:  # the float-weight decode's own kernel
                for cfg in dict.fromkeys([gemv_config(n, k), *GEMV_TILES]):
                    y = gemv_f16(x, w, out=out, cfg=cfg)
                    if not ((y - ref).norm() / ref.norm()).item() < 1e-3:
                        print(f"      WRONG {tuple(cfg)}")
                        continue
                    times[cfg] = time_graph(lambda cfg=cfg, x=x, w=w, o=out: gemv_f16(x, w, out=o, cfg=cfg),
                                            calls=5, reps=10)
                print("      gemv tiles: " + "  ".join(f"{tuple(c)} {times[c] * 1e6:.1f}"
                                                       for c in sorted(times, key=times.get)
                                                       if isinstance(c, GemvConfig)))
            best = min(times, key=times.get)
            rule = times.get(gemv_config(n, k) if m == 1 else matmul_config(m, n, k), float("nan"))
            print(f"{m:>4} {n:>6}x{k:<5} {t_cublas * 1e6:9.1f} {rule * 1e6:8.1f} {times[best] * 1e6:8.1f} "
                  f"{2 * n * k / times[best] / 1e9:6.0f}  {tuple(best)}", flush=True)


if __name__ == "__main__":
    main()
