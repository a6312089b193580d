"""Dequantize a packed weight (deimos.quant.triton layout) to fp16 on the GPU, in Triton: the
first half of prefill's linears (T > 1), whose second half is our fp16 tensor-core matmul
(deimos.kernels.triton.matmul), and of embedding lookups (a gathered subset of rows).

One kernel (``_dequant_kernel``) streams: a program reads a contiguous run of a row's code
words (code k of word w of group u is element ``32u + W k + w``, layout.py). For the matmul
it writes each word's codes as one contiguous run, so the columns come out in the words'
order (``permuted_columns``; x is permuted to match), at 3.0-3.9 TB/s on the H200, near a
plain fp16 copy's rate (BENCHMARKS.md); for embedding rows, at the elements' columns.
Scales per group, as the GEMV applies them: value = s * q (+ mn), where for Q4_K/Q5_K
s = d * sc, mn = -dmin * m; Q6_K s = d * sc16 (first/second half of the group); Q4_1/Q5_1 mn = m;
the others s = d. The code helpers are the GEMV's, so every kernel decodes the same bits.

A fused dequant-GEMM (the weight tile decoded in registers feeding ``tl.dot``) stood here
until it was measured 1.0-3.4x slower than the two kernels one after the other at every
prompt length on llama 8B (BENCHMARKS.md, 2026-11-29): its decode, repeated for every M tile,
kept the tensor cores waiting.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from deimos.quant.triton.dequant_gemv import (
    FMT_ID,
    Q2_K,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    _codes,
    group_scales,
    masked_load,
    pow2_at_most,
    q2k_scales,
    scale16,
    weight_arrays,
    words_per_group,
)
from deimos.quant.triton.layout import PackedWeight


@triton.jit
def _dequant_kernel(
    p_qw, p_qh, p_s, p_d, p_m, p_out,
    N, K,
    FMT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_J: tl.constexpr,
    EVEN: tl.constexpr,
    PERMUTED: tl.constexpr,
    SCALE16: tl.constexpr = False,
):  # fmt: skip
    """Packed ``[N, K]`` -> fp16, streamed: a program takes ``BLOCK_R`` rows x ``BLOCK_J``
    consecutive code words of each (a contiguous run of the packed array); word j is code
    word w = j % W of group u = j // W, its code k element 32u + W k + w. PERMUTED: stored in
    the words' order (``permuted_columns``: word j's NK = 32 / W codes at columns NK j ..
    NK j + NK - 1, one contiguous run a word); else at the elements' columns. EVEN: the tiles
    divide N and the words of a row (no masks)."""
    W: tl.constexpr = 8 if FMT == Q8_0 else (2 if FMT == Q2_K else 4)
    NK: tl.constexpr = 32 // W
    HAS_MIN: tl.constexpr = FMT == Q4_K or FMT == Q5_K or FMT == Q4_1 or FMT == Q5_1
    J_TOTAL = K // NK
    S_TOTAL = K // 32
    o_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    o_j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    m = (o_r < N)[:, None] & (o_j < J_TOTAL)[None, :]
    o_r = o_r.to(tl.int64)
    o_q = o_r[:, None] * J_TOTAL + o_j[None, :]
    b_w = masked_load(p_qw + o_q, m, not EVEN)
    if FMT == Q6_K or FMT == Q5_K or FMT == Q5_0 or FMT == Q5_1:
        b_h = masked_load(p_qh + o_q, m, not EVEN).to(tl.int32)
    else:
        b_h = b_w
    k = tl.arange(0, NK)[None, None, :]
    q = _codes(b_w[:, :, None], b_h[:, :, None], k, FMT)  # [BLOCK_R, BLOCK_J, NK]
    first = k < NK // 2  # the group's elements 0-15
    u = o_j // W
    if FMT == Q2_K:
        s_lo, s_hi, mn_lo, mn_hi = q2k_scales(p_s, p_d, p_m, o_r, u, m, S_TOTAL, not EVEN)
        val = (tl.where(first, s_lo[:, :, None], s_hi[:, :, None]) * q
               - tl.where(first, mn_lo[:, :, None], mn_hi[:, :, None]))  # fmt: skip
    else:
        s_lo, s_hi, mn = group_scales(p_s, p_d, p_m, o_r, u, m, S_TOTAL, FMT, not EVEN, SCALE16)
        val = tl.where(first, s_lo[:, :, None], s_hi[:, :, None]) * q
        if HAS_MIN:
            val += mn[:, :, None]
    if PERMUTED:
        col = (o_j * NK)[None, :, None] + k
    else:
        col = (u * 32 + o_j % W)[None, :, None] + k * W
    p = p_out + o_r[:, None, None] * K + col
    if EVEN:
        tl.store(p, val.to(tl.float16))
    else:
        tl.store(p, val.to(tl.float16), mask=m[:, :, None])


class DequantConfig(NamedTuple):
    """A launch of the dequantization (``_dequant_kernel``)."""

    block_r: int  # rows a program
    block_j: int  # code words of each row a program
    num_warps: int


def dequant_config(n: int, k: int) -> DequantConfig:
    """The launch rule, from bench/sweep_gemm.py on the H200 (2026-11-29, llama 8B Q4_K_M and
    Q8_0 matrices, 18 tiles each: these two tiles within 5% of the best on every matrix,
    3.0-3.9 TB/s against a 3.5-4.3 TB/s fp16 copy of the same output; the sweep also tried a
    float16 decode: within 5% either way in time, and for the formats with a min it rounded
    s q and the min apart before they cancel, ~2.5x the error: not kept)."""
    return DequantConfig(2, 512, 4) if n * k >= 1 << 26 else DequantConfig(1, 256, 2)


# Triton's interpreter (CPU tensors) runs the programs one after another: there the fewest
# programs win (64 x 64 words: ~40x faster than the GPU rule's tiles on tests' matrices)
INTERPRETER_TILE = DequantConfig(64, 64, 4)


def dequantize_fp16(w: PackedWeight, out: torch.Tensor | None = None,
                    permuted: bool = False, cfg: DequantConfig | None = None) -> torch.Tensor:
    """Packed ``[n, k]`` -> fp16 ``[n, k]`` on the weight's device.

    ``permuted``: columns in the packed words' order (``permuted_columns``), each word's codes
    one contiguous run: what a matmul wants (permute x instead); else in element order
    (embedding rows). ``cfg``: the tile (default ``dequant_config``, or ``INTERPRETER_TILE``
    for a weight on the CPU). ``out``: optional contiguous fp16 ``[n, k]`` written in full.
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
    if cfg is None:
        cfg = INTERPRETER_TILE if w.device.type == "cpu" else dequant_config(w.n, w.k)
    elif not (pow2_at_most(cfg.block_r, 256) and pow2_at_most(cfg.block_j, 1024)
              and cfg.num_warps in (1, 2, 4, 8)):  # fmt: skip
        raise ValueError(f"dequantize_fp16: bad tile {cfg} (block_r a power of two up to 256, "
                         "block_j one up to 1024, num_warps 1, 2, 4 or 8)")
    if w.n == 0:
        return out
    words = w.k // (32 // words_per_group(w.ggml_type))
    grid = (triton.cdiv(w.n, cfg.block_r), triton.cdiv(words, cfg.block_j))
    _dequant_kernel[grid](
        *weight_arrays(w), out, w.n, w.k,
        FMT=FMT_ID[w.ggml_type], BLOCK_R=cfg.block_r, BLOCK_J=cfg.block_j,
        EVEN=w.n % cfg.block_r == 0 and words % cfg.block_j == 0, PERMUTED=permuted,
        SCALE16=scale16(w), num_warps=cfg.num_warps,
    )  # fmt: skip
    return out


def permuted_columns(w: PackedWeight) -> torch.Tensor:
    """int64 ``[k]`` on w's device: column p of ``dequantize_fp16(w, permuted=True)`` holds
    element ``cols[p]`` of the row, so ``x[:, cols] @ Wp.T == x @ W.T``."""
    wd = words_per_group(w.ggml_type)
    nk = 32 // wd
    p = torch.arange(w.k, device=w.device)
    u, r = p // 32, p % 32
    return u * 32 + (r % nk) * wd + r // nk


def gather_rows(w: PackedWeight, rows: torch.Tensor) -> PackedWeight:
    """The packed weight of ``rows`` [T] (int64, on w's device): every array is row-major by
    output row, so a row gather of each array is a packed matrix of those rows."""
    picked = {name: t.index_select(0, rows) for name, t in w.tensors.items()}
    return PackedWeight(w.ggml_type, int(rows.shape[0]), w.k, picked)
