"""One launch rule's kernel run a few times, for a profiler to read (Nsight Compute: where a
quantized GEMM's warps stall, which pipe is busy): the batched decode GEMM (quant.triton.gemm_q)
at M rows of a llama 8B gate/up matrix, or the prefill MoE GEMM (quant.triton.moe_gemm) at a
512-token prompt of qwen3moe 30B-A3B's gate. Prints each launch's time (CUDA graph replay) and
the weight bytes' rate, so the profile can be read against the roof.

    python bench/gemm_parts.py --which gemm_q|moe [--rows 16] [--calls 3]
    ncu -k regex:gemm --launch-skip 1 --launch-count 1 --section WarpStateStats ... \\
        python bench/gemm_parts.py --which moe

Measures only. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deimos.gguf.constants import GGMLType
from deimos.quant.triton.bench import expert_stack, time_graph
from deimos.quant.triton.gemm_q import gemm_q
from deimos.quant.triton.moe_gemm import moe_align, moe_block_m, moe_gemm


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--which", choices=("gemm_q", "moe"), default="moe")
    ap.add_argument("--rows", type=int, default=16, help="gemm_q's activation rows")
    ap.add_argument("--calls", type=int, default=3, help="plain launches (what a profiler reads)")
    ap.add_argument("--time", action="store_true", help="also time a CUDA graph of launches")
    a = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    if a.which == "gemm_q":
        n, k = 28672, 4096  # llama 8B's gate and up
        w = expert_stack(GGMLType.Q4_K, n, k, 1, 0, base=1)
        x = (torch.randn(a.rows, k, generator=g) * 0.5).half().to(dev)

        def run():
            return gemm_q(w, x)

        label = f"gemm_q Q4_K [{n}, {k}] x {a.rows} rows"
    else:
        d, f, e, top = 2048, 768, 128, 8  # qwen3moe 30B-A3B's gate
        w = expert_stack(GGMLType.Q4_K, f, d, e, 1)
        ids = (
            torch.stack([torch.randperm(e, generator=g)[:top] for _ in range(512)])
            .to(torch.int32)
            .to(dev)
        )
        x = (torch.randn(512, d, generator=g) * 0.5).half().to(dev)
        tiles = moe_align(ids, e, moe_block_m(512 * top, e))
        slot_of = torch.arange(e, dtype=torch.int32, device=dev)

        def run():
            return moe_gemm(x, w, f, tiles, slot_of, "token", x_permuted=False)

        label = f"moe_gemm Q4_K gate [{f}, {d}] x 512 tokens, top {top} of {e}"
    for _ in range(a.calls):
        run()
    torch.cuda.synchronize()
    if a.time:
        s = time_graph(run, calls=20, reps=10)
        print(f"{label}: {s * 1e6:.1f} us, {w.nbytes / s / 1e9:.0f} GB/s of weights")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
