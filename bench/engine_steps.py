"""Where the engine's time goes at a concurrency: every step's kind (decode graph, chained
decode graph, prefill graph, eager), its rows and tokens, its GPU time (CUDA events around the
runner's launch, in stream order) and the wall time between steps; summed per kind, against the
run's wall time (the rest is host time the GPU waited for).

    python bench/engine_steps.py MODEL.gguf [-c 16] [-p 512] [-n 128] [--greedy]

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


class StepClock:
    """Wraps a runner's launch methods: a pair of CUDA events around each launch."""

    def __init__(self, runner) -> None:
        self.records: list[tuple[str, int, torch.cuda.Event, torch.cuda.Event, float]] = []
        self._run, self._chained = runner.run, runner.run_chained
        runner.run = self.run
        runner.run_chained = self.run_chained

    def _timed(self, fn, arg, kind_of):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        a.record()
        res = fn(arg)
        b.record()
        host = time.perf_counter() - t0
        self.records.append((kind_of(res), len(res.wanting), a, b, host))
        return res

    def run(self, plan):
        def kind(res):
            g = res.graph
            if g is None:
                return f"eager ({'mixed' if plan.decode and plan.prefill else 'prefill' if plan.prefill else 'decode'})"
            return "decode graph" if g.decode else "prefill graph"
        return self._timed(self._run, plan, kind)

    def run_chained(self, seqs):
        return self._timed(self._chained, seqs, lambda res: "decode graph, chained")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("-c", "--concurrency", type=int, default=16)
    ap.add_argument("-p", "--prompt", type=int, default=512)
    ap.add_argument("-n", "--gen", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--greedy", action="store_true")
    ap.add_argument("--dense-weights", default="auto", choices=("auto", "on", "off"))
    ap.add_argument("--max-seqs", type=int, default=None, help="the engine's (default: max(64, C))")
    ap.add_argument("--experts", default="auto", choices=("auto", "gpu", "cpu"))
    ap.add_argument("--expert-cache-gib", type=float, default=None)
    ap.add_argument("--stagger", type=int, default=0,
                    help="submit the requests this many steps apart (a serving load), not at once")
    args = ap.parse_args()
    llm = LLM(args.model, n_ctx=args.ctx, device="cuda", max_seqs=args.max_seqs or max(64, args.concurrency),
              dense_weights=args.dense_weights, experts=args.experts,
              expert_cache_gib=args.expert_cache_gib)
    print(f"dense weights: {llm.dense}", flush=True)
    if llm.offload is not None:
        print(f"expert offload: {llm.offload.cache.n_slots} slots a layer, "
              f"{llm.offload.cache.nbytes / 2**30:.2f} GiB, CPU backend {llm.offload.cpu.backend(0)}", flush=True)
    eng = llm.engine
    sp = SamplingParams(temperature=0) if args.greedy else SamplingParams(seed=1)
    g = torch.Generator().manual_seed(7)
    v = llm.config.n_vocab

    def batch(c):
        return [Request(torch.randint(0, v, (args.prompt,), generator=g).tolist(), args.gen, sp)
                for _ in range(c)]

    def drive(reqs):
        pending = list(reqs)
        steps = 0
        while pending or eng.has_work:
            if pending and (args.stagger == 0 or steps % args.stagger == 0):
                take = len(pending) if args.stagger == 0 else 1
                for r in pending[:take]:
                    eng.add(r)
                pending = pending[take:]
            for out in eng.step():
                if out.error is not None:
                    raise out.error
            steps += 1

    drive(batch(args.concurrency))  # warm-up: the same load once (every kernel of its shapes compiled)
    clock = StepClock(eng.runner)
    reqs = batch(args.concurrency)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    drive(reqs)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    tokens = sum(len(r.output_ids) for r in reqs)
    per = defaultdict(lambda: [0, 0, 0.0, 0.0])
    for kind, rows, a, b, host in clock.records:
        e = per[kind]
        e[0] += 1
        e[1] += rows
        e[2] += a.elapsed_time(b) / 1e3
        e[3] += host
    gpu = sum(e[2] for e in per.values())
    print(f"C={args.concurrency} P={args.prompt} N={args.gen} {'greedy' if args.greedy else 'default'}: "
          f"{tokens} tokens in {wall:.3f} s = {tokens / wall:.0f} tok/s; GPU busy {gpu:.3f} s "
          f"({gpu / wall:.0%}), {len(clock.records)} launches")
    if llm.offload is not None:
        print(f"expert cache after the run: {llm.offload.numbers()}")
    print("| step kind | count | rows | GPU s | GPU ms a step | host launch ms a step |\n|---|---:|---:|---:|---:|---:|")
    for kind, (n, rows, gs, hs) in sorted(per.items()):
        print(f"| {kind} | {n} | {rows} | {gs:.3f} | {gs / n * 1e3:.2f} | {hs / n * 1e3:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
