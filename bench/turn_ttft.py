"""A conversation's second turn against a fresh prompt of its new tokens: the time to first
token of turn 2 of a C-token conversation (turn 1: a C-token prompt and an A-token answer;
turn 2: all of that plus N new tokens), against the same for a prompt of the N new tokens
alone (no cache hit). On a hybrid model turn 2 restores the recurrent-state snapshot at the
last block boundary the conversation reached and prefills only past it.

    python bench/turn_ttft.py MODEL.gguf [--ctx 20000] [-a 64] [-n 150] [-r 3]

Times are the request's wall time (add to first token, max_tokens=1, greedy), best and median
of ``-r`` conversations (each with its own random tokens) after a warm-up. A measurement, not
a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deimos.engine import LLM  # noqa: E402
from deimos.engine.request import Request  # noqa: E402
from deimos.kernels.sampling import SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0)


def first_token(llm: LLM, ids: list[int]) -> tuple[float, int]:
    """(ms from add to the first token, tokens served from the cache) of ``ids``."""
    eng = llm.engine
    req = Request(ids, 1, GREEDY)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    eng.add(req)
    while eng.has_work:
        eng.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3, req.cached_tokens


def answer(llm: LLM, ids: list[int], n: int) -> list[int]:
    eng = llm.engine
    req = Request(ids, n, GREEDY)
    eng.add(req)
    while eng.has_work:
        eng.step()
    return list(req.output_ids)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--ctx", type=int, default=20000)
    ap.add_argument("-a", type=int, default=64, help="turn 1's answer tokens")
    ap.add_argument("-n", type=int, default=150, help="turn 2's new tokens")
    ap.add_argument("-r", type=int, default=3)
    a = ap.parse_args()
    llm = LLM(a.model, device="cuda", n_ctx=a.ctx + a.a + a.n + 64)
    vocab = llm.config.n_vocab
    g = torch.Generator().manual_seed(0)

    def rand(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    first_token(llm, rand(300))  # warm-up (graphs, kernels)
    first_token(llm, rand(a.n))
    turn2, fresh, cached = [], [], []
    for _ in range(a.r):
        prompt = rand(a.ctx)
        t1, _ = first_token(llm, prompt)  # turn 1's prompt (its time, for the record)
        out = answer(llm, prompt, a.a)  # the same prompt from the cache, then its answer
        ms, hit = first_token(llm, prompt + out + rand(a.n))
        turn2.append(ms)
        cached.append(hit)
        fresh.append(first_token(llm, rand(a.n))[0])
        print(f"turn 1 prompt {a.ctx} tokens: {t1:.1f} ms; turn 2 ({a.ctx + len(out) + a.n} tokens,"
              f" {hit} cached): {ms:.1f} ms; fresh {a.n} tokens: {fresh[-1]:.1f} ms")
    best, med = min(turn2), statistics.median(turn2)
    fb, fm = min(fresh), statistics.median(fresh)
    print(f"\n| conversation | new tokens | cached (median) | turn 2 TTFT ms best / median | "
          f"fresh new-token prompt ms best / median | ratio (medians) |")
    print("|---:|---:|---:|---:|---:|---:|")
    print(f"| {a.ctx} + {a.a} | {a.n} | {int(statistics.median(cached))} | {best:.1f} / {med:.1f} | "
          f"{fb:.1f} / {fm:.1f} | {med / fm:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
