"""Time the integer-activation GEMV (gemv_q8) of every distinct matrix of a model under the
current launch rule and under other tiles; the result is what ``q8_config`` is set from.

    python bench/sweep_gemv.py MODEL.gguf [MODEL.gguf ...] [--quick] [--rows R [R ...]]

For each (format, N, K) of the model's decode GEMVs (fused q/k/v and gate/up as the engine
runs them, the output matrix): the rule's time, the best tile's time, both as share of the
copy roof, and how many times a token runs it; every tile's output is checked against the
rule's. Ends with the per-token GEMV time under the rule and under the best tiles. Measures
only; needs a CUDA GPU.

``--rows R`` (2..8; several allowed; 1 is the sweep above): the multi-row GEMV (gemv_rows,
its rule ``rows_config``, the other tiles, and the prefetch variant of the rule's tile and of
the four fastest) on R activation rows, beside gemv_q8 on the same R
rows (a program per row) and gemv_q8 on one row; whether the rule's row r equals gemv_q8 on
row r alone bit for bit (same tile, and gemv_q8's own rule: max difference); per step of R
rows the time of each.
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch

from deimos.gguf import GGUFFile
from deimos.models import load_model
from deimos.models.gpu import LinearGroup, QuantLinear
from deimos.quant.triton.bench import ROOF_GBS, time_graph
from deimos.quant.triton.gemv_q8 import Q8Config, QuantizedX, gemv_q8, q8_config, quantize_x
from deimos.quant.triton.gemv_rows import RowsConfig, gemv_rows, rows_config


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


def sweep_rows(calls: Counter, shapes: list, rows: int, quick: bool, best_rules: dict) -> None:
    """gemv_rows on ``rows`` activation rows at every shape: the rule, the best tile, gemv_q8 on
    the same rows and on one row (module docstring)."""
    print(f"\nR = {rows} activation rows: gemv_rows (rule, best tile) vs gemv_q8 on the {rows} rows "
          "and on 1 row; same: the rule's rows equal gemv_q8 row by row at the same tile / |diff| "
          "against gemv_q8's own rule")
    print(f"{'type':5} {'N x K':>14} {'calls':>5} {'q8 1row':>8} {'q8 Rrow':>8} {'rule us':>8} {'roof':>5} "
          f"{'best us':>8} {'roof':>5}  same  |diff|    rule tile -> best tile")
    tot = Counter()
    for key, lin in shapes:
        t, n, k = key
        w = lin.packed
        qx = quantize_x(torch.randn(rows, k, device="cuda"))
        one = QuantizedX(*(a[:1] for a in qx))
        out = torch.empty(rows, n, device="cuda")
        out1 = torch.empty(1, n, device="cuda")
        rule = rows_config(t, n, k, rows)
        ref = gemv_rows(w, qx, cfg=rule).clone()
        rows_alone = [QuantizedX(*(a[r : r + 1] for a in qx)) for r in range(rows)]
        tile = Q8Config(*rule[:4])
        same = all(torch.equal(ref[r], gemv_q8(w, x1, cfg=tile)[0]) for r, x1 in enumerate(rows_alone))
        diff = max((ref[r] - gemv_q8(w, x1)[0]).abs().max().item() for r, x1 in enumerate(rows_alone))
        times = {}

        def run(cfg: RowsConfig, w=w, qx=qx, out=out, ref=ref, times=times) -> None:
            y = gemv_rows(w, qx, out=out, cfg=cfg)
            err = ((y - ref).norm() / ref.norm()).item()
            if not err < 1e-5:
                print(f"  {cfg}: WRONG (rel {err:.1e})")
                return
            times[cfg] = time_graph(lambda: gemv_rows(w, qx, out=out, cfg=cfg))

        for cfg in dict.fromkeys(RowsConfig(*c) for c in candidates(rule, k, quick)):
            run(cfg)
        # the next step's weights loaded ahead: the rule's tile and the four fastest
        for cfg in dict.fromkeys([rule, *sorted(times, key=times.get)[:4]]):
            run(cfg._replace(prefetch=True))
        best = min(times, key=times.get)
        t_one = time_graph(lambda w=w, one=one, out1=out1: gemv_q8(w, one, out=out1))
        t_q8 = time_graph(lambda w=w, qx=qx, out=out: gemv_q8(w, qx, out=out))
        gb = w.nbytes / 1e9
        print(f"{t.name:5} {n:>7}x{k:<6} {calls[key]:>5} {t_one * 1e6:8.2f} {t_q8 * 1e6:8.2f} "
              f"{times[rule] * 1e6:8.2f} {gb / times[rule] / ROOF_GBS:5.0%} {times[best] * 1e6:8.2f} "
              f"{gb / times[best] / ROOF_GBS:5.0%}  {'yes' if same else 'NO ':4} {diff:.1e}  "
              f"{tuple(rule)} -> {tuple(best)}", flush=True)
        ranked = sorted(times, key=times.get)[:4]
        print("      top: " + "  ".join(f"{tuple(c)} {times[c] * 1e6:.2f}" for c in ranked))
        for name, sec in (("q8 1 row", t_one), ("q8 R rows", t_q8), ("rows rule", times[rule]),
                          ("rows best", times[best])):  # fmt: skip
            tot[name] += calls[key] * sec
        best_rules[(t.name, n, k, rows)] = tuple(best)
    print(f"GEMVs a step of {rows} rows: gemv_q8 {tot['q8 R rows'] * 1e6:.0f} us, gemv_rows rule "
          f"{tot['rows rule'] * 1e6:.0f} us ({tot['rows rule'] / tot['q8 1 row']:.2f}x one row's "
          f"{tot['q8 1 row'] * 1e6:.0f} us), best tiles {tot['rows best'] * 1e6:.0f} us")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("--quick", action="store_true", help="fewer tiles")
    ap.add_argument("--rows", type=int, nargs="+", default=[1],
                    help="activation rows: 1 = gemv_q8's sweep, 2..8 = gemv_rows")
    args = ap.parse_args()
    if any(not 1 <= r <= 8 for r in args.rows):
        ap.error("--rows: each in 1..8")
    best_rules = {}
    for path in args.models:
        model = load_model(GGUFFile(path), device="cuda")
        lins = decode_linears(model)
        calls, shapes = distinct_shapes(lins)
        print(f"\n{path}: {len(lins)} GEMVs a token, {len(shapes)} shapes")
        for rows in args.rows:
            if rows > 1:
                sweep_rows(calls, shapes, rows, args.quick, best_rules)
        if 1 not in args.rows:
            del model
            torch.cuda.empty_cache()
            continue
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
