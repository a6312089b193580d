"""Tiles and key splits of the paged prefill attention (kernels.triton.prefill_attention) at
the models' head shapes: a chunk of N new tokens after a cached prefix of P tokens (a
conversation's next turn) and a prompt's first chunk (P = 0), over a pool of 16-token blocks
in shuffled order. For each tile (block_m, block_n, warps, stages) and split count (the rule's
for that tile, half and twice it) the time of one call and the TFLOP/s of its visible keys;
every output checked against the default tile's.

Timing: CUDA-graph replay (quant.triton.bench.time_graph) of 20 calls, median of 10 replays.

    python bench/sweep_paged_prefill.py [--cases qwen35-4b,llama-8b] [--budget 200]

Measures only; prints a table. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deimos.kernels.triton.decode_attention import split_count  # noqa: E402
from deimos.kernels.triton.prefill_attention import (  # noqa: E402
    PrefillConfig,
    paged_prefill_attention,
    paged_prefill_config,
    prefill_tile_map,
)
from deimos.quant.triton.bench import time_graph  # noqa: E402

# name: (Hq, Hkv, D, [(cached prefix, new tokens), ...])
CASES = {
    "qwen35-4b": (16, 4, 256, [(20000, 150), (2048, 150), (0, 512), (0, 2048)]),
    "qwen35moe": (16, 2, 256, [(20000, 150)]),
    "llama-8b": (32, 8, 128, [(30000, 150), (0, 2048)]),
}
TILES = {
    256: [(64, 32, 4, 3), (64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 8, 2), (64, 64, 8, 3),
          (64, 32, 8, 3), (128, 32, 8, 2), (128, 32, 8, 3), (128, 64, 8, 2), (32, 64, 4, 3)],
    128: [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 8, 3), (64, 128, 4, 2),
          (128, 64, 4, 3), (64, 64, 8, 3), (128, 128, 8, 3)],
}
BLOCK = 16


def setup(hq: int, hkv: int, d: int, prefix: int, n: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    total = prefix + n
    n_blocks = -(-total // BLOCK)
    slots = (n_blocks + 8) * BLOCK
    k = torch.randn(slots, hkv, d, device="cuda", generator=g, dtype=torch.float16)
    v = torch.randn(slots, hkv, d, device="cuda", generator=g, dtype=torch.float16)
    table = (torch.randperm(n_blocks + 8, device="cuda", generator=g)[:n_blocks]
             .to(torch.int32).view(1, -1).contiguous())  # fmt: skip
    q = torch.randn(n, hq, d, device="cuda", generator=g, dtype=torch.float16)
    cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    start = torch.tensor([prefix], dtype=torch.int32, device="cuda")
    return q, k, v, table, cu, start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--budget", type=float, default=200.0, help="seconds; stop sweeping after")
    a = ap.parse_args()
    t_begin = time.perf_counter()
    rows = []
    for name in a.cases.split(","):
        hq, hkv, d, shapes = CASES[name]
        for prefix, n in shapes:
            q, k, v, table, cu, start = setup(hq, hkv, d, prefix, n, seed=prefix + n)
            scale = d**-0.5
            flops = 4 * hq * d * n * (prefix + (n + 1) / 2)
            width = table.shape[1] * BLOCK
            base = PrefillConfig(*paged_prefill_config(d))
            ref = None
            best = None
            for tile in TILES[d]:
                cfg = PrefillConfig(*tile)
                tiles = prefill_tile_map([n], hq, hkv, d, "cuda", block_m=cfg.block_m)
                rule = split_count(tiles.shape[0] * hkv, width, cfg.block_n, d)
                for n_split in sorted({rule, max(1, rule // 2), min(64, rule * 2)}):
                    if time.perf_counter() - t_begin > a.budget:
                        print(f"budget of {a.budget:.0f} s spent: stopped", flush=True)
                        return report(rows)
                    out = torch.empty_like(q)

                    def call(cfg=cfg, tiles=tiles, n_split=n_split, out=out):
                        paged_prefill_attention(q, k, v, table, cu, start, tiles, BLOCK, scale,
                                                out=out, n_split=n_split, cfg=cfg)

                    try:
                        call()
                        torch.cuda.synchronize()
                    except Exception as e:  # a tile over the shared memory or registers
                        print(f"{name} P={prefix} N={n} {tile} split {n_split}: "
                              f"{type(e).__name__}: {str(e).splitlines()[0][:100]}", flush=True)
                        continue
                    if ref is None:
                        ref = torch.empty_like(q)
                        dt = prefill_tile_map([n], hq, hkv, d, "cuda")
                        paged_prefill_attention(q, k, v, table, cu, start, dt, BLOCK, scale, out=ref)
                    err = (out.float() - ref.float()).abs().max().item()
                    s = time_graph(call, calls=20, reps=10)
                    tag = "rule" if (cfg == base and n_split == rule) else ""
                    rows.append((name, prefix, n, tile, n_split, s * 1e6, flops / s / 1e12, err, tag))
                    if best is None or s < best[0]:
                        best = (s, tile, n_split)
                    print(f"{name} P={prefix} N={n} {tile} split {n_split}: {s * 1e6:.1f} us "
                          f"{flops / s / 1e12:.0f} TFLOP/s err {err:.1e} {tag}", flush=True)
            if best:
                print(f"best {name} P={prefix} N={n}: {best[1]} split {best[2]} "
                      f"{best[0] * 1e6:.1f} us", flush=True)
    return report(rows)


def report(rows: list) -> int:
    """Per case: the default tile at the rule's split, then the three fastest."""
    print("\n| case | prefix | new | tile (M, N, warps, stages) | splits | us | TFLOP/s | max err | |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---|")
    cases = dict.fromkeys(r[:3] for r in rows)
    for c in cases:
        mine = [r for r in rows if r[:3] == c]
        top = sorted(mine, key=lambda r: r[5])[:3]
        for r in [r for r in mine if r[8] and r not in top] + top:
            print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[5]:.1f} | {r[6]:.0f} | "
                  f"{r[7]:.1e} | {r[8]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
