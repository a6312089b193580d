"""Time the CPU side of expert misses (deimos.runtime.cpu_experts) on a qwen3moe-30B-A3B-sized
layer (E = 128 experts, n_embd 2048, n_ff_exp 768) in Q4_K, Q6_K, Q8_0 and the Q4_K_M mix
(gate/up Q4_K, down Q6_K), every core of this machine.

    python bench/cpu_experts.py [--gib 1.5] [--reps 5] [--quick]

Weights: random valid blocks, one layer copied into enough layers to span ``--gib`` (more
than the last-level cache), each call on a random layer and random distinct experts, so the
bytes come from memory. Per backend and scenario: time a call (one layer), GB/s of the
quantized bytes of the experts it touched, misses per second, and the relative error against
the float64 oracle (moe_misses_reference) on the first call. "tok/s all-CPU" is one
30B-A3B token with every one of its 48 x 8 experts computed here: 1 / (48 x the time of a
decode call of 8 misses). torch's int4pack / int8pack CPU matmuls are timed on the same
shapes (random codes; they cannot hold these formats exactly, so no error is given).
Measures only.

llama.cpp's CPU expert throughput on the same cores (/work/shared/peers: unpack
llama-cpu-x86_64.tar.xz, run with LD_LIBRARY_PATH at it; never copy it into the repo): write
two random qwen3moe files with the 30B-A3B widths, 6 layers, one with 8 experts used and one
with 1 (``deimos.synth.write_model`` with ``dataclasses.replace(get_preset("qwen3moe-30b-a3b"),
n_layer=6, n_expert_used=k)``, Q4_K_M, a small donor vocabulary such as llama.cpp's
models/ggml-vocab-llama-spm.gguf), then ``llama-bench -m F -ngl 0 -t N -p 0 -n 32 -r 8`` on
each, interleaved: (1/tg(k=8) - 1/tg(k=1)) / (6 layers x 7 experts) is one expert's time;
compare 8 of them with this bench's "decode 1 tok x 8" at ``--threads N``. Measured here
(2 shared cores, -t 1): tg 32.7 vs 56.8-64.9 tokens/s, 0.31-0.36 ms an expert, 2.5-2.9 ms a
token's 8, against 4.2-4.5 ms of ggml compute (5.1-5.4 ms a call) for ggml-python's ggml
0.15.3 on the file's blocks: llama.cpp repacks Q4_K at load (its CPU_REPACK buffers, which
want float32 activations) and has a newer ggml. With -t 2 both llama.cpp and ggml-python
collapse on these shared cores (spinning barriers; cpu_experts.default_threads).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from deimos.gguf.constants import GGMLType
from deimos.quant import get_format
from deimos.runtime.cpu_experts import CpuExperts, ExpertMatrix, LayerExperts, moe_misses_reference

E, FF, D, N_LAYER, TOP_K = 128, 768, 2048, 48, 8
MIXES = {"Q4_K": ("Q4_K", "Q4_K"), "Q6_K": ("Q6_K", "Q6_K"), "Q8_0": ("Q8_0", "Q8_0"),
         "Q4_K_M": ("Q4_K", "Q6_K")}
SCENARIOS = (("decode 1 tok x 8", 1, 8), ("decode 1 tok x 3", 1, 3), ("16 tok x 8", 16, 8))


def layers_for(mix: str, gib: float, rng: np.random.Generator) -> list[LayerExperts]:
    tg, td = (GGMLType[t] for t in MIXES[mix])

    def mat(t: GGMLType, n_out: int, n_in: int) -> np.ndarray:
        f = get_format(t)
        return f.random_blocks(E * n_out * n_in // f.block_size, rng).reshape(E, n_out, -1)

    one = [mat(tg, FF, D), mat(tg, FF, D), mat(td, D, FF)]
    per_layer = sum(m.nbytes for m in one)
    n = max(1, int(gib * 2**30) // per_layer)
    out = []
    for i in range(n):
        ms = [m if i == 0 else m.copy() for m in one]
        out.append(LayerExperts(ExpertMatrix(ms[0], tg, FF, D, f"blk.{i}.gate"),
                                ExpertMatrix(ms[1], tg, FF, D, f"blk.{i}.up"),
                                ExpertMatrix(ms[2], td, D, FF, f"blk.{i}.down")))
    return out


def expert_bytes(lay: LayerExperts) -> int:
    return sum(m.raw[0].nbytes for m in (lay.gate, lay.up, lay.down))


def misses(t: int, k: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    experts = np.concatenate([rng.choice(E, k, replace=False) for _ in range(t)])
    rows = np.repeat(np.arange(t), k)
    w = rng.random(t * k).astype(np.float32)
    return rows, experts, w


def time_backend(cpu: CpuExperts, layers: list[LayerExperts], t: int, k: int, reps: int,
                 rng: np.random.Generator) -> tuple[float, float, float, float]:
    """(median and best seconds a call, quantized bytes a call, relative error of a first call).
    The best call is the one least disturbed by other processes on shared cores."""
    x = torch.randn(t, D)
    err = float("nan")
    if t * k <= 8:  # the oracle decodes every miss's matrices in float64: small calls only
        rows, ex, w = misses(t, k, rng)
        ref = moe_misses_reference(x, layers[0], rows, ex, w)
        err = ((cpu(0, x, rows, ex, w).double() - ref).norm() / ref.norm()).item()
    cpu(1 % len(layers), x, *misses(t, k, rng))  # warm: graphs for this miss count
    times, nbytes = [], 0.0
    for _ in range(reps):
        li = int(rng.integers(len(layers)))
        rows, ex, w = misses(t, k, rng)
        t0 = time.perf_counter()
        cpu(li, x, rows, ex, w)
        times.append(time.perf_counter() - t0)
        nbytes += len(np.unique(ex)) * expert_bytes(layers[li])
    return float(np.median(times)), min(times), nbytes / reps, err


def torch_packed(t: int, k: int, reps: int) -> dict[str, float]:
    """Best seconds a call of k experts' three matrices on t rows on torch's int4pack (group
    32, bf16 scales and activations) and int8pack (a scale per row)."""
    out = {}
    n_mats = 3 * TOP_K * 8  # distinct matrices cycled so that they come from memory
    x = torch.randn(t, D, dtype=torch.bfloat16)
    h = torch.randn(t, FF, dtype=torch.bfloat16)
    w4 = [torch._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (FF, D), dtype=torch.int32), 1)
          for _ in range(n_mats)]
    w4d = [torch._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (D, FF), dtype=torch.int32), 1)
           for _ in range(n_mats)]
    sz, szd = torch.randn(D // 32, FF, 2, dtype=torch.bfloat16), torch.randn(FF // 32, D, 2, dtype=torch.bfloat16)
    w8 = [torch.randint(-127, 127, (FF, D), dtype=torch.int8) for _ in range(n_mats)]
    w8d = [torch.randint(-127, 127, (D, FF), dtype=torch.int8) for _ in range(n_mats)]
    s8, s8d = torch.rand(FF, dtype=torch.bfloat16), torch.rand(D, dtype=torch.bfloat16)

    def run(kind: str, i: int) -> None:
        j = (3 * i) % n_mats
        for e in range(k):
            if kind == "int4pack":
                torch._weight_int4pack_mm_for_cpu(x, w4[j + e % 3], 32, sz)
                torch._weight_int4pack_mm_for_cpu(x, w4[(j + 1 + e) % n_mats], 32, sz)
                torch._weight_int4pack_mm_for_cpu(h, w4d[(j + e) % n_mats], 32, szd)
            else:
                torch._weight_int8pack_mm(x, w8[j + e % 3], s8)
                torch._weight_int8pack_mm(x, w8[(j + 1 + e) % n_mats], s8)
                torch._weight_int8pack_mm(h, w8d[(j + e) % n_mats], s8d)

    for kind in ("int4pack", "int8pack"):
        run(kind, 0)
        best = float("inf")
        for i in range(reps):
            t0 = time.perf_counter()
            run(kind, i)
            best = min(best, time.perf_counter() - t0)
        out[kind] = best
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.5, help="weight bytes to spread calls over")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="Q4_K_M only, no exact-cold")
    ap.add_argument("--threads", type=int, default=0, help="ggml threads (0: every CPU)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    print(f"{threads} threads; E={E} n_embd={D} n_ff_exp={FF}; calls spread over ~{args.gib} GiB")
    print(f"{'format':7} {'backend':14} {'scenario':17} {'ms med':>8} {'ms best':>8} {'GB/s':>6} "
          f"{'misses/s':>9} {'tok/s all-CPU':>13} {'rel err':>8}   (GB/s, misses/s, tok/s: best call)")
    for mix in (("Q4_K_M",) if args.quick else MIXES):
        layers = layers_for(mix, args.gib, rng)
        backends = [("ggml planes=1", {"backend": "ggml", "planes": 1}),
                    ("ggml planes=2", {"backend": "ggml", "planes": 2}),
                    ("ggml planes=3", {"backend": "ggml", "planes": 3}),
                    ("exact warm", {"backend": "exact", "cache_bytes": 4 << 30})]
        if not args.quick:
            backends.append(("exact cold", {"backend": "exact", "cache_bytes": 0}))
        for name, kw in backends:
            for scen, t, k in SCENARIOS:
                cold = name == "exact cold"
                if cold and t > 1:
                    continue
                lays = layers[:1] if name.startswith("exact") else layers
                cpu = CpuExperts(lays, n_threads=threads, **kw)
                if name == "exact warm":  # every expert decoded once: calls then only read floats
                    cpu(0, torch.randn(1, D), np.zeros(E, np.int64), np.arange(E), np.ones(E))
                reps = 2 if cold else args.reps * (3 if t == 1 else 1)
                med, best, nbytes, err = time_backend(cpu, lays, t, k, reps, rng)
                tok = f"{1 / (N_LAYER * best):13.2f}" if (t, k) == (1, 8) else " " * 13
                print(f"{mix:7} {name:14} {scen:17} {med * 1e3:8.2f} {best * 1e3:8.2f} "
                      f"{nbytes / best / 1e9:6.2f} {t * k / best:9.0f} {tok} {err:8.1e}", flush=True)
            del cpu
        del layers
    for scen, t, k in SCENARIOS[:2]:  # decode shapes (one token's experts)
        for kind, sec in torch_packed(t, k, args.reps).items():
            per_w = 0.5 + 4 / 32 if kind == "int4pack" else 1.0  # codes + bf16 scale (and zero) per 32
            nbytes = k * 3 * FF * D * per_w
            tok = f"{1 / (N_LAYER * sec):13.2f}" if (t, k) == (1, 8) else " " * 13
            print(f"{'torch':7} {kind:14} {scen:17} {'':8} {sec * 1e3:8.2f} {nbytes / sec / 1e9:6.2f} "
                  f"{t * k / sec:9.0f} {tok} {'-':>8}", flush=True)


if __name__ == "__main__":
    main()
