"""Where a turn's time to first token goes when most of its prompt is cached: for each context
length C, a C-token prompt is prefilled (its blocks stay in the prefix cache), then the same
prompt plus N new tokens is sent with max_tokens=1. Reports the request's wall time, the
engine steps' wall time, the kernels' GPU time by name (torch.profiler, CUPTI) and, beside
it, the host's time to render and tokenize an agent session turn of about C tokens.

    python bench/profile_prefix.py MODEL.gguf [--ctx 2048,8192,16384,30000] [-n 150] [--top 5]

A context of 0 profiles a fresh prompt of the N tokens alone (what a turn's time is held to).

A measurement, not a test. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deimos.bench.agent import request_body  # noqa: E402
from deimos.engine import LLM  # noqa: E402
from deimos.engine.request import Request  # noqa: E402
from deimos.kernels.sampling import SamplingParams  # noqa: E402
from deimos.server import tools  # noqa: E402

SESSION = Path(__file__).resolve().parent / "sessions" / "multi-turn.jsonl.gz"


def encode_times(llm: LLM) -> list[tuple[int, float]]:
    """(prompt tokens, ms to prepare, render and tokenize) for the multi-turn session's turns
    in order (the server's path, the tools as a field), every 8th reported: the tokenizer's
    cache holds the turns before, as in a served session."""
    turns = [json.loads(line) for line in gzip.open(SESSION, "rt")]
    style = tools.tool_call_style(llm.template.source, llm.tokenizer)
    out = []
    for i, turn in enumerate(turns):
        body = request_body(turn, "m")
        t0 = time.perf_counter()
        m2, tt = tools.prepare_chat(body["messages"], body.get("tools"), llm.template.source, style)
        ids = llm.encode_chat(m2, tools=tt)
        if i % 8 == 0:
            out.append((len(ids), (time.perf_counter() - t0) * 1e3))
    return out


def run(llm: LLM, ids: list[int]) -> tuple[float, float, int, int]:
    """(wall ms, steps' wall ms, steps, cached tokens) of ``ids`` with max_tokens=1, greedy."""
    eng = llm.engine
    req = Request(ids, 1, SamplingParams(temperature=0))
    t0 = time.perf_counter()
    eng.add(req)
    steps, in_steps = 0, 0.0
    while eng.has_work:
        s0 = time.perf_counter()
        eng.step()
        in_steps += time.perf_counter() - s0
        steps += 1
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3, in_steps * 1e3, steps, req.cached_tokens


def main() -> int:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--ctx", default="2048,8192,16384,30000")
    ap.add_argument("-n", type=int, default=150, help="new tokens after the cached prefix")
    ap.add_argument("--top", type=int, default=5, help="kernels listed a row")
    a = ap.parse_args()
    ctxs = [int(c) for c in a.ctx.split(",")]
    llm = LLM(a.model, device="cuda" if torch.cuda.is_available() else "cpu", n_ctx=max(ctxs) + a.n + 64)
    print("host: prompt tokens -> prepare + render + tokenize ms:",
          ", ".join(f"{n}: {ms:.1f}" for n, ms in encode_times(llm)))
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, llm.config.n_vocab, (max(ctxs) + a.n,), generator=g).tolist()
    run(llm, base[:300])  # warm
    print(f"\n| context | cached | new | request ms | steps ms | steps | kernels ms | top kernels (ms) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    for k, c in enumerate(ctxs):
        prompt = base[:c]
        if c:
            run(llm, prompt)  # its blocks stay cached
            run(llm, prompt + [(t * 13 + 5) % llm.config.n_vocab for t in range(a.n)])  # a hit, unprofiled
        else:  # a fresh prompt of the N new tokens alone (nothing of it cached), after one unprofiled
            run(llm, [(t * 17 + 3 + k) % llm.config.n_vocab for t in range(a.n)])
        ids = prompt + [(t * 7 + 11 + (0 if c else k)) % llm.config.n_vocab for t in range(a.n)]
        with torch_profile(activities=[ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU]) as prof:
            wall, in_steps, steps, cached = run(llm, ids)
        totals: dict[str, float] = defaultdict(float)
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                totals[ev.name[:40]] += getattr(ev, "device_time_total", 0.0) / 1e3
        top = sorted(totals.items(), key=lambda kv: -kv[1])[:a.top]
        print(f"| {c} | {cached} | {a.n} | {wall:.1f} | {in_steps:.1f} | {steps} | {sum(totals.values()):.1f} | "
              + "; ".join(f"{k} {v:.1f}" for k, v in top) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
