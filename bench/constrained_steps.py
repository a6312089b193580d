"""What rows whose choice needs their last token cost a batch, in the engine's own loop (no
HTTP): P plain requests and C JSON-constrained ones (a schema of >= 512 short strings, as
`deimos bench serve --constrained`), or with `--penalized` C requests with a presence penalty
instead, decoded together from 512-token prompts, default sampling, A answers' tokens; each
setting run twice, the second reported. Per run: the plain rows' tokens a second, the others'
(each), the steps' wall time (p50 / p95, what the plain rows wait between tokens) and the
passenger rows. `--defer` runs each setting with EngineConfig.defer_rows off and on.

    python bench/constrained_steps.py MODEL.gguf [-P 15] [-C 1] [-A 128] [--penalized] [--defer]

A measurement, not a test (`--device cpu`: a dry run of the loop; nothing chains there).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deimos.bench.serve_client import LONG_JSON_SCHEMA  # noqa: E402
from deimos.engine import LLM  # noqa: E402
from deimos.engine.request import Request  # noqa: E402
from deimos.kernels.sampling import SamplingParams  # noqa: E402
from deimos.server.params import schema_constraint  # noqa: E402


def run(llm: LLM, plain: int, constrained: int, answer: int, penalized: bool) -> dict[str, float]:
    eng = llm.engine
    prompt = [(7 * i + 3) % llm.config.n_vocab for i in range(511)]
    reqs = [Request(prompt + [i], answer, SamplingParams(seed=i), frozenset())
            for i in range(plain)]
    if penalized:
        grammar = [Request(prompt + [plain + i], answer,
                           SamplingParams(seed=plain + i, presence_penalty=0.5), frozenset())
                   for i in range(constrained)]
    else:
        grammar = [Request(prompt + [plain + i], answer, SamplingParams(seed=plain + i),
                           llm.stop_ids,
                           logits_processors=[schema_constraint(LONG_JSON_SCHEMA, llm, "schema")])
                   for i in range(constrained)]
    for r in reqs + grammar:
        eng.add(r)
    passengers = eng.passenger_rows
    while any(not r.output_ids for r in reqs):  # the prompts first
        eng.step()
    steps = []
    t0 = time.perf_counter()
    n0 = sum(len(r.output_ids) for r in reqs)
    g0 = sum(len(r.output_ids) for r in grammar)
    while eng.has_work:
        a = time.perf_counter()
        eng.step()
        steps.append(time.perf_counter() - a)
        if all(len(r.output_ids) >= answer for r in reqs) and grammar:
            t_plain = time.perf_counter() - t0
            for r in grammar:  # the plain rows are done: the rest is the constrained rows alone
                r.max_tokens = len(r.output_ids) + 1
            grammar_tokens = sum(len(r.output_ids) for r in grammar) - g0
            break
    else:
        t_plain = time.perf_counter() - t0
        grammar_tokens = sum(len(r.output_ids) for r in grammar) - g0
    while eng.has_work:
        eng.step()
    steps.sort()
    return {"plain_tps": (sum(len(r.output_ids) for r in reqs) - n0) / t_plain,
            "grammar_tps": grammar_tokens / t_plain if constrained else 0.0,
            "step_p50_ms": 1e3 * statistics.median(steps),
            "step_p95_ms": 1e3 * steps[int(0.95 * (len(steps) - 1))],
            "passengers": eng.passenger_rows - passengers}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("-P", "--plain", type=int, default=15)
    ap.add_argument("-C", "--constrained", type=int, default=1)
    ap.add_argument("-A", "--answer", type=int, default=128)
    ap.add_argument("--penalized", action="store_true",
                    help="the C rows have a presence penalty instead of a JSON grammar")
    ap.add_argument("--defer", action="store_true", help="also with defer_rows on")
    ap.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a dry run)")
    args = ap.parse_args()
    kind = "penalized" if args.penalized else "constrained"
    print(f"| defer_rows | {kind} | plain tok/s | {kind} tok/s (each) | step p50 ms "
          "| step p95 ms | passenger rows |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for defer in (False, True) if args.defer else (False,):
        llm = LLM(args.model, device=args.device, n_ctx=2048, defer_rows=defer)
        for c in (0, args.constrained):
            for rep in range(2):
                r = run(llm, args.plain, c, args.answer, args.penalized)
            each = r["grammar_tps"] / c if c else 0.0
            print(f"| {'on' if defer else 'off'} | {c} | {r['plain_tps']:.0f} | {each:.0f} | "
                  f"{r['step_p50_ms']:.2f} | {r['step_p95_ms']:.2f} | {r['passengers']} |",
                  flush=True)
        del llm
    return 0


if __name__ == "__main__":
    sys.exit(main())
