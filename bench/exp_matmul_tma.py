"""The fp16 matmul at prefill's rows (y = a @ b^T, fp32 y) with its tiles loaded by the tensor
memory accelerator (host-made tensor descriptors) instead of per-thread pointer loads, one tile
a program or persistent (a program an SM walking the tiles, the K loops of consecutive tiles
flattened into one pipeline); against ``matmul_f16`` (its rule and its 128 x 256 tile) and
torch.matmul (cuBLAS), at llama 8B's shapes. Each output checked against cuBLAS's. A
measurement, not a test; needs a Hopper GPU (TRITON_INTERPRET=1 runs the kernels' logic on
small shapes: ``--check``).

    python bench/exp_matmul_tma.py [-m 512 2048] [--check]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deimos.kernels.triton.matmul import MatmulConfig, matmul_config, matmul_f16, tile_of

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@triton.jit
def _store(p_y, acc, i_m, i_n, M, N, stride_ym, BM: tl.constexpr, BN: tl.constexpr):
    o_m = i_m * BM + tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    tl.store(p_y + o_m[:, None].to(tl.int64) * stride_ym + o_n[None, :], acc,
             mask=(o_m < M)[:, None] & (o_n < N)[None, :])


@triton.jit
def _mm_tma(a_desc, b_desc, p_y, M, N, K, stride_ym, BM: tl.constexpr, BN: tl.constexpr,
            BK: tl.constexpr, GROUP: tl.constexpr):
    i_m, i_n = tile_of(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = a_desc.load([i_m * BM, k0])
        b = b_desc.load([i_n * BN, k0])
        acc = tl.dot(a, b.T, acc)
    _store(p_y, acc, i_m, i_n, M, N, stride_ym, BM, BN)


@triton.jit
def _mm_tma_persistent(a_desc, b_desc, p_y, M, N, K, stride_ym, BM: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, GROUP: tl.constexpr, N_PROG: tl.constexpr):
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    n_tiles = tiles_m * tiles_n
    mine = tl.cdiv(n_tiles - tl.program_id(0), N_PROG)
    tile = tl.program_id(0) - N_PROG
    ki = -1
    i_m = 0
    i_n = 0
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for _ in tl.range(0, mine * k_tiles, flatten=True):
        ki = tl.where(ki == k_tiles - 1, 0, ki + 1)
        if ki == 0:
            tile += N_PROG
            i_m, i_n = tile_of(tile, tiles_m, tiles_n, GROUP)
        a = a_desc.load([i_m * BM, ki * BK])
        b = b_desc.load([i_n * BN, ki * BK])
        acc = tl.dot(a, b.T, acc)
        if ki == k_tiles - 1:
            _store(p_y, acc, i_m, i_n, M, N, stride_ym, BM, BN)
            acc = tl.zeros([BM, BN], dtype=tl.float32)


def mm_tma(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, cfg: tuple, persistent: bool,
           n_sm: int) -> torch.Tensor:
    bm, bn, bk, warps, stages = cfg
    m, k = a.shape
    n = b.shape[0]
    ad = TensorDescriptor.from_tensor(a, [bm, bk])
    bd = TensorDescriptor.from_tensor(b, [bn, bk])
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    if persistent:
        progs = min(n_sm, tiles)
        _mm_tma_persistent[(progs,)](ad, bd, out, m, n, k, out.stride(0), BM=bm, BN=bn, BK=bk, GROUP=8,
                                     N_PROG=progs, num_warps=warps, num_stages=stages)
    else:
        _mm_tma[(tiles,)](ad, bd, out, m, n, k, out.stride(0), BM=bm, BN=bn, BK=bk, GROUP=8,
                          num_warps=warps, num_stages=stages)
    return out


TMA_TILES = [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 4, 4), (128, 128, 64, 8, 4),
             (256, 128, 64, 8, 3), (128, 128, 128, 8, 3)]


def check() -> None:
    """The kernels' logic under the interpreter (small shapes, edges not multiples of a tile)."""
    for m, n, k in ((40, 48, 64), (70, 33, 96)):
        a = torch.randn(m, k).half()
        b = torch.randn(n, k).half()
        ref = a.float() @ b.float().T
        for persistent in (False, True):
            out = torch.zeros(m, n)
            cfg = (32, 32, 32, 4, 2)
            bm, bn, bk = cfg[:3]
            ad = TensorDescriptor.from_tensor(a, [bm, bk])
            bd = TensorDescriptor.from_tensor(b, [bn, bk])
            tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
            if persistent:
                _mm_tma_persistent[(3,)](ad, bd, out, m, n, k, out.stride(0), BM=bm, BN=bn, BK=bk, GROUP=2,
                                         N_PROG=3)
            else:
                _mm_tma[(tiles,)](ad, bd, out, m, n, k, out.stride(0), BM=bm, BN=bn, BK=bk, GROUP=2)
            err = (out - ref).abs().max().item()
            print(f"{m}x{n}x{k} persistent={persistent}: max error {err:.2e}")
            assert err < 1e-2


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--check", action="store_true", help="the interpreter's check only (CPU)")
    a = ap.parse_args(argv)
    if a.check:
        check()
        return
    from deimos.quant.triton.bench import time_graph

    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    print("| M | N x K | cuBLAS us | rule us | mm 128x256 us | best TMA us (tile, persistent) "
          "| TFLOP/s best | cuBLAS |")
    print("|---:|---|---:|---:|---:|---|---:|---:|")
    for m in a.m:
        for n, k in SHAPES:
            _shape(m, n, k, n_sm, time_graph)


def _shape(m: int, n: int, k: int, n_sm: int, time_graph) -> None:
    """One row of the table: cuBLAS, the pointer kernel's rule and wide tile, the TMA tiles."""
    x = torch.randn(m, k, device="cuda").half()
    w = torch.randn(n, k, device="cuda").half()
    ref = torch.matmul(x, w.T).float()
    out = torch.empty(m, n, device="cuda")
    t_cu = time_graph(lambda: torch.matmul(x, w.T), calls=5, reps=10)
    rule, wide = matmul_config(m, n, k)._replace(tma=False), MatmulConfig(128, 256, 64, 8, 3)
    t_rule = time_graph(lambda: matmul_f16(x, w, out=out, cfg=rule), calls=5, reps=10)
    t_wide = time_graph(lambda: matmul_f16(x, w, out=out, cfg=wide), calls=5, reps=10)
    best = (float("inf"), None)
    for cfg in TMA_TILES:
        for persistent in (False, True):
            try:
                out.zero_()
                mm_tma(x, w, out, cfg, persistent, n_sm)
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - a tile that does not fit is skipped
                print(f"  skipped {cfg} persistent={persistent}: {type(e).__name__} {str(e)[:80]}")
                continue
            err = ((out - ref).norm() / ref.norm()).item()
            if not err < 1e-3:
                print(f"  WRONG {cfg} persistent={persistent}: {err:.1e}")
                continue
            t = time_graph(lambda cfg=cfg, p=persistent: mm_tma(x, w, out, cfg, p, n_sm), calls=5, reps=10)
            print(f"  {m} {n}x{k} {cfg} persistent={persistent}: {t * 1e6:.1f} us", flush=True)
            best = min(best, (t, (cfg, persistent)), key=lambda v: v[0])
    fl = 2 * m * n * k
    print(f"| {m} | {n}x{k} | {t_cu * 1e6:.1f} | {t_rule * 1e6:.1f} | {t_wide * 1e6:.1f} | "
          f"{best[0] * 1e6:.1f} {best[1]} | {fl / best[0] / 1e12:.0f} | {fl / t_cu / 1e12:.0f} |", flush=True)

if __name__ == "__main__":
    main()
