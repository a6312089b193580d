"""Time the batched decode GEMM (``gemm_q``: M = 2..64 activation rows against a packed weight,
read once) under its launch rule and a list of other tiles, beside what a batched decode would
run without it: ``gemv_q8`` once per row (its grid takes up to 8 rows a launch) and the prefill
pair (``dequantize_fp16`` + ``matmul_f16``). ``gemm_q_config`` is set from it.

    python bench/sweep_gemm_batch.py [--types Q4_K,Q6_K,Q8_0] [--rows 2,4,8,16,32,64] [--quick]
    python bench/sweep_gemm_batch.py --tiny     # a tiny shape; under the interpreter without CUDA

For each (format, N x K, M): the best tile, its microseconds and GB/s of weight bytes against
the H200's 4.3 TB/s copy roof, the rule's tile and time, gemv_q8's and the pair's; every
tile's output is checked against fp32 torch on the fp16-dequantized weight. Ends with the
totals per (format, M) and, per (format, M), the candidate tile that is best over all shapes.

Weights are random GGUF blocks (``layout.pack``, as the tests make them; 1024 packed rows
repeated to N) in enough copies that a CUDA graph of calls cycling through them reads from
HBM, not from the 50 MB L2. The kernels are compiled first by worker processes (one
compiled kernel per specialization, into Triton's cache), so that the sweep fits about two
minutes; a tile that fails to compile or run is skipped with a note.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections import defaultdict

LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
QWEN3_06B = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)]
TINY = [(40, 256), (72, 512)]
ROWS = (2, 4, 8, 16, 32, 64)
ROOF_GBS = 4300.0
# candidate tiles besides the rule's: (weight rows, K columns a step, warps, stages); each is
# run with the split of K that gives >= 264 programs (runs of >= 2 steps, at most 16) and, if
# that split is > 1, unsplit too
TILES = [(16, 256, 4, 4), (16, 128, 2, 4), (32, 256, 4, 4), (32, 128, 4, 4), (64, 128, 4, 3),
         (64, 256, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3)]
PROGRAMS = 264
ROTATE_BYTES = 160 << 20  # weight copies a graph cycles through: > 3x the H200's L2
PACK_ROWS = 1024  # random rows packed; repeated to N
SMALL_N = 256  # rows of the precompile workers' weights (any multiple of 16 compiles the same)


def _pad(m: int) -> int:
    return 16 if m <= 16 else (32 if m <= 32 else 64)


def candidates(t, n: int, k: int, m: int, tiles: list[tuple] = TILES,
               decodes: tuple[bool, ...] = (True,)) -> list[tuple[str, tuple]]:
    """(label, GemmQConfig fields) of the tiles tried for one (format, shape, M): the rule's
    first, then ``tiles`` with their split (a tile may also be the rule's: timed once), each
    with every decode of ``decodes`` (GemmQConfig.half: True float16, False float32; the
    labels of the float32 ones end in " f32")."""
    from deimos.quant.triton.dequant_gemv import words_per_group
    from deimos.quant.triton.gemm_q import GemmQConfig, gemm_q_config

    wpg = words_per_group(t)
    nk = 32 // wpg
    out = [("rule", tuple(gemm_q_config(t, n, k, m)))]
    for bn, bk, warps, stages in tiles:
        bj = max(wpg, bk // nk)
        row_tiles = -(-n // bn)
        split = 1
        while row_tiles * split < PROGRAMS and split < 16 and k // 32 // (2 * split) >= 2 * (bj // wpg):
            split *= 2
        label = f"n{bn} k{bk} w{warps} s{stages}"
        out.append((label + " split", (_pad(m), bn, bj, warps, stages, split)))
        if split > 1:
            out.append((label + " 1", (_pad(m), bn, bj, warps, stages, 1)))
    out = [(lb + ("" if half else " f32"), tuple(GemmQConfig(*f)._replace(half=half)))
           for half in decodes for lb, f in out]
    return list(dict(out).items())  # one entry a label


def _kernel_key(kind: str, t, k: int, m: int, cfg: tuple) -> tuple:
    """What a launch's compiled kernel depends on (the precompile runs one launch a key)."""
    from deimos.quant.triton.dequant_gemv import words_per_group
    from deimos.quant.triton.gemm_q import GemmQConfig, k_runs

    if kind == "gemm_q":
        c = GemmQConfig(*cfg)
        _, splits, even = k_runs(k, words_per_group(t), c)
        return (kind, t, c._replace(split_k=1), splits > 1, even)  # M is not specialized on
    if kind == "matmul":
        return (kind, cfg, k % cfg[2] == 0, m == 1, m % 16 == 0)
    return (kind, t, cfg, k)  # gemv_q8, dequantize_fp16: specialized on K's divisions


def _precompile(tasks: list[tuple]) -> list[str]:
    """Worker: run each (kind, type name, k, m, cfg) once on a SMALL_N-row weight (the same
    specializations as the sweep's launches: Triton keeps them in its on-disk cache for the
    parent). Returns notes of the launches that failed."""
    import numpy as np
    import torch

    cuda = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
    device = "cuda" if cuda else "cpu"

    from deimos.gguf.constants import GGMLType
    from deimos.kernels.triton.matmul import MatmulConfig, matmul_f16
    from deimos.models.gpu.dequant import DequantConfig, dequantize_fp16, permuted_columns
    from deimos.quant import get_format
    from deimos.quant.triton.gemm_q import GemmQConfig, gemm_q
    from deimos.quant.triton.gemv_q8 import Q8Config, gemv_q8, quantize_x
    from deimos.quant.triton.layout import pack

    notes, weights = [], {}
    for kind, name, k, m, cfg in tasks:
        t = GGMLType[name]
        if (t, k) not in weights:
            fmt = get_format(t)
            blocks = fmt.random_blocks(SMALL_N * k // fmt.block_size, np.random.default_rng(0))
            w = pack(blocks.reshape(SMALL_N, -1), t).to(device)
            x = torch.randn(64, k, device=device).half()
            weights[(t, k)] = (w, x, x[:, permuted_columns(w)].contiguous())
        w, x, xp = weights[(t, k)]
        try:
            if kind == "gemm_q":
                gemm_q(w, xp[:m], cfg=GemmQConfig(*cfg))
            elif kind == "gemv":
                gemv_q8(w, quantize_x(x[:m]), cfg=Q8Config(*cfg))
            elif kind == "dequant":
                dequantize_fp16(w, permuted=True, cfg=DequantConfig(*cfg))
            else:
                w16 = dequantize_fp16(w, permuted=True)
                matmul_f16(xp[:m], w16, cfg=MatmulConfig(*cfg))
            if cuda:
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - reported, the parent skips the tile
            notes.append(f"{kind} {name} k={k} {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    return notes


def precompile(plan: list[tuple], jobs: int) -> None:
    """Compile every distinct kernel of the sweep in ``jobs`` worker processes."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    seen, tasks = set(), []
    for kind, t, k, m, cfg in plan:
        key = _kernel_key(kind, t, k, m, cfg)
        if key not in seen:
            seen.add(key)
            tasks.append((kind, t.name, k, m, tuple(cfg)))
    t0 = time.perf_counter()
    chunks = [tasks[i::jobs] for i in range(jobs)]
    try:
        with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as ex:
            notes = [n for part in ex.map(_precompile, chunks) for n in part]
    except Exception as e:  # noqa: BLE001 - the sweep compiles what is left itself
        notes = [f"precompile workers failed ({type(e).__name__}: {e}); compiling in the sweep"]
    print(f"precompiled {len(tasks)} kernels in {time.perf_counter() - t0:.1f} s on {jobs} processes")
    for n in notes:
        print("  note: " + n)


def time_calls(fns: list, cuda: bool, reps: int = 5) -> float:
    """Seconds a call: a CUDA graph of calls cycling through ``fns`` (one a weight copy), the
    median of ``reps`` replays (deimos.quant.triton.bench.time_graph); on the CPU
    (interpreter) one pass, wall clock."""
    if not cuda:
        t0 = time.perf_counter()
        for f in fns:
            f()
        return (time.perf_counter() - t0) / len(fns)
    from deimos.quant.triton.bench import time_graph

    return time_graph(fns, calls=8, reps=reps)


def _gemv_rows(gemv_q8, w, qxs: list, out) -> None:
    """gemv_q8 over a batch's rows, 8 rows (its grid's most) a launch."""
    for qx in qxs:
        gemv_q8(w, qx, out=out[: qx.shape[0]])


def random_weight(t, n: int, k: int, device: str, cache: dict):
    """A packed random [n, k] weight on ``device``: PACK_ROWS random rows, repeated."""
    import numpy as np

    from deimos.quant import get_format
    from deimos.quant.triton.layout import PackedWeight, pack

    rows = min(n, PACK_ROWS)
    if (t, k, rows) not in cache:
        fmt = get_format(t)
        blocks = fmt.random_blocks(rows * k // fmt.block_size, np.random.default_rng(k + rows))
        cache[(t, k, rows)] = pack(blocks.reshape(rows, -1), t).to(device)
    small = cache[(t, k, rows)]
    if rows == n:
        return small
    reps = -(-n // rows)
    return PackedWeight(small.ggml_type, n, k,
                        {a: v.repeat(reps, 1)[:n].contiguous() for a, v in small.tensors.items()})


def sweep(args) -> None:
    import torch

    from deimos.gguf.constants import GGMLType
    from deimos.kernels.triton.matmul import matmul_config, matmul_f16
    from deimos.models.gpu.dequant import dequant_config, dequantize_fp16, permuted_columns
    from deimos.quant.triton.gemm_q import GemmQConfig, gemm_q
    from deimos.quant.triton.gemv_q8 import gemv_q8, q8_config, quantize_x
    from deimos.quant.triton.layout import KERNEL_TYPE, PackedWeight

    cuda = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
    device = "cuda" if cuda else "cpu"
    types = [GGMLType[s] for s in args.types.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    shapes = TINY if args.tiny else (LLAMA_8B if args.shapes == "8b" else LLAMA_8B + QWEN3_06B)
    tiles = TILES[:3] if args.tiny else (parse_tiles(args.tiles) if args.tiles else TILES)
    if args.quick:
        shapes = shapes[::2]
    decodes = tuple(dict.fromkeys({"half": True, "f32": False}[d] for d in args.decode.split(",")))

    def kt(t):
        return KERNEL_TYPE.get(t, t)

    if args.jobs > 1:  # (under the interpreter: checks the workers' code, compiles nothing)
        plan = []
        for t in types:
            for n, k in shapes:
                for m in rows:
                    plan += [("gemm_q", t, k, m, cfg)
                             for _, cfg in candidates(kt(t), n, k, m, tiles, decodes)]
                    for b in {min(8, m), m % 8 or 8}:
                        plan.append(("gemv", t, k, b, tuple(q8_config(kt(t), n, k, b))))
                    plan.append(("dequant", t, k, m, tuple(dequant_config(n, k))))
                    plan.append(("matmul", t, k, m, tuple(matmul_config(m, n, k))))
        precompile(plan, args.jobs)

    results = defaultdict(dict)  # (type, n, k, m) -> {label: seconds}
    baseline = {}  # (type, n, k, m) -> (gemv_q8 s, pair s)
    fields_of = {}  # (key, label) -> GemmQConfig fields
    packed_cache: dict = {}
    t_start = time.perf_counter()
    print(f"\n{'type':5} {'N x K':>13} {'M':>2}  {'best tile (m, n, j, warps, stages, split)':<40} "
          f"{'us':>7} {'GB/s':>5} {'roof':>4} | {'rule us':>7} | {'gemv_q8':>7} | {'pair':>7} | {'f16':>7} | vs gemv, pair")
    for t in types:
        for n, k in shapes:
            w = random_weight(t, n, k, device, packed_cache)
            extra = min(63, math.ceil(ROTATE_BYTES / w.nbytes) - 1) if cuda else 0
            copies = [w] + [PackedWeight(w.ggml_type, n, k, {a: v.clone() for a, v in w.tensors.items()})
                            for _ in range(extra)]
            cols = permuted_columns(w)
            x = torch.randn(max(rows), k, device=device).half()
            xp = x[:, cols].contiguous()
            w16 = dequantize_fp16(w, permuted=True)
            w32 = w16.float()
            for m in rows:
                key = (t, n, k, m)
                ref = xp[:m].float() @ w32.T
                out = torch.empty(m, n, device=device)
                notes = []
                timed = {}  # fields -> seconds (the rule's tile may also be a candidate's)
                for label, fields in candidates(kt(t), n, k, m, tiles, decodes):
                    cfg = GemmQConfig(*fields)
                    fields_of[(key, label)] = fields
                    if fields in timed:
                        results[key][label] = timed[fields]
                        continue
                    try:
                        out.fill_(float("nan"))
                        y = gemm_q(w, xp[:m], out=out, cfg=cfg)
                        err = ((y - ref).norm() / ref.norm()).item()
                        # against the float16-rounded weights: the float32 decode rounds
                        # once (~1e-5 here), the float16 one rounds the scales and mins too
                        if not err < (1e-3 if cfg.half else 1e-4):
                            notes.append(f"{fields} WRONG rel {err:.1e}")
                            continue
                        xm = xp[:m]
                        results[key][label] = timed[fields] = time_calls(
                            [lambda c=c, xm=xm, out=out, cfg=cfg: gemm_q(c, xm, out=out, cfg=cfg)
                             for c in copies], cuda)
                    except Exception as e:  # noqa: BLE001 - a tile that does not compile or run
                        notes.append(f"{fields} skipped: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
                qxs = [quantize_x(x[i:i + 8][: m - i]) for i in range(0, m, 8)]
                g_out = torch.empty(8, n, device=device)
                t_gemv = time_calls([lambda c=c, qxs=qxs, g=g_out: _gemv_rows(gemv_q8, c, qxs, g)
                                     for c in copies], cuda)
                y16 = torch.empty(m, n, device=device)
                xm = xp[:m]
                t_pair = time_calls([lambda c=c, xm=xm, w16=w16, y16=y16: matmul_f16(
                    xm, dequantize_fp16(c, out=w16, permuted=True), out=y16) for c in copies], cuda)
                w16s = [w16] + [w16.clone() for _ in range(min(7, math.ceil(ROTATE_BYTES / (2 * n * k)) - 1))] \
                    if cuda else [w16]
                t_f16 = time_calls([lambda w16=w16c, xm=xm, y16=y16: matmul_f16(xm, w16, out=y16)
                                    for w16c in w16s], cuda)
                del w16s
                baseline[key] = (t_gemv, t_pair, t_f16)
                if not results[key]:
                    print(f"{t.name:5} {n:>6}x{k:<6} {m:>2}  no tile ran: " + "; ".join(notes))
                    continue
                label = min(results[key], key=results[key].get)
                tb = results[key][label]
                gbs = w.nbytes / tb / 1e9
                tr = results[key].get("rule", float("nan"))
                print(f"{t.name:5} {n:>6}x{k:<6} {m:>2}  {fields_of[(key, label)]!s:<40} {tb * 1e6:7.1f} "
                      f"{gbs:5.0f} {gbs / ROOF_GBS:4.0%} | {tr * 1e6:7.1f} | {t_gemv * 1e6:7.1f} | "
                      f"{t_pair * 1e6:7.1f} | {t_f16 * 1e6:7.1f} | {t_gemv / tb:4.1f}x {t_pair / tb:4.1f}x", flush=True)
                for note in notes:
                    print("      " + note)
            del copies, w16, w32
            if cuda:
                torch.cuda.empty_cache()
    print(f"\nswept in {time.perf_counter() - t_start:.0f} s")
    summarize(results, baseline, types, rows)


def summarize(results: dict, baseline: dict, types: list, rows: list) -> None:
    """Totals per (format, M) over the shapes, and the single candidate that is best over
    them all (least geometric-mean slowdown against each shape's best tile)."""
    print(f"\n{'type':5} {'M':>2} | {'best':>8} {'rule':>8} {'gemv_q8':>8} {'pair':>8} {'f16':>8} (us, sum over shapes) | "
          "rule/best  gemv/best  pair/best | one tile for all shapes (geo-mean slowdown, worst)")
    for t in types:
        for m in rows:
            keys = [key for key in results if key[0] == t and key[3] == m and results[key]]
            if not keys:
                continue
            best = sum(min(results[key].values()) for key in keys)
            rule = sum(results[key].get("rule", float("nan")) for key in keys)
            gemv = sum(baseline[key][0] for key in keys)
            pair = sum(baseline[key][1] for key in keys)
            f16 = sum(baseline[key][2] for key in keys)
            labels = set.intersection(*(set(results[key]) for key in keys))
            slow = {lb: [results[key][lb] / min(results[key].values()) for key in keys] for lb in labels}
            pick = min(slow, key=lambda lb: sum(math.log(s) for s in slow[lb])) if slow else None
            one = (f"{pick} ({math.exp(sum(math.log(s) for s in slow[pick]) / len(keys)):.2f}x, "
                   f"{max(slow[pick]):.2f}x)" if pick else "-")
            print(f"{t.name:5} {m:>2} | {best * 1e6:8.1f} {rule * 1e6:8.1f} {gemv * 1e6:8.1f} {pair * 1e6:8.1f} {f16 * 1e6:8.1f} | "
                  f"{rule / best:9.2f} {gemv / best:10.2f} {pair / best:10.2f} | {one}")
    def best(key, f32: bool) -> float:
        return min((v for lb, v in results[key].items() if lb.endswith(" f32") == f32),
                   default=float("nan"))

    lines = []
    for t in types:
        for m in rows:
            keys = [key for key in results if key[0] == t and key[3] == m and results[key]]
            half, f32 = sum(best(k, False) for k in keys), sum(best(k, True) for k in keys)
            if keys and math.isfinite(half) and math.isfinite(f32):
                lines.append(f"{t.name:5} {m:>2} | {half * 1e6:8.1f} {f32 * 1e6:8.1f} | {f32 / half:5.2f}x")
    if lines:
        print(f"\n{'type':5} {'M':>2} | best float16-decode tile, best float32-decode tile (us, "
              "sum over shapes) | float32 / float16")
        print("\n".join(lines))
    print("\nsuggested rule: per (format, M) the one-tile column above where it is within ~5% of each "
          "shape's best; else the per-shape best tiles above, keyed by n / block_n programs and K")


def parse_tiles(text: str) -> list[tuple[int, int, int, int]]:
    """``--tiles "64x256x4x3,128x128x8x3"`` -> [(weight rows, K columns a step, warps, stages)]."""
    tiles = []
    for part in text.split(","):
        fields = part.strip().split("x")
        if len(fields) != 4 or not all(f.isdigit() for f in fields):
            raise SystemExit(f"sweep_gemm_batch: bad tile {part!r} (want ROWSxCOLUMNSxWARPSxSTAGES)")
        tiles.append(tuple(int(f) for f in fields))
    return tiles


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="Q4_K,Q6_K,Q8_0")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="activation rows M to sweep")
    ap.add_argument("--quick", action="store_true", help="every other shape")
    ap.add_argument("--decode", default="half", choices=("half", "f32", "half,f32", "f32,half"),
                    help="gemm_q's weight decode: float16 (the default), float32, or both")
    ap.add_argument("--shapes", default="all", choices=("all", "8b"), help="8b: llama 8B's matrices only")
    ap.add_argument("--tiles", default="", help="candidate tiles instead of the built-in list: "
                    "ROWSxCOLUMNSxWARPSxSTAGES,... (weight rows, K columns a step)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (runs under the interpreter)")
    ap.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1),
                    help="processes that compile the kernels first (1: compile in the sweep)")
    args = ap.parse_args(argv)
    if args.tiny:
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
        if args.rows == ",".join(map(str, ROWS)):
            args.rows = "2,17"
    sweep(args)


if __name__ == "__main__":
    sys.exit(main())
