"""The one-token MoE router: the unfused chain (torch's float32 product, then moe_route) against
the fused launch (kernels.triton.moe_router) over its tiles (experts a program, columns a loop
step, warps), at the MoE models' router shapes: qwen3moe (128 x 2048), qwen35moe (256 x
2048), qwen3next (512 x 2048). Each tile's ids checked against the unfused chain's.

Timing: CUDA-graph replay (quant.triton.bench.time_graph) of 50 calls, median of 20 replays.

    python bench/sweep_router.py [--shapes qwen3moe,qwen35moe,qwen3next]

Measures only; prints a table. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deimos.kernels.triton.moe_route import moe_route  # noqa: E402
from deimos.kernels.triton.moe_router import RouterScratch, RouterTile, moe_router  # noqa: E402
from deimos.quant.triton.bench import time_graph  # noqa: E402

SHAPES = {"qwen3moe": (128, 2048, 8), "qwen35moe": (256, 2048, 8), "qwen3next": (512, 2048, 10)}
TILES = [RouterTile(8, 512, 4)] + [RouterTile(e, d, w) for e in (2, 4, 8) for d in (1024, 2048)
                                   for w in (2, 4, 8)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    names = ap.parse_args().shapes.split(",")
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    for name in names:
        e, d, k = SHAPES[name]
        g = torch.Generator(device="cuda").manual_seed(e)
        x = torch.randn(1, d, device="cuda", generator=g)
        r = torch.randn(e, d, device="cuda", generator=g) / d**0.5
        scratch = RouterScratch()(e, x.device)
        want = moe_route(torch.mm(x, r.t()), k, True)[1]
        unfused = time_graph(lambda: moe_route(torch.mm(x, r.t()), k, True), calls=50, reps=20)
        rows.append((name, "torch.mm + moe_route", unfused * 1e6, "yes"))
        best = None
        for tile in TILES:
            ids = moe_router(x, r, k, True, scratch, tile)[1]
            same = "yes" if torch.equal(ids, want) else "no"
            s = time_graph(lambda tile=tile: moe_router(x, r, k, True, scratch, tile), calls=50, reps=20)
            rows.append((name, f"moe_router {tuple(tile)}", s * 1e6, same))
            if best is None or s < best[0]:
                best = (s, tile)
        print(f"{name}: unfused {unfused * 1e6:.2f} us, default tile "
              f"{[r_[2] for r_ in rows if r_[0] == name and r_[1] == f'moe_router {tuple(RouterTile())}'][0]:.2f} us, "
              f"best {tuple(best[1])} {best[0] * 1e6:.2f} us", flush=True)
    print("\n| shape | launch | us | ids as unfused |")
    print("|---|---|---:|---|")
    for name in names:
        mine = [r_ for r_ in rows if r_[0] == name]
        keep = [mine[0]] + [r_ for r_ in mine if r_[1] == f"moe_router {tuple(RouterTile())}"]
        keep += [r_ for r_ in sorted(mine[1:], key=lambda r_: r_[2])[:3] if r_ not in keep]
        for r_ in keep:
            print(f"| {name} {SHAPES[name][0]}x{SHAPES[name][1]} | {r_[1]} | {r_[2]:.2f} | {r_[3]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
