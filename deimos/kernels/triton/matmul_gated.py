"""A gated MLP's input half in one launch (Triton): y = act(a @ g^T) * (a @ u^T) for fp16
``a [M, K]`` and a fused gate/up weight ``b [2F, K]`` (g its first F rows, u the next F, as
LinearGroup packs them), float16 ``y [M, F]``. Oracle: ``matmul_gated_reference``.

Why: matmul_f16 then ``gated_act`` writes the [M, 2F] product as float32 and reads it back
(235 MB a layer for llama 8B's gate/up at 2,048 tokens, twice) and launches once more; here
each program keeps a gate tile and the matching up tile in two accumulators and stores only
the activation, rounded to float16 (what the down projection's matmul reads). The values are
gated_act's: act(g) * u in float32 from the float32 products, rounded once.

Tiles are matmul_f16's rule for [M, 2F] (``matmul_config``) with its block_n split between
the two accumulators (``block_n / 2`` gate rows and as many up rows a program: the same
registers and shared memory as the plain tile), its TMA kernel where the rule takes TMA and
the operands fit it (``tma_fits``), the pointer loads otherwise; no K splits. Gate rows past F
in the last tile are read (up's first rows, or clamped) but never stored.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from deimos.kernels.triton.activation import ACTIVATIONS, gated_value
from deimos.kernels.triton.matmul import (
    GROUP_M,
    TMA_ON,
    MatmulConfig,
    _check,
    load_k,
    matmul_config,
    tile_of,
    tma_fits,
)
from deimos.quant.triton.pdl import launch_options, pdl_on, pdl_start


@triton.jit
def _gated_kernel(p_a, p_b, p_y, M, F, K, stride_am, stride_bn, stride_ym, BLOCK_M: tl.constexpr,
                  BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, EVEN_K: tl.constexpr,
                  ACT: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    """Program: rows i_m BLOCK_M .. + BLOCK_M of a, gate rows i_f BLOCK_F .. + BLOCK_F of b and
    the up rows F further; rows past M / F clamped for loading, never stored."""
    pdl_start(PDL)
    i_m, i_f = tile_of(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(F, BLOCK_F), GROUP)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_f = i_f * BLOCK_F + tl.arange(0, BLOCK_F)
    o_k = tl.arange(0, BLOCK_K)
    r_m = tl.minimum(o_m, M - 1).to(tl.int64)
    r_f = tl.minimum(o_f, F - 1).to(tl.int64)
    p_at = p_a + r_m[:, None] * stride_am + o_k[None, :]
    p_gt = p_b + r_f[:, None] * stride_bn + o_k[None, :]
    p_ut = p_gt + F.to(tl.int64) * stride_bn
    acc_g = tl.zeros([BLOCK_M, BLOCK_F], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_F], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        b_a = load_k(p_at, k0, o_k, K, EVEN_K)
        b_g = load_k(p_gt, k0, o_k, K, EVEN_K)
        b_u = load_k(p_ut, k0, o_k, K, EVEN_K)
        acc_g = tl.dot(b_a, tl.trans(b_g), acc_g, out_dtype=tl.float32)
        acc_u = tl.dot(b_a, tl.trans(b_u), acc_u, out_dtype=tl.float32)
        p_at += BLOCK_K
        p_gt += BLOCK_K
        p_ut += BLOCK_K
    y = gated_value(acc_g, acc_u, ACT).to(tl.float16)
    p_out = p_y + o_m[:, None].to(tl.int64) * stride_ym + o_f[None, :]
    tl.store(p_out, y, mask=(o_m < M)[:, None] & (o_f < F)[None, :])


@triton.jit
def _gated_tma_kernel(a_desc, b_desc, p_y, M, F, K, stride_ym, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr,
                      BLOCK_K: tl.constexpr, GROUP: tl.constexpr, ACT: tl.constexpr,
                      PDL: tl.constexpr = False):  # fmt: skip
    """``_gated_kernel``'s program with its tiles loaded through tensor descriptors (zeros past
    M, 2F and K)."""
    pdl_start(PDL)
    i_m, i_f = tile_of(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(F, BLOCK_F), GROUP)
    acc_g = tl.zeros([BLOCK_M, BLOCK_F], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_F], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        b_a = a_desc.load([i_m * BLOCK_M, k0])
        b_g = b_desc.load([i_f * BLOCK_F, k0])
        b_u = b_desc.load([F + i_f * BLOCK_F, k0])
        acc_g = tl.dot(b_a, tl.trans(b_g), acc_g, out_dtype=tl.float32)
        acc_u = tl.dot(b_a, tl.trans(b_u), acc_u, out_dtype=tl.float32)
    y = gated_value(acc_g, acc_u, ACT).to(tl.float16)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_f = i_f * BLOCK_F + tl.arange(0, BLOCK_F)
    p_out = p_y + o_m[:, None].to(tl.int64) * stride_ym + o_f[None, :]
    tl.store(p_out, y, mask=(o_m < M)[:, None] & (o_f < F)[None, :])


def gated_config(m: int, f: int, k: int, tma: bool = TMA_ON) -> MatmulConfig:
    """The tile: matmul_f16's rule for [M, 2F] without splits (``tma``: its TMA tiles), its
    block_n the gate and up rows together (``block_n / 2`` of each, at least 16)."""
    cfg = matmul_config(m, 2 * f, k, tma)
    return cfg._replace(block_n=max(32, cfg.block_n), splits=1)


def matmul_gated(a: torch.Tensor, b: torch.Tensor, activation: str, out: torch.Tensor | None = None,
                 cfg: MatmulConfig | None = None) -> torch.Tensor:
    """float16 ``[M, F]`` = act(a @ b[:F]^T) * (a @ b[F:]^T): a ``[M, K]`` and b ``[2F, K]``
    fp16 with unit column stride (rows may be strided), on one CUDA device (or the
    interpreter); ``activation`` "silu" or "gelu_tanh" (gated_act's). ``out``: optional
    float16 ``[M, F]`` with unit column stride. ``cfg``: a tile (default ``gated_config``;
    block_n counts gate and up rows together, so it is even, >= 32; no splits)."""
    m, k, n2 = _check(a, b, "matmul_gated")
    if activation not in ACTIVATIONS:
        raise ValueError(f"matmul_gated: unknown activation {activation!r}")
    if n2 % 2:
        raise ValueError(f"matmul_gated: b must be [2F, K] (gate rows, then up rows), got {n2} rows")
    f = n2 // 2
    if out is None:
        out = torch.empty((m, f), dtype=torch.float16, device=a.device)
    elif out.shape != (m, f) or out.dtype != torch.float16 or (f > 1 and out.stride(1) != 1):
        raise ValueError(f"matmul_gated: out must be float16 [{m}, {f}] with unit column stride, "
                         f"got {out.dtype} {tuple(out.shape)}")
    if m == 0 or f == 0:
        return out
    if cfg is None:
        cfg = gated_config(m, f, k, tma=TMA_ON and m > 256 and tma_fits(a, b))
    elif not (all(v >= 16 and v & (v - 1) == 0 and v <= 256 for v in (cfg.block_m, cfg.block_k))
              and cfg.block_n in (32, 64, 128, 256, 512) and cfg.num_warps in (1, 2, 4, 8)
              and 1 <= cfg.num_stages <= 5 and cfg.splits == 1):  # fmt: skip
        raise ValueError(f"matmul_gated: bad tile {cfg} (block_m, block_k powers of two in 16..256, "
                         "block_n (gate and up rows) one in 32..512, num_warps 1, 2, 4 or 8, 1..5 stages, "
                         "no splits)")
    if k == 0:  # both products 0: act(0) * 0
        return out.zero_()
    bf = cfg.block_n // 2
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(f, bf),)
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(pdl_on(a.device)))
    act = ACTIVATIONS[activation]
    if cfg.tma and tma_fits(a, b):
        a_desc = TensorDescriptor.from_tensor(a, [cfg.block_m, cfg.block_k])
        b_desc = TensorDescriptor.from_tensor(b, [bf, cfg.block_k])
        _gated_tma_kernel[grid](a_desc, b_desc, out, m, f, k, out.stride(0), BLOCK_M=cfg.block_m, BLOCK_F=bf,
                                BLOCK_K=cfg.block_k, GROUP=GROUP_M, ACT=act, **opts)
    else:
        _gated_kernel[grid](a, b, out, m, f, k, a.stride(0), b.stride(0), out.stride(0), BLOCK_M=cfg.block_m,
                            BLOCK_F=bf, BLOCK_K=cfg.block_k, GROUP=GROUP_M, EVEN_K=k % cfg.block_k == 0,
                            ACT=act, **opts)
    return out


def matmul_gated_reference(a: torch.Tensor, b: torch.Tensor, activation: str) -> torch.Tensor:
    """The oracle: both products in float64 on the CPU, then gated_act, as float32."""
    from deimos.kernels.activation import gated_act

    y = a.double().cpu() @ b.double().cpu().T
    f = b.shape[0] // 2
    return gated_act(y[:, :f], y[:, f:], activation).float()
