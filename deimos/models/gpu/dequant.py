"""Dequantize a packed weight (deimos.quant.triton layout) to fp16 on the GPU, in Triton.

The interim prefill path (T > 1) until a tensor-core dequant-GEMM exists: each call writes the
whole matrix as fp16 (2 bytes per weight) and torch.matmul reads it back, so it costs
~(type bytes + 4) per weight of memory traffic on top of the GEMM. Embedding lookups use it on
a gathered subset of rows.

Tile: ``[BLOCK_N rows, BLOCK_S groups, W words, 32/W codes]`` (one thread reads one group's
16 bytes); code k of word w of group u is element ``32u + W k + w`` (layout.py). For the
matmul the columns are stored in word order (``permuted=True``: each (row, group) is one
64-byte run; x is permuted to match, ``permuted_columns``) instead of the element order's
W-strided 8-byte stores (see BENCHMARKS.md for the measured effect).
Scales per group, as the GEMV applies them: value = s * q (+ mn), where for Q4_K/Q5_K
s = d * sc, mn = -dmin * m; Q6_K s = d * sc16 (first/second half of the group); Q4_1 mn = m;
the others s = d. The code helpers are the GEMV's, so both kernels decode the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deimos.quant.triton.dequant_gemv import (
    FMT_ID,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_K,
    Q6_K,
    Q8_0,
    _codes,
    group_scales,
    weight_arrays,
)
from deimos.quant.triton.layout import PackedWeight

BLOCK_N = 16
BLOCK_S = 16
NUM_WARPS = 4


@triton.jit
def _dequant_kernel(
    p_qw, p_qh, p_s, p_d, p_m, p_out,
    N, K,
    FMT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PERMUTED: tl.constexpr,
):  # fmt: skip
    W: tl.constexpr = 8 if FMT == Q8_0 else 4
    NK: tl.constexpr = 32 // W
    HALF: tl.constexpr = NK // 2
    HAS_MIN: tl.constexpr = FMT == Q4_K or FMT == Q5_K or FMT == Q4_1
    i_n = tl.program_id(0)
    i_s = tl.program_id(1)
    S_TOTAL = K // 32
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    o_n = o_n.to(tl.int64)
    u = i_s * BLOCK_S + tl.arange(0, BLOCK_S)
    m_s = u < S_TOTAL
    o_w = tl.arange(0, W)
    o_k = tl.arange(0, NK)
    m_ns = m_n[:, None] & m_s[None, :]
    m_w = m_ns[:, :, None] & (o_w < W)[None, None, :]
    o_q = o_n[:, None, None] * (S_TOTAL * W) + u[None, :, None] * W + o_w[None, None, :]
    b_w = tl.load(p_qw + o_q, mask=m_w, other=0)[:, :, :, None]
    if FMT == Q6_K or FMT == Q5_K or FMT == Q5_0:
        b_h = tl.load(p_qh + o_q, mask=m_w, other=0).to(tl.int32)[:, :, :, None]
    else:
        b_h = b_w
    k4 = o_k[None, None, None, :]
    q = _codes(b_w, b_h, k4, FMT)  # [BLOCK_N, BLOCK_S, W, NK]: code k of word w
    s_lo, s_hi, mn = group_scales(p_s, p_d, p_m, o_n, u, m_ns, S_TOTAL, FMT)
    val = tl.where(k4 < HALF, s_lo[:, :, None, None], s_hi[:, :, None, None]) * q
    if HAS_MIN:
        val += mn[:, :, None, None]
    o_row = o_n[:, None, None, None] * K + u[None, :, None, None] * 32
    if PERMUTED:  # word-major: column 32u + NK w + k, 64 contiguous bytes per (row, group)
        o_col = o_w[None, None, :, None] * NK + k4
    else:  # element order: column 32u + W k + w
        o_col = k4 * W + o_w[None, None, :, None]
    tl.store(p_out + o_row + o_col, val.to(tl.float16), mask=m_w[:, :, :, None])


def permuted_columns(w: PackedWeight) -> torch.Tensor:
    """int64 ``[k]`` on w's device: column p of ``dequantize_fp16(w, permuted=True)`` holds
    element ``cols[p]`` of the row, so ``x[:, cols] @ Wp.T == x @ W.T``."""
    wd = 8 if w.ggml_type.name == "Q8_0" else 4
    nk = 32 // wd
    p = torch.arange(w.k, device=w.device)
    u, r = p // 32, p % 32
    return u * 32 + (r % nk) * wd + r // nk


def _kernel_args(w: PackedWeight, out: torch.Tensor) -> tuple:
    return (*weight_arrays(w), out)


def dequantize_fp16(w: PackedWeight, out: torch.Tensor | None = None,
                    permuted: bool = False) -> torch.Tensor:
    """Packed ``[n, k]`` -> fp16 ``[n, k]`` on the weight's device.

    ``permuted``: columns in the packed words' order (``permuted_columns``), which the kernel
    stores as whole 64-byte runs: what a matmul wants (permute x instead); else in element
    order (embedding rows). ``out``: optional contiguous fp16 ``[n, k]`` written in full.
    """
    if w.ggml_type not in FMT_ID:
        raise ValueError(f"dequantize_fp16: no kernel for {w.ggml_type.name}")
    if out is None:
        out = torch.empty((w.n, w.k), dtype=torch.float16, device=w.device)
    elif out.shape != (w.n, w.k) or out.dtype != torch.float16 or not out.is_contiguous():
        raise ValueError(
            f"dequantize_fp16: out must be contiguous fp16 [{w.n}, {w.k}], "
            f"got {out.dtype} {tuple(out.shape)}"
        )
    if w.n == 0:
        return out
    grid = (triton.cdiv(w.n, BLOCK_N), triton.cdiv(w.k // 32, BLOCK_S))
    _dequant_kernel[grid](
        *_kernel_args(w, out), w.n, w.k,
        FMT=FMT_ID[w.ggml_type], BLOCK_N=BLOCK_N, BLOCK_S=BLOCK_S, PERMUTED=permuted,
        num_warps=NUM_WARPS,
    )  # fmt: skip
    return out


def gather_rows(w: PackedWeight, rows: torch.Tensor) -> PackedWeight:
    """The packed weight of ``rows`` [T] (int64, on w's device): every array is row-major by
    output row, so a row gather of each array is a packed matrix of those rows."""
    picked = {name: t.index_select(0, rows) for name, t in w.tensors.items()}
    return PackedWeight(w.ggml_type, int(rows.shape[0]), w.k, picked)
