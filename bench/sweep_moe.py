"""Tiles of the one-token MoE kernels at qwen3moe 30B-A3B's shapes (D 2048, F 768, E 128,
k 8): the unfused chain's (torch router + moe_route, moe_gemv gate / up / down, gated_act,
moe_combine) and the fused one's (moe_router, moe_gate_up, moe_down_combine), each tile
checked against the launch rule's output, then the layer's chain at the rule's and at the best
tiles.

Timing: CUDA-graph replay (quant.triton.bench.time_graph) cycling through 16 calls whose ids
take disjoint sets of 8 experts, over stacks of all 128 experts (113-165 MB a stack: each call
reads its experts from memory, not L2), programmatic dependent launch on as in a decode graph.

    python bench/sweep_moe.py [--down Q6_K] [--quick]

Measures only; prints tables. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deimos.gguf.constants import GGMLType  # noqa: E402
from deimos.kernels.triton.activation import gated_act  # noqa: E402
from deimos.kernels.triton.moe_route import moe_combine, moe_route  # noqa: E402
from deimos.kernels.triton.moe_router import RouterScratch, RouterTile, moe_router  # noqa: E402
from deimos.quant.triton.bench import ROOF_GBS, expert_stack, time_graph  # noqa: E402
from deimos.quant.triton.gemv_q8 import Q8Config, empty_quantized, quantize_x  # noqa: E402
from deimos.quant.triton.layout import PackedWeight  # noqa: E402
from deimos.quant.triton.moe_decode import (  # noqa: E402
    down_config,
    gate_up_config,
    moe_down_combine,
    moe_gate_up,
)
from deimos.quant.triton.moe_gemv import moe_gemv, moe_gemv_config  # noqa: E402

D, F, E, K = 2048, 768, 128, 8
CALLS = E // K  # disjoint expert sets


def stack(t: GGMLType, n: int, k: int, seed: int) -> PackedWeight:
    """E experts of [n, k]: 8 random ones repeated (distinct addresses, so no L2 reuse)."""
    return expert_stack(t, n, k, E, seed)


def gemv_tiles(k: int, quick: bool) -> list[Q8Config]:
    """Rows a program, groups a step (at most the row's, at least 16), warps; x broadcast over
    the rows (xb) where the step is one group a thread."""
    out = []
    steps = (16, 32) if k // 32 <= 32 else (32, 64)
    for warps in (1, 2, 4) if quick else (1, 2, 4, 8):
        for rows in (2, 4, 8, 16) if quick else (1, 2, 4, 8, 16, 32):
            for step in steps:
                out.append(Q8Config(rows, step, warps))
                if step == 32 * warps:
                    out.append(Q8Config(rows, step, warps, True))
    return out


def fused_tiles(k: int) -> list[Q8Config]:
    steps = (16, 32) if k // 32 <= 32 else (16, 32, 64)
    return [Q8Config(rows, step, warps) for rows in (32, 64) for step in steps for warps in (2, 4, 8)]


def best_of(label: str, rule, tiles, run, check, nbytes: float, tol: float = 1e-5) -> tuple:
    """Each tile's time (its output within ``tol`` of the rule's); prints the rule and the top 4."""
    ref = check(rule)
    times = {}
    for cfg in [rule, *tiles]:
        if cfg in times:
            continue
        try:
            got = check(cfg)
        except Exception as e:  # a tile that does not compile or launch: reported, skipped
            print(f"  {label} {tuple(cfg)}: {type(e).__name__}: {str(e)[:80]}")
            continue
        err = ((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()
        if not err < tol:
            print(f"  {label} {tuple(cfg)}: WRONG (rel {err:.1e})")
            continue
        times[cfg] = time_graph([lambda i=i, cfg=cfg: run(cfg, i) for i in range(CALLS)], calls=4 * CALLS)
    best = min(times, key=times.get)
    gbs = nbytes / times[best] / 1e9
    print(f"{label:28} rule {tuple(rule)} {times[rule] * 1e6:7.2f} us | best {tuple(best)} "
          f"{times[best] * 1e6:7.2f} us ({gbs:5.0f} GB/s, {gbs / ROOF_GBS:4.0%} of the roof)", flush=True)
    print("    top: " + "  ".join(f"{tuple(c)} {times[c] * 1e6:.2f}" for c in sorted(times, key=times.get)[:4]))
    return rule, best, times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--down", default="Q6_K", help="the down stack's format (Q4_K_M: Q6_K or Q4_K by layer)")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    gate, up = stack(GGMLType.Q4_K, F, D, 1), stack(GGMLType.Q4_K, F, D, 2)
    down = stack(GGMLType[args.down], D, F, 3)
    per_call = {name: w.nbytes * K / E for name, w in (("gate", gate), ("up", up), ("down", down))}
    dev = torch.device("cuda")
    slot_of = torch.arange(E, dtype=torch.int32, device=dev)
    perm = torch.randperm(E, generator=torch.Generator().manual_seed(0))
    ids = [perm[i * K:(i + 1) * K].view(1, K).to(torch.int32).to(dev) for i in range(CALLS)]
    x = torch.randn(1, D, device=dev) * 0.5
    router_w = torch.randn(E, D, device=dev) * 0.02
    qx = quantize_x(x)
    wts = torch.softmax(torch.randn(1, K, device=dev), dim=1).contiguous()
    g_out, u_out = torch.empty(K, F, device=dev), torch.empty(K, F, device=dev)
    qa = empty_quantized(K, F, dev)
    qas = []  # each call's activation, from its own experts (the down GEMV's input)
    for i in range(CALLS):
        q = empty_quantized(K, F, dev)
        moe_gate_up(gate, up, F, qx, ids[i], slot_of, "silu", out=q)
        qas.append(q)
    y_out, o_out = torch.empty(K, D, device=dev), torch.empty(1, D, device=dev)
    print(f"qwen3moe 30B-A3B shapes: gate/up Q4_K {per_call['gate'] / 1e6:.1f} MB a call each, down "
          f"{args.down} {per_call['down'] / 1e6:.1f} MB")

    def gemv_run(w, n, x_of, rows):
        def run(cfg, i):
            return moe_gemv(w, n, x_of(i), ids[i], slot_of, rows, out=g_out if n == F else y_out, cfg=cfg)
        return run, lambda cfg: run(cfg, 0).clone()

    rg, cg = gemv_run(gate, F, lambda i: qx, "token")
    gate_best = best_of("moe_gemv gate", moe_gemv_config(gate, F), gemv_tiles(D, args.quick), rg, cg, per_call["gate"])
    rd, cd = gemv_run(down, D, lambda i: qas[i], "pair")
    down_best = best_of(f"moe_gemv down {args.down}", moe_gemv_config(down, D), gemv_tiles(F, args.quick), rd, cd,
                        per_call["down"])

    def gu_run(cfg, i):
        return moe_gate_up(gate, up, F, qx, ids[i], slot_of, "silu", out=qa, cfg=cfg)

    # checked through a down GEMV on its activation (other groups a step round the activation
    # differently: a few codes move by one)
    gu_best = best_of("moe_gate_up (fused)", gate_up_config(gate, F), fused_tiles(D), gu_run,
                      lambda cfg: moe_gemv(down, D, gu_run(cfg, 0), ids[0], slot_of, "pair").clone(),
                      per_call["gate"] + per_call["up"], tol=1e-3)

    def dc_run(cfg, i):
        return moe_down_combine(down, D, qas[i], ids[i], wts, slot_of, out=o_out, cfg=cfg)

    dc_best = best_of(f"moe_down_combine {args.down}", down_config(down, D), gemv_tiles(F, args.quick), dc_run,
                      lambda cfg: dc_run(cfg, 0).clone(), per_call["down"])

    scratch = RouterScratch()(E, dev)

    def r_run(tile, i):
        return moe_router(x, router_w, K, True, scratch, tile=tile)[0]

    tiles = [RouterTile(e, d, w) for e in (1, 2, 4, 8) for d in (512, 2048) for w in (2, 4)]
    r_best = best_of("moe_router (fused)", RouterTile(), tiles, r_run, lambda t: r_run(t, 0).clone(), E * D * 4)
    t_router_torch = time_graph(lambda: moe_route(torch.mm(x, router_w.t()), K, True), calls=64)
    print(f"{'torch.mm + moe_route':28} {t_router_torch * 1e6:7.2f} us")

    def unfused(i, gcfg, dcfg, rtile=None):
        if rtile is None:
            w_, ids_ = moe_route(torch.mm(x, router_w.t()), K, True)
        else:
            w_, ids_ = moe_router(x, router_w, K, True, scratch, tile=rtile)
        g = moe_gemv(gate, F, qx, ids[i], slot_of, "token", out=g_out, cfg=gcfg)
        u = moe_gemv(up, F, qx, ids[i], slot_of, "token", out=u_out, cfg=gcfg)
        gated_act(g, u, "silu", quantized=qa)
        y = moe_gemv(down, D, qa, ids[i], slot_of, "pair", out=y_out, cfg=dcfg)
        return moe_combine(y, w_, out=o_out)

    def fused(i, gucfg, dccfg, rtile):
        w_, ids_ = moe_router(x, router_w, K, True, scratch, tile=rtile)
        a = moe_gate_up(gate, up, F, qx, ids[i], slot_of, "silu", out=qa, cfg=gucfg)
        return moe_down_combine(down, D, a, ids[i], w_, slot_of, out=o_out, cfg=dccfg)

    print("\n| chain (one layer, experts from memory) | rule tiles us | best tiles us |\n|---|---:|---:|")
    for name, fn, rule, best in (
        ("unfused: mm, route, gate, up, act, down, combine", unfused,
         (gate_best[0], down_best[0]), (gate_best[1], down_best[1])),
        ("fused router, then unfused", unfused,
         (gate_best[0], down_best[0], r_best[0]), (gate_best[1], down_best[1], r_best[1])),
        ("fused: router, gate_up, down_combine", fused,
         (gu_best[0], dc_best[0], r_best[0]), (gu_best[1], dc_best[1], r_best[1])),
    ):
        t_rule = time_graph([lambda i=i: fn(i, *rule) for i in range(CALLS)], calls=2 * CALLS)
        t_best = time_graph([lambda i=i: fn(i, *best) for i in range(CALLS)], calls=2 * CALLS)
        print(f"| {name} | {t_rule * 1e6:.2f} | {t_best * 1e6:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
