"""Two `deimos bench agent --json` reports of one session side by side: wall time, the
token-weighted prefill and decode rates and their ratios, and whether the answers' text agrees
turn by turn (the first turn that differs, and where). For speculation against none on one
server build: with greedy sampling the answers must agree and only the speed may differ.

    python bench/agent_compare.py BASE.json OTHER.json [--metrics OTHER_METRICS.txt]

``--metrics``: the other server's /metrics text, for its speculation counters.
"""

from __future__ import annotations

import argparse
import json
import re
import sys


def first_difference(a: list[dict], b: list[dict]) -> str | None:
    for x, y in zip(a, b):
        if x.get("text") != y.get("text"):
            ta, tb = x.get("text") or "", y.get("text") or ""
            at = next((i for i, (p, q) in enumerate(zip(ta, tb)) if p != q), min(len(ta), len(tb)))
            return (f"turn {x['turn']} differs at character {at}: "
                    f"{ta[max(0, at - 30):at + 30]!r} / {tb[max(0, at - 30):at + 30]!r}")
    if len(a) != len(b):
        return f"{len(a)} turns against {len(b)}"
    return None


def spec_counters(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(deimos_(?:spec\w*|tokens_per_step))(\{[^}]*\})?\s+([0-9.eE+-]+)$", line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base")
    ap.add_argument("other")
    ap.add_argument("--metrics", help="the other server's /metrics text")
    a = ap.parse_args()
    r = [json.load(open(p)) for p in (a.base, a.other)]
    s = [x["summary"] for x in r]
    print("| run | turns ok | wall s | prefill tok/s | decode tok/s | generated tok |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, x in zip((a.base, a.other), s):
        print(f"| {name} | {x['ok']}/{x['turns']} | {x['wall_s']:.2f} | {x['prefill_tps'] or 0:.1f} "
              f"| {x['decode_tps'] or 0:.1f} | {x['completion_tokens']} |")
    if s[0]["decode_tps"] and s[1]["decode_tps"]:
        print(f"decode {s[1]['decode_tps'] / s[0]['decode_tps']:.2f}x, wall "
              f"{s[0]['wall_s'] / s[1]['wall_s']:.2f}x (other against base)")
    diff = first_difference(r[0]["turns"], r[1]["turns"])
    same = sum(x.get("text") == y.get("text") for x, y in zip(r[0]["turns"], r[1]["turns"]))
    print(f"answers: {same} of {len(r[0]['turns'])} turns the same text"
          + (f"; {diff}" if diff else " (all)"))
    if a.metrics:
        for k, v in spec_counters(open(a.metrics).read()).items():
            print(f"{k} {v:g}")
    return 0 if diff is None else 1


if __name__ == "__main__":
    sys.exit(main())
