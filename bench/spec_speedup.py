"""Speculative decoding's speed-up on an edit-style prompt: a real source file, then the
instruction to write it out again with one change, so that the answer copies what it read
(what a coding agent's edit turns do). The same model without and with speculation, greedy
(or with ``--sampling default``: the engine's default sampler, llama.cpp's, each run r seeded
r, so plain and speculative runs draw from the same distribution but not the same tokens),
the answer forced to N tokens (no stop token), each run R times after a warm-up; decode rate
= (N - 1) / (time of the last token - time of the first), so prefill is not in it.

    python bench/spec_speedup.py MODEL.gguf [--device cuda] [-n 256] [-r 3] [--methods ngram]
        [--file json/encoder.py] [--k 6] [--draft-model SMALLER.gguf] [--sampling default]

Prints per method: decode tokens/s (best of R, and the median), the speed-up over plain
decoding, drafts accepted / drafted, tokens per verification, and whether the tokens equal
the plain run's (greedy only: sampled answers differ by construction); then a markdown table.
A measurement, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deimos.engine import LLM
from deimos.engine.request import Request
from deimos.kernels.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)


def prompt_text(rel: str) -> str:
    src = (Path(sysconfig.get_paths()["stdlib"]) / rel).read_text()
    return (f"Here is the file {rel}:\n\n{src}\n\nWrite the same file out again in full, "
            f"with the function names unchanged and one extra blank line at its end:\n\n")


def one(llm: LLM, ids: list[int], n: int, sampling: SamplingParams = GREEDY) -> tuple[list[int], float]:
    """(the answer's tokens, seconds from its first token to its last)."""
    eng = llm.engine
    req = Request(list(ids), n, sampling)  # no stop ids: forced to n tokens
    eng.add(req)
    first = last = None
    while eng.has_work:
        for out in eng.step():
            if out.error is not None:
                raise out.error
            t = time.perf_counter()
            first = t if first is None else first
            last = t
    return req.output_ids, last - first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("-n", type=int, default=256, help="answer tokens")
    ap.add_argument("-r", type=int, default=3, help="timed runs a method")
    ap.add_argument("--methods", default="ngram")
    ap.add_argument("--file", default="json/encoder.py", help="a stdlib file, the prompt's source")
    ap.add_argument("--k", type=int, default=None, help="--spec-k (default: the engine's)")
    ap.add_argument("--draft-model", help="the draft method's model (same vocabulary)")
    ap.add_argument("--sampling", choices=("greedy", "default"), default="greedy",
                    help="greedy, or the engine's default sampler (run r seeded r)")
    args = ap.parse_args()
    greedy = args.sampling == "greedy"
    text = prompt_text(args.file)
    rows = []
    plain_ids = plain_rate = None
    for method in ["plain", *args.methods.split(",")]:
        kw = {} if method == "plain" else {"speculative": method}
        if method != "plain" and args.k is not None:
            kw["spec_k"] = args.k
        if method == "draft":
            kw["draft_model"] = args.draft_model
        llm = LLM(args.model, device=args.device, n_ctx=8192, max_seqs=4, **kw)
        ids = llm.encode_raw(text)
        one(llm, ids, min(32, args.n))  # warm-up: compiles, graphs
        s0 = llm.engine.stats()
        rates, out = [], None
        for r in range(args.r):
            out, dt = one(llm, ids, args.n, GREEDY if greedy else SamplingParams(seed=r))
            rates.append((len(out) - 1) / dt)
        st = llm.engine.stats()
        drafted, accepted = st.spec_drafted - s0.spec_drafted, st.spec_accepted - s0.spec_accepted
        verifies = st.spec_verify_steps - s0.spec_verify_steps
        if method == "plain":
            plain_ids, plain_rate = out, max(rates)
        same = out == plain_ids
        agree = next((i for i, (a, b) in enumerate(zip(out, plain_ids)) if a != b), len(out))
        row = dict(method=method, prompt=len(ids), best=max(rates), median=statistics.median(rates),
                   speedup=max(rates) / plain_rate, drafted=drafted // args.r, accepted=accepted // args.r,
                   per_verify=(accepted / verifies + 1) if verifies else 0.0, same=same, agree=agree)
        rows.append(row)
        print(row, flush=True)
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(f"\n{args.model}, {args.device}, prompt {rows[0]['prompt']} tokens ({args.file}), "
          f"{args.n}-token {args.sampling} answers, best of {args.r}")
    print("| method | decode tok/s best | median | speed-up | drafts accepted / drafted a run "
          "| tokens a verification | tokens equal plain |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        same = ("yes" if r["same"] else f"first {r['agree']} of {args.n}") if greedy else "(sampled)"
        print(f"| {r['method']} | {r['best']:.1f} | {r['median']:.1f} | {r['speedup']:.2f}x | "
              f"{r['accepted']} / {r['drafted']} | {r['per_verify']:.2f} | {same} |")


if __name__ == "__main__":
    main()
