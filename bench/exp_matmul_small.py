"""Experiment (session 28): matmul_f16 on llama 8B's fp16 copies at decode batch sizes, each
shape alone (CUDA-event timing by triton.testing.do_bench), against torch's matmul (cuBLAS),
with the programs the launch rule gives. A measurement, not part of the engine.

    python bench/exp_matmul_small.py [--rows 4,16,64]
"""
import sys

import torch
import triton

from deimos.kernels.triton.matmul import SplitScratch, matmul_config, matmul_f16, split_count

SHAPES = [("q+k", 5120, 4096), ("v", 1024, 4096), ("o", 4096, 4096), ("gate+up", 28672, 4096),
          ("down", 4096, 14336), ("output", 128256, 4096)]
rows = [int(r) for r in (sys.argv[sys.argv.index("--rows") + 1] if "--rows" in sys.argv else "4,16,64").split(",")]
scratch = SplitScratch("cuda")
print("| rows | matrix | N x K | programs | matmul_f16 us | TB/s | splits | split us | TB/s | torch us | TB/s |")
print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
tot = {}
for m in rows:
    for name, n, k in SHAPES:
        w = torch.randn(n, k, device="cuda").half()
        x = torch.randn(m, k, device="cuda").half()
        out = torch.empty(m, n, device="cuda")
        cfg = matmul_config(m, n, k)
        progs = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
        ours = triton.testing.do_bench(lambda: matmul_f16(x, w, out=out), warmup=25, rep=200) * 1e3
        sp = split_count(progs, k, cfg.block_k, scratch.n_sm) if m <= 64 else 1
        split = triton.testing.do_bench(lambda: matmul_f16(x, w, out=out, scratch=scratch), warmup=25, rep=200) * 1e3
        ref = triton.testing.do_bench(lambda: torch.matmul(x, w.T), warmup=25, rep=200) * 1e3
        b = n * k * 2
        tot.setdefault(m, [0.0, 0.0, 0.0])
        times = 32 if name != "output" else 1
        tot[m][0] += ours * times
        tot[m][1] += split * times
        tot[m][2] += ref * times
        print(f"| {m} | {name} | {n}x{k} | {progs} | {ours:.1f} | {b / ours / 1e6:.2f} | {sp} | {split:.1f} | "
              f"{b / split / 1e6:.2f} | {ref:.1f} | {b / ref / 1e6:.2f} |", flush=True)
for m, (a, s_, b) in tot.items():
    print(f"rows {m}: a step's matmuls (32 layers + output) {a / 1e3:.2f} ms unsplit, {s_ / 1e3:.2f} ms "
          f"split, {b / 1e3:.2f} ms torch")
