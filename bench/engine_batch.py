"""Throughput of the engine itself (no HTTP): C requests of P random prompt tokens and G
output tokens each (no stop tokens), submitted at once and decoded together, for each C; with
llama.cpp's default sampling (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05) and greedy.

    python bench/engine_batch.py MODEL.gguf [-c 1,16,64] [-p 512] [-n 128] [--ctx 1024]
        [--max-batch-tokens N]

Prints per C: wall time, output tokens/s in all, and the mean time to the first token; then a
markdown table. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from deimos.engine import LLM
from deimos.engine.request import Request
from deimos.kernels.sampling import SamplingParams


def run(llm: LLM, c: int, p: int, n: int, sampling: SamplingParams, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    v = llm.config.n_vocab
    reqs = [Request(torch.randint(0, v, (p,), generator=g).tolist(), n, sampling) for _ in range(c)]
    eng = llm.engine
    seqs = [eng.add(r) for r in reqs]
    first: dict[int, float] = {}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while eng.has_work:
        for out in eng.step():
            if out.error is not None:
                raise out.error
            first.setdefault(out.seq.id, time.perf_counter() - t0)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    made = sum(len(r.output_ids) for r in reqs)
    assert all(s.finished for s in seqs) and eng.blocks.n_used == 0
    return {"c": c, "wall_s": wall, "tokens": made, "tok_s": made / wall,
            "ttft_mean_s": sum(first.values()) / len(first), "steps": eng.steps}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("-c", "--concurrency", default="1,16,64")
    ap.add_argument("-p", "--prompt", type=int, default=512)
    ap.add_argument("-n", "--gen", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--max-seqs", type=int, default=64)
    ap.add_argument("--max-batch-tokens", type=int, default=None,
                    help="tokens a step computes (default: the engine's, 2048)")
    ap.add_argument("--compiles", action="store_true",
                    help="list the Triton kernel variants first built in each phase")
    ap.add_argument("--compiles-all", action="store_true", help="with --compiles: the lists uncut")
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    trace = None
    if args.compiles:
        from compile_trace import CompileTrace

        trace = CompileTrace()
        trace.install()
        trace.phase = "load"
    extra = {} if args.max_batch_tokens is None else {"max_batch_tokens": args.max_batch_tokens}
    llm = LLM(args.model, n_ctx=args.ctx, device="cuda", max_seqs=args.max_seqs, **extra)
    print(f"pool: {llm.engine.pool.n_blocks} blocks of {llm.engine.pool.block_size}, "
          f"{llm.engine.pool.nbytes / 2**30:.1f} GiB", flush=True)
    if trace:
        trace.phase = "warm-up (2 requests)"
    run(llm, 2, 64, 8, SamplingParams(), 0)  # warm-up (every graph was captured at load)
    rows = []
    for k, (name, sp) in enumerate((("default", SamplingParams(seed=1)),
                                    ("greedy", SamplingParams(temperature=0)))):
        for c in levels:  # prompts of their own (no prefix-cache hit across runs)
            if trace:
                trace.phase = f"{name} {c}"
            r = run(llm, c, args.prompt, args.gen, sp, 1000 * k + c)
            r["sampling"] = name
            rows.append(r)
            print(r, flush=True)
    print("\n| sampling | concurrency | output tok/s | wall s | mean TTFT s |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['sampling']} | {r['c']} | {r['tok_s']:.0f} | {r['wall_s']:.2f} | {r['ttft_mean_s']:.3f} |")
    if trace:
        print("\n" + trace.table(width=None if args.compiles_all else 1500))
    return 0


if __name__ == "__main__":
    sys.exit(main())
