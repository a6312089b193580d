"""Time the integer-activation GEMV (gemv_q8) of every distinct matrix of a model under the
current launch rule and under other tiles; the result is what ``q8_config`` is set from.

    python bench/sweep_gemv.py MODEL.gguf [MODEL.gguf ...] [--quick]

For each (format, N, K) of the model's decode GEMVs (fused q/k/v and gate/up as the engine
runs them, the output matrix): the rule's time, the best tile's time, both as share of the
copy roof, and how many times a token runs it; every tile's output is checked against the
rule's. Ends with the per-token GEMV time under the rule and under the best tiles. Measures
only; needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch

from deimos.gguf import GGUFFile
from deimos.models import load_model
from deimos.models.gpu import LinearGroup, QuantLinear
from deimos.quant.triton.bench import ROOF_GBS, time_graph
from deimos.quant.triton.gemv_q8 import Q8Config, gemv_q8, q8_config, quantize_x


def decode_linears(model) -> list[QuantLinear]:
    """Every QuantLinear a decode step runs, once per call (a LinearGroup counts once)."""
    found: list[QuantLinear] = []
    seen: set[int] = set()

    def walk(obj, depth: int) -> None:
        if id(obj) in seen or depth > 8:
            return
        seen.add(id(obj))
        if isinstance(obj, QuantLinear):
            found.append(obj)
        elif isinstance(obj, LinearGroup):
            walk(obj.linear, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for o in obj:
                walk(o, depth + 1)
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("deimos.models"):
            for v in vars(obj).values():
                walk(v, depth + 1)

    walk(model, 0)
    return found


def distinct_shapes(lins: list[QuantLinear]) -> tuple[Counter, list[tuple[tuple, QuantLinear]]]:
    """How many times a step runs each (format, N, K), and each one's first linear, largest
    matrix first."""
    calls = Counter((lin.ggml_type, lin.packed.n, lin.packed.k) for lin in lins)
    first: dict[tuple, QuantLinear] = {}
    for lin in lins:
        first.setdefault((lin.ggml_type, lin.packed.n, lin.packed.k), lin)
    return calls, sorted(first.items(), key=lambda kv: -kv[0][1] * kv[0][2])


def candidates(rule: Q8Config, k: int, quick: bool) -> list[Q8Config]:
    groups = k // 32
    out = [rule]
    for warps in (1, 2, 4, 8) if not quick else (1, 4, 8):
        for mult in (1, 2, 4, 8) if warps <= 2 else (1, 2):  # mult: groups a thread and step
            s = 32 * warps * mult
            if s > max(64, 2 * groups):
                continue
            for rows in (1, 2, 4, 8):
                if rows * mult <= 8:
                    out.append(Q8Config(rows, s, warps, True))
    # rows on warps (no x broadcast), 1-4 groups a thread and step
    for rows, step in ((4, 32), (4, 64), (4, 128), (8, 16), (8, 32), (2, 32)):
        if step <= max(32, groups):
            out.append(Q8Config(rows, step, 4))
    return list(dict.fromkeys(out))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("--quick", action="store_true", help="fewer tiles")
    args = ap.parse_args()
    best_rules = {}
    for path in args.models:
        model = load_model(GGUFFile(path), device="cuda")
        lins = decode_linears(model)
        calls, shapes = distinct_shapes(lins)
        print(f"\n{path}: {len(lins)} GEMVs a token, {len(shapes)} shapes")
        print(f"{'type':5} {'N x K':>14} {'calls':>5} {'rule us':>8} {'roof':>5} {'best us':>8} {'roof':>5}  best tile")
        t_rule = t_best = 0.0
        for key, lin in shapes:
            t, n, k = key
            qx = quantize_x(torch.randn(1, k, device="cuda"))
            out = torch.empty(1, n, device="cuda")
            rule = q8_config(t, n, k, 1)
            ref = gemv_q8(lin.packed, qx, cfg=rule).clone()
            times = {}
            for cfg in candidates(rule, k, args.quick):
                y = gemv_q8(lin.packed, qx, out=out, cfg=cfg)
                err = ((y - ref).norm() / ref.norm()).item()
                if not err < 1e-5:
                    print(f"  {cfg}: WRONG (rel {err:.1e})")
                    continue
                times[cfg] = time_graph(lambda cfg=cfg, w=lin.packed, qx=qx, out=out: gemv_q8(w, qx, out=out, cfg=cfg))
            best = min(times, key=times.get)
            gb = lin.packed.nbytes / 1e9
            print(f"{t.name:5} {n:>7}x{k:<6} {calls[key]:>5} {times[rule] * 1e6:8.2f} "
                  f"{gb / times[rule] / ROOF_GBS:5.0%} {times[best] * 1e6:8.2f} "
                  f"{gb / times[best] / ROOF_GBS:5.0%}  {tuple(best)}", flush=True)
            ranked = sorted(times, key=times.get)[:4]
            print("      top: " + "  ".join(f"{tuple(c)} {times[c] * 1e6:.2f}" for c in ranked))
            t_rule += calls[key] * times[rule]
            t_best += calls[key] * times[best]
            best_rules[(t.name, n, k)] = tuple(best)
        print(f"GEMVs a token: rule {t_rule * 1e6:.0f} us, best tiles {t_best * 1e6:.0f} us")
        del model
        torch.cuda.empty_cache()
    print("\nbest tiles:", best_rules)


if __name__ == "__main__":
    main()
