"""Tiles, warps, pipeline stages and key splits of the split-K decode attention
(kernels.triton.decode_attention) over a paged cache at long contexts: B rows, each at
position P, their keys in shuffled 16-token blocks of a table as wide as a server's context
(``--width``, the captured graph's: it sets the rule's split count). For each configuration
(keys a tile, warps, stages; splits: the rule's, half and twice it) the time of one call
(split and combine) and the K/V bytes it reads per second, against the rule's output.

Timing: CUDA-graph replay (quant.triton.bench.time_graph) cycling over ``--layers`` separate
K/V pools (a decode step reads each layer's cache from memory, not L2), median of 10 replays.

    python bench/sweep_decode_attention.py [--heads 32,8,128] [--pos 4096,16384,32768] [-b 1]

Measures only; prints a table. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deimos.kernels.triton.decode_attention import (  # noqa: E402
    DecodeConfig,
    decode_attention,
    decode_config,
)
from deimos.quant.triton.bench import time_graph  # noqa: E402

BLOCK = 16


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", default="32,8,128", help="Hq,Hkv,D")
    ap.add_argument("--pos", default="4096,16384,32768")
    ap.add_argument("-b", type=int, default=1, help="rows (sequences)")
    ap.add_argument("--width", type=int, default=40960, help="the table's keys (n_ctx)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tiles", default="32,64,128")
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--stages", default="2,3,4")
    ap.add_argument("--budget", type=float, default=240.0, help="seconds; stop sweeping after")
    a = ap.parse_args()
    hq, hkv, d = (int(x) for x in a.heads.split(","))
    positions = [int(x) for x in a.pos.split(",")]
    t0 = time.perf_counter()
    g = torch.Generator(device="cuda").manual_seed(0)
    n_blocks = a.width // BLOCK
    slots = (a.b * n_blocks + 8) * BLOCK
    pools = [(torch.randn(slots, hkv, d, device="cuda", generator=g, dtype=torch.float16),
              torch.randn(slots, hkv, d, device="cuda", generator=g, dtype=torch.float16))
             for _ in range(a.layers)]  # fmt: skip
    table = (torch.randperm(a.b * n_blocks + 8, device="cuda", generator=g)[: a.b * n_blocks]
             .to(torch.int32).view(a.b, n_blocks).contiguous())  # fmt: skip
    q = torch.randn(a.b, hq, d, device="cuda", generator=g, dtype=torch.float16)
    scale = d**-0.5
    rule = decode_config(a.width, a.b, hkv, d)
    print(f"heads {hq}/{hkv}, D {d}, B {a.b}, table {a.width} keys; rule {rule}", flush=True)
    rows = []
    for pos in positions:
        q_pos = torch.full((a.b,), pos, dtype=torch.int32, device="cuda")
        nbytes = 2 * 2 * hkv * d * (pos + 1) * a.b  # K and V, fp16
        ref = decode_attention(q, *pools[0], q_pos, scale, block_tables=table, block_size=BLOCK)
        cfgs = [rule]
        for bs, w, st in itertools.product(*([int(x) for x in s.split(",")]
                                             for s in (a.tiles, a.warps, a.stages))):
            base = decode_config(a.width, a.b, hkv, d)._replace(block_s=bs)
            n = base.n_split
            for ns in sorted({n, max(1, n // 2), n * 2}):
                c = DecodeConfig(bs, ns, w, st)
                if c not in cfgs:
                    cfgs.append(c)
        best = None
        for c in cfgs:
            if time.perf_counter() - t0 > a.budget:
                print(f"budget of {a.budget:.0f} s spent: stopped", flush=True)
                return report(rows)
            out = torch.empty_like(q)
            calls = [lambda kv=kv, c=c, out=out, q_pos=q_pos: decode_attention(
                q, kv[0], kv[1], q_pos, scale, out=out, block_tables=table, block_size=BLOCK,
                cfg=c) for kv in pools]  # fmt: skip
            try:
                calls[0]()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - registers, shared memory: reported, skipped
                print(f"P={pos} {c}: {type(e).__name__}: {str(e).splitlines()[0][:100]}", flush=True)
                continue
            err = (out.float() - ref.float()).abs().max().item()
            s = time_graph(calls, calls=4 * len(calls), reps=10)
            tag = "rule" if c == rule else ""
            rows.append((pos, c, s * 1e6, nbytes / s / 1e9, err, tag))
            if best is None or s < best[0]:
                best = (s, c)
            print(f"P={pos} {tuple(c)}: {s * 1e6:.1f} us {nbytes / s / 1e9:.0f} GB/s err {err:.1e} {tag}",
                  flush=True)
        if best:
            print(f"best P={pos}: {tuple(best[1])} {best[0] * 1e6:.1f} us", flush=True)
    return report(rows)


def report(rows: list) -> int:
    print("\n| P | (keys a tile, splits, warps, stages) | us | GB/s | err | |\n|---:|---|---:|---:|---:|---|")
    by_pos: dict[int, list] = {}
    for r in rows:
        by_pos.setdefault(r[0], []).append(r)
    for rs in by_pos.values():
        rs.sort(key=lambda r: r[2])
        shown = rs[:6] + [r for r in rs[6:] if r[5]]
        for p, c, us, gbs, err, tag in shown:
            print(f"| {p} | {tuple(c)} | {us:.1f} | {gbs:.0f} | {err:.1e} | {tag} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
