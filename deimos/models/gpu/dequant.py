"""Dequantize a packed weight (deimos.quant.triton layout) to fp16 on the GPU, in Triton: the
first half of prefill's linears (T > 1), whose second half is our fp16 tensor-core matmul
(deimos.kernels.triton.matmul), and of embedding lookups (a gathered subset of rows).

Two kernels. ``_dequant_words_kernel`` (``dequantize_fp16(permuted=True)``, the matmul's) streams:
a program reads a contiguous run of a row's code words and writes each word's codes as one
contiguous run, so the columns come out in the words' order (``permuted_columns``; x is
permuted to match) at 3.0-3.9 TB/s on the H200, near a plain fp16 copy's rate (BENCHMARKS.md).
``_dequant_kernel`` writes element order (embedding rows): tile ``[BLOCK_N rows, BLOCK_S
groups, W words, 32/W codes]``, code k of word w of group u is element ``32u + W k + w``
(layout.py).
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
    group_words,
    masked_load,
    pow2_at_most,
    q2k_scales,
    scale16,
    weight_arrays,
    words_per_group,
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
    SCALE16: tl.constexpr = False,
):  # fmt: skip
    """Packed ``[N, K]`` -> fp16 in element order: rows ``BLOCK_N`` x groups ``BLOCK_S`` a
    program, decoded as ``[BLOCK_N, BLOCK_S, W, NK]`` (element 32u + W k + w of each row at
    [row, group, w, k])."""
    W: tl.constexpr = 8 if FMT == Q8_0 else (2 if FMT == Q2_K else 4)
    NK: tl.constexpr = 32 // W
    HAS_MIN: tl.constexpr = FMT == Q4_K or FMT == Q5_K or FMT == Q4_1 or FMT == Q5_1
    S_TOTAL = K // 32
    o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    o_n = o_n.to(tl.int64)
    u = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    m_s = u < S_TOTAL
    m_ns = m_n[:, None] & m_s[None, :]
    b_w, b_h, m_w = group_words(p_qw, p_qh, o_n, m_n, u, m_s, S_TOTAL, FMT)
    k4 = tl.arange(0, NK)[None, None, None, :]
    q = _codes(b_w[:, :, :, None], b_h[:, :, :, None], k4, FMT)  # [BLOCK_N, BLOCK_S, W, NK]
    first = k4 < NK // 2  # elements 0-15 of the group
    if FMT == Q2_K:  # a scale and a min per 16
        s_lo, s_hi, mn_lo, mn_hi = q2k_scales(p_s, p_d, p_m, o_n, u, m_ns, S_TOTAL)
        val = (tl.where(first, s_lo[:, :, None, None], s_hi[:, :, None, None]) * q
               - tl.where(first, mn_lo[:, :, None, None], mn_hi[:, :, None, None]))  # fmt: skip
    else:
        s_lo, s_hi, mn = group_scales(p_s, p_d, p_m, o_n, u, m_ns, S_TOTAL, FMT, True, SCALE16)
        val = tl.where(first, s_lo[:, :, None, None], s_hi[:, :, None, None]) * q
        if HAS_MIN:
            val += mn[:, :, None, None]
    o_w = tl.arange(0, W)[None, None, :, None]
    o_row = o_n[:, None, None, None] * K + u[None, :, None, None] * 32
    tl.store(p_out + o_row + k4 * W + o_w, val.to(tl.float16), mask=m_w[:, :, :, None] & (k4 < NK))


@triton.jit
def _dequant_words_kernel(
    p_qw, p_qh, p_s, p_d, p_m, p_out,
    N, K,
    FMT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_J: tl.constexpr,
    EVEN: tl.constexpr,
    SCALE16: tl.constexpr = False,
    HALF: tl.constexpr = False,
):  # fmt: skip
    """Packed ``[N, K]`` -> fp16 in the words' order (``permuted_columns``), streamed: a
    program takes ``BLOCK_R`` rows x ``BLOCK_J`` consecutive code words of each (a contiguous
    run of the packed array) and writes word j's NK = 32 / W codes to columns NK j .. NK j +
    NK - 1 (one contiguous run of the output). EVEN: the tiles divide N and the words of a row
    (no masks). HALF: codes, scales and products in float16 (the scales rounded to float16
    before the product; the output is float16 either way)."""
    W: tl.constexpr = 8 if FMT == Q8_0 else (2 if FMT == Q2_K else 4)
    NK: tl.constexpr = 32 // W
    HAS_MIN: tl.constexpr = FMT == Q4_K or FMT == Q5_K or FMT == Q4_1 or FMT == Q5_1
    DT: tl.constexpr = tl.float16 if HALF else tl.float32
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
    q = _codes(b_w[:, :, None], b_h[:, :, None], k, FMT, HALF)  # [BLOCK_R, BLOCK_J, NK]
    first = k < NK // 2  # the group's elements 0-15
    u = o_j // W
    if FMT == Q2_K:
        s_lo, s_hi, mn_lo, mn_hi = q2k_scales(p_s, p_d, p_m, o_r, u, m, S_TOTAL, not EVEN)
        val = (tl.where(first, s_lo.to(DT)[:, :, None], s_hi.to(DT)[:, :, None]) * q
               - tl.where(first, mn_lo.to(DT)[:, :, None], mn_hi.to(DT)[:, :, None]))  # fmt: skip
    else:
        s_lo, s_hi, mn = group_scales(p_s, p_d, p_m, o_r, u, m, S_TOTAL, FMT, not EVEN, SCALE16)
        val = tl.where(first, s_lo.to(DT)[:, :, None], s_hi.to(DT)[:, :, None]) * q
        if HAS_MIN:
            val += mn.to(DT)[:, :, None]
    p = p_out + o_r[:, None, None] * K + (o_j * NK)[None, :, None] + k
    if EVEN:
        tl.store(p, val.to(tl.float16))
    else:
        tl.store(p, val.to(tl.float16), mask=m[:, :, None])


class DequantConfig(NamedTuple):
    """A launch of the streaming dequantization (``_dequant_words_kernel``)."""

    block_r: int  # rows a program
    block_j: int  # code words of each row a program
    num_warps: int
    half: bool = False  # decode in float16


def dequant_config(n: int, k: int) -> DequantConfig:
    """The launch rule, from bench/sweep_gemm.py on the H200 (2026-11-29, llama 8B Q4_K_M and
    Q8_0 matrices, 18 tiles each: these two tiles within 5% of the best on every matrix,
    3.0-3.9 TB/s against a 3.5-4.3 TB/s fp16 copy of the same output). The decode in float32:
    float16 (``half``) was within 5% either way in time, and for the formats with a min it
    rounds s q and the min apart before they cancel (~2.5x the error)."""
    return DequantConfig(2, 512, 4) if n * k >= 1 << 26 else DequantConfig(1, 256, 2)


# Triton's interpreter (CPU tensors) runs the programs one after another: there the fewest
# programs win (64 x 64 words: ~40x faster than the GPU rule's tiles on tests' matrices)
INTERPRETER_TILE = DequantConfig(64, 64, 4)


def _kernel_args(w: PackedWeight, out: torch.Tensor) -> tuple:
    return (*weight_arrays(w), out)


def dequantize_fp16(w: PackedWeight, out: torch.Tensor | None = None,
                    permuted: bool = False, cfg: DequantConfig | None = None) -> torch.Tensor:
    """Packed ``[n, k]`` -> fp16 ``[n, k]`` on the weight's device.

    ``permuted``: columns in the packed words' order (``permuted_columns``), which the
    streaming kernel writes as contiguous runs: what a matmul wants (permute x instead), with
    ``cfg`` its tile (default ``dequant_config``, or ``INTERPRETER_TILE`` for a weight on the
    CPU); else in element order (embedding rows).
    ``out``: optional contiguous fp16 ``[n, k]`` written in full.
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
    if cfg is not None and not (permuted and pow2_at_most(cfg.block_r, 256)
                                and pow2_at_most(cfg.block_j, 1024) and cfg.num_warps in (1, 2, 4, 8)):  # fmt: skip
        raise ValueError(f"dequantize_fp16: bad tile {cfg} (the word-order kernel's: block_r a "
                         "power of two up to 256, block_j up to 1024, num_warps 1, 2, 4 or 8)")
    if w.n == 0:
        return out
    if permuted:
        cfg = cfg or (INTERPRETER_TILE if w.device.type == "cpu" else dequant_config(w.n, w.k))
        words = w.k // (32 // words_per_group(w.ggml_type))
        grid = (triton.cdiv(w.n, cfg.block_r), triton.cdiv(words, cfg.block_j))
        _dequant_words_kernel[grid](
            *_kernel_args(w, out), w.n, w.k,
            FMT=FMT_ID[w.ggml_type], BLOCK_R=cfg.block_r, BLOCK_J=cfg.block_j,
            EVEN=w.n % cfg.block_r == 0 and words % cfg.block_j == 0, SCALE16=scale16(w),
            HALF=cfg.half, num_warps=cfg.num_warps,
        )  # fmt: skip
        return out
    grid = (triton.cdiv(w.n, BLOCK_N), triton.cdiv(w.k // 32, BLOCK_S))
    _dequant_kernel[grid](
        *_kernel_args(w, out), w.n, w.k,
        FMT=FMT_ID[w.ggml_type], BLOCK_N=BLOCK_N, BLOCK_S=BLOCK_S, SCALE16=scale16(w),
        num_warps=NUM_WARPS,
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
