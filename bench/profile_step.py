"""Which kernels a decode step's GPU time goes to, at a batch: B requests decoded together,
torch.profiler (CUPTI: the kernels inside the replayed graphs too) over ``--steps`` decode steps
once every sequence decodes; the kernels' GPU time summed by name, largest first, against the
steps' wall time.

    python bench/profile_step.py MODEL.gguf [-b 1,16] [--steps 20] [--ctx 1024] [-p 512]

A measurement, not a test. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deimos.engine import LLM  # noqa: E402
from deimos.engine.request import Request  # noqa: E402
from deimos.kernels.sampling import SamplingParams  # noqa: E402


def profile(llm: LLM, b: int, steps: int, prompt: int, greedy: bool, top: int = 18) -> None:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    eng = llm.engine
    g = torch.Generator().manual_seed(b)
    sp = SamplingParams(temperature=0) if greedy else SamplingParams(seed=3)
    reqs = [Request(torch.randint(0, llm.config.n_vocab, (prompt,), generator=g).tolist(), steps + 40, sp)
            for _ in range(b)]
    seqs = [eng.add(r) for r in reqs]
    while any(len(r.output_ids) < 8 for r in reqs):  # every sequence decoding, graphs chained
        eng.step()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        n0 = sum(len(r.output_ids) for r in reqs)
        while sum(len(r.output_ids) for r in reqs) - n0 < steps * b:
            eng.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    made = sum(len(r.output_ids) for r in reqs) - n0
    for s in seqs:
        eng.cancel(s)
    while eng.has_work:
        eng.step()
    totals = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            e = totals[ev.name[:60]]
            e[0] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            e[1] += 1
    gpu = sum(v[0] for v in totals.values()) / 1e3  # ms
    n_steps = made / b
    print(f"\nB={b} {'greedy' if greedy else 'default'}: {n_steps:.0f} steps in {wall * 1e3:.1f} ms = "
          f"{wall * 1e3 / n_steps:.3f} ms a step; kernels {gpu / n_steps:.3f} ms a step")
    print("| kernel | us a step | launches a step |\n|---|---:|---:|")
    for name, (us, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"| {name} | {us / n_steps:.1f} | {n / n_steps:.1f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("-b", "--batches", default="1,16")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("-p", "--prompt", type=int, default=512)
    ap.add_argument("--greedy", action="store_true")
    ap.add_argument("--top", type=int, default=24, help="kernels listed")
    ap.add_argument("--dense-weights", default="auto", choices=("auto", "on", "off"))
    args = ap.parse_args()
    levels = [int(x) for x in args.batches.split(",")]
    llm = LLM(args.model, n_ctx=args.ctx, device="cuda", max_seqs=max(levels),
              dense_weights=args.dense_weights)
    for b in levels:
        profile(llm, b, args.steps, args.prompt, args.greedy, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
