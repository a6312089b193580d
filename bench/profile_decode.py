"""Where a decode step's time goes: per-kernel GPU time of one-token steps (torch.profiler
over eager steps: the same kernels the graph replays), against the replayed graph's time per
token (each matrix's GEMV alone against its bytes: bench/sweep_gemv.py).

    python bench/profile_decode.py MODEL.gguf [--ctx 512] [--steps 8] [--prefill N [--own-gemm]]

Measures only; prints a table. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import torch

from deimos.gguf import GGUFFile
from deimos.models import load_model
from deimos.models.batch import Batch
from deimos.runtime.graph import DecodeGraph
from deimos.runtime.kv_cache import KVCache


def profile_prefill(model, n: int) -> None:
    """Wall time of one n-token prefill against the sum of its kernels' GPU time: a gap
    means the host (launch overhead), not the GPU, sets the pace."""
    import time

    cfg = model.config
    kv = KVCache(cfg, n, device="cuda")
    tokens = torch.randint(0, cfg.n_vocab, (n,), device="cuda")
    batch = Batch(tokens, torch.arange(n, device="cuda"), kv)
    for _ in range(2):
        kv.truncate(0)
        model.forward(batch)
    torch.cuda.synchronize()
    kv.truncate(0)
    t0 = time.perf_counter()
    model.forward(batch)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    kv.truncate(0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        model.forward(batch)
        torch.cuda.synchronize()
    per = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name][0] += 1
            per[e.name][1] += e.device_time_total
    gpu = sum(v[1] for v in per.values())
    launches = sum(v[0] for v in per.values())
    print(f"\nprefill {n}: wall {wall * 1e3:.1f} ms ({n / wall:.0f} t/s); kernels {gpu / 1e3:.1f} ms "
          f"in {launches} launches")
    for name, (c, t) in sorted(per.items(), key=lambda kv_: -kv_[1][1])[:10]:
        print(f"  {name[:60]:60} {c:5d} {t / 1e3:8.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--ctx", type=int, default=512, help="tokens in the cache while timing")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prefill", type=int, default=0, help="also profile one prefill of this many tokens")
    args = ap.parse_args()
    f = GGUFFile(args.model)
    model = load_model(f, device="cuda")
    cfg = model.config
    kv = KVCache(cfg, args.ctx + 64, device="cuda")
    prompt = torch.randint(0, cfg.n_vocab, (args.ctx,), device="cuda")
    model.forward(Batch(prompt, torch.arange(args.ctx, device="cuda"), kv))

    def eager_step() -> None:
        pos = torch.tensor([kv.length], device="cuda")
        model.forward(Batch(torch.tensor([1], device="cuda"), pos, kv))

    for _ in range(2):
        eager_step()
    kv.truncate(args.ctx)
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(args.steps):
            eager_step()
        torch.cuda.synchronize()
    kv.truncate(args.ctx)
    per = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name][0] += 1
            per[e.name][1] += e.device_time_total
    total = sum(v[1] for v in per.values()) / args.steps

    graph = DecodeGraph(model, kv)
    graph.step(1)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(32):
        graph.step(1)
    b.record()
    b.synchronize()
    step_us = a.elapsed_time(b) * 1e3 / 32
    kv.truncate(args.ctx)

    print(f"\n{Path(f.path).name}: ctx {args.ctx}; graph replay {step_us:.0f} us/token "
          f"({1e6 / step_us:.0f} t/s); kernels alone {total:.0f} us/token")
    print(f"{'kernel':60} {'calls/tok':>9} {'us/tok':>8} {'share':>6}")
    for name, (n, t) in sorted(per.items(), key=lambda kv_: -kv_[1][1])[:14]:
        print(f"{name[:60]:60} {n / args.steps:9.1f} {t / args.steps:8.1f} {t / args.steps / total:6.1%}")

    if args.prefill:
        profile_prefill(model, args.prefill)


if __name__ == "__main__":
    main()
