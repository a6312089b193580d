"""Dequantize a packed weight (deimos.quant.triton layout) to fp16 on the GPU, in Triton.

The prefill path (T > 1) where our dequant-GEMM was measured slower (``prefers_own_gemm``):
each call writes the whole matrix as fp16 (2 bytes per weight) and torch.matmul reads it back, so it costs
~(type bytes + 4) per weight of memory traffic on top of the GEMM. Embedding lookups use it on
a gathered subset of rows.

Tile: ``[BLOCK_N rows, BLOCK_S groups, W words, 32/W codes]`` (one thread reads one group's
16 bytes); code k of word w of group u is element ``32u + W k + w`` (layout.py). For the
matmul the columns are stored in word order (``permuted=True``: each (row, group) is one
64-byte run; x is permuted to match, ``permuted_columns``) instead of the element order's
W-strided 8-byte stores (see BENCHMARKS.md for the measured effect).
Scales per group, as the GEMV applies them: value = s * q (+ mn), where for Q4_K/Q5_K
s = d * sc, mn = -dmin * m; Q6_K s = d * sc16 (first/second half of the group); Q4_1/Q5_1 mn = m;
the others s = d. The code helpers are the GEMV's, so both kernels decode the same bits.

``dequant_matmul`` is the tensor-core dequant-GEMM: the same tile decode (``_dequant_tile``)
feeding ``tl.dot`` directly, x permuted once into the words' order. Tested against the
decoders and compiled for sm_90; ``prefers_own_gemm`` says where the engine uses it (measured
on the H200: faster than the fp16 round trip for short chunks in every format and for Q8_0
at every length; the nibble formats' in-register decode loses from 128 rows on).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from deimos.gguf.constants import GGMLType
from deimos.quant.triton.dequant_gemv import (
    FMT_ID,
    Q2_K,
    Q4_1,
    Q4_K,
    Q5_1,
    Q5_K,
    Q8_0,
    _codes,
    gemv_out,
    group_scales,
    group_words,
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
def _dequant_tile(p_qw, p_qh, p_s, p_d, p_m, o_n, m_n, u, m_s, S_TOTAL, FMT: tl.constexpr,
                  MASKED: tl.constexpr = True, SCALE16: tl.constexpr = False):
    """Rows ``o_n`` (int64) x groups ``u`` -> float32 ``[BLOCK_N, BLOCK_S, W, NK]``: element
    32u + W k + w of each row at [row, group, w, k] (masked entries 0; ``MASKED=False``:
    every (row, group) exists and nothing is masked)."""
    b_w, b_h, m_w = group_words(p_qw, p_qh, o_n, m_n, u, m_s, S_TOTAL, FMT, MASKED)
    return _decode_tile(b_w, b_h, p_s, p_d, p_m, o_n, m_n, u, m_s, S_TOTAL, FMT, MASKED, SCALE16)


@triton.jit
def _decode_tile(b_w, b_h, p_s, p_d, p_m, o_n, m_n, u, m_s, S_TOTAL, FMT: tl.constexpr,
                 MASKED: tl.constexpr = True, SCALE16: tl.constexpr = False):
    """``_dequant_tile`` from the group's words already loaded (``group_words``): loads the
    scales and decodes."""
    W: tl.constexpr = 8 if FMT == Q8_0 else (2 if FMT == Q2_K else 4)
    NK: tl.constexpr = 32 // W
    HALF: tl.constexpr = NK // 2
    HAS_MIN: tl.constexpr = FMT == Q4_K or FMT == Q5_K or FMT == Q4_1 or FMT == Q5_1
    m_ns = m_n[:, None] & m_s[None, :]
    k4 = tl.arange(0, NK)[None, None, None, :]
    q = _codes(b_w[:, :, :, None], b_h[:, :, :, None], k4, FMT)  # [BLOCK_N, BLOCK_S, W, NK]: code k of word w
    first = k4 < HALF  # elements 0-15 of the group
    if FMT == Q2_K:  # a scale and a min per 16
        s_lo, s_hi, mn_lo, mn_hi = q2k_scales(p_s, p_d, p_m, o_n, u, m_ns, S_TOTAL, MASKED)
        val = (tl.where(first, s_lo[:, :, None, None], s_hi[:, :, None, None]) * q
               - tl.where(first, mn_lo[:, :, None, None], mn_hi[:, :, None, None]))  # fmt: skip
    else:
        s_lo, s_hi, mn = group_scales(p_s, p_d, p_m, o_n, u, m_ns, S_TOTAL, FMT, MASKED, SCALE16)
        val = tl.where(first, s_lo[:, :, None, None], s_hi[:, :, None, None]) * q
        if HAS_MIN:
            val += mn[:, :, None, None]
    if MASKED:
        o_w = tl.arange(0, W)
        m_w = m_ns[:, :, None] & (o_w < W)[None, None, :]
        val = tl.where(m_w[:, :, :, None], val, 0.0)
    return val


@triton.jit
def _dequant_kernel(
    p_qw, p_qh, p_s, p_d, p_m, p_out,
    N, K,
    FMT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PERMUTED: tl.constexpr,
    SCALE16: tl.constexpr = False,
):  # fmt: skip
    W: tl.constexpr = 8 if FMT == Q8_0 else (2 if FMT == Q2_K else 4)
    NK: tl.constexpr = 32 // W
    i_n = tl.program_id(0)
    i_s = tl.program_id(1)
    S_TOTAL = K // 32
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    o_n = o_n.to(tl.int64)
    u = i_s * BLOCK_S + tl.arange(0, BLOCK_S)
    m_s = u < S_TOTAL
    val = _dequant_tile(p_qw, p_qh, p_s, p_d, p_m, o_n, m_n, u, m_s, S_TOTAL, FMT, True, SCALE16)
    o_w = tl.arange(0, W)[None, None, :, None]
    k4 = tl.arange(0, NK)[None, None, None, :]
    o_row = o_n[:, None, None, None] * K + u[None, :, None, None] * 32
    if PERMUTED:  # word-major: column 32u + NK w + k, 64 contiguous bytes per (row, group)
        o_col = o_w * NK + k4
    else:  # element order: column 32u + W k + w
        o_col = k4 * W + o_w
    m = (m_n[:, None] & m_s[None, :])[:, :, None, None] & (o_w < W) & (k4 < NK)
    tl.store(p_out + o_row + o_col, val.to(tl.float16), mask=m)


@triton.jit
def _dequant_gemm_kernel(
    p_x, p_qw, p_qh, p_s, p_d, p_m, p_y,
    M, N, K, stride_xm, stride_ym,
    FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
    EVEN_K: tl.constexpr, PREFETCH: tl.constexpr = False, SCALE16: tl.constexpr = False,
):  # fmt: skip
    """y [M, N] = xp [M, K] @ Wp^T, xp = x with its columns in the packed words' order
    (``permuted_columns``): each K step loads a contiguous fp16 x tile, decodes a
    [BLOCK_N, 32 BLOCK_S] weight tile to fp16 in registers (the same word order) and
    multiplies the two on the tensor cores (fp32 accumulation). Program ids run over the M
    tiles of one weight tile first, so a weight tile is read from memory once and its
    neighbours hit L2; rows past N are clamped for loading and never stored. PREFETCH: the
    next step's code words are loaded (into registers) before this step's are decoded, so
    their memory latency overlaps this step's decode and products."""
    BLOCK_K: tl.constexpr = BLOCK_S * 32
    pid = tl.program_id(0)
    m_tiles = tl.cdiv(M, BLOCK_M)
    i_n = pid // m_tiles
    i_m = pid % m_tiles
    S_TOTAL = K // 32
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < M
    o_y = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_n = tl.minimum(o_y, N - 1).to(tl.int64)
    m_n = o_n >= 0
    o_k = tl.arange(0, BLOCK_K)
    p_xt = p_x + o_m[:, None].to(tl.int64) * stride_xm + o_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    o_s = tl.arange(0, BLOCK_S)
    if PREFETCH:
        n_w, n_h, _ = group_words(p_qw, p_qh, o_n, m_n, o_s, o_s < S_TOTAL, S_TOTAL, FMT)
        for s0 in range(0, S_TOTAL, BLOCK_S):
            c_w = n_w
            c_h = n_h
            u_next = s0 + BLOCK_S + o_s  # past the row: masked, nothing loaded
            n_w, n_h, _ = group_words(p_qw, p_qh, o_n, m_n, u_next, u_next < S_TOTAL, S_TOTAL, FMT)
            acc = _gemm_step(acc, p_xt, c_w, c_h, p_s, p_d, p_m, o_n, m_n, m_m, o_k, s0 + o_s, s0,
                             K, S_TOTAL, FMT, EVEN_K, SCALE16, BLOCK_N, BLOCK_K)  # fmt: skip
            p_xt += BLOCK_K
    else:
        for s0 in range(0, S_TOTAL, BLOCK_S):
            u = s0 + o_s
            c_w, c_h, _ = group_words(p_qw, p_qh, o_n, m_n, u, u < S_TOTAL, S_TOTAL, FMT, not EVEN_K)
            acc = _gemm_step(acc, p_xt, c_w, c_h, p_s, p_d, p_m, o_n, m_n, m_m, o_k, u, s0,
                             K, S_TOTAL, FMT, EVEN_K, SCALE16, BLOCK_N, BLOCK_K)  # fmt: skip
            p_xt += BLOCK_K
    p_out = p_y + o_m[:, None].to(tl.int64) * stride_ym + o_y[None, :]
    tl.store(p_out, acc, mask=m_m[:, None] & (o_y < N)[None, :])


@triton.jit
def _gemm_step(acc, p_xt, c_w, c_h, p_s, p_d, p_m, o_n, m_n, m_m, o_k, u, s0, K, S_TOTAL,
               FMT: tl.constexpr, EVEN_K: tl.constexpr, SCALE16: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """One K step of the dequant-GEMM from the step's code words: decode (scales loaded
    here), load the x tile, multiply on the tensor cores; returns the new accumulator."""
    if EVEN_K:
        val = _decode_tile(c_w, c_h, p_s, p_d, p_m, o_n, m_n, u, u >= 0, S_TOTAL, FMT, False, SCALE16)
        b_x = tl.load(p_xt, mask=m_m[:, None], other=0.0)
    else:
        val = _decode_tile(c_w, c_h, p_s, p_d, p_m, o_n, m_n, u, u < S_TOTAL, S_TOTAL, FMT, True, SCALE16)
        b_x = tl.load(p_xt, mask=m_m[:, None] & (s0 * 32 + o_k < K)[None, :], other=0.0)
    b_w = tl.reshape(val, (BLOCK_N, BLOCK_K)).to(tl.float16)
    return acc + tl.dot(b_x, tl.trans(b_w), out_dtype=tl.float32)


class GemmConfig(NamedTuple):
    """A launch of the dequant-GEMM: ``block_m x block_n`` outputs a program, ``block_s``
    groups of 32 a K step, ``num_stages`` software-pipeline stages (Triton's, for x),
    ``prefetch`` (not yet measured on a GPU: the rule leaves it off)."""

    block_m: int
    block_n: int
    block_s: int
    num_warps: int
    num_stages: int = 3
    prefetch: bool = False  # the next K step's code words loaded before this one's decode


def gemm_config(m: int, n: int, k: int) -> GemmConfig:
    """The launch rule, from bench/sweep_gemm.py on the H200 (2026-11-29, llama 8B Q4_K_M
    and Q8_0 matrices, M = 16, 64, 128, 512; BENCHMARKS.md): 16-row tiles for a 16-row
    chunk, 64 x 64 up to 64 rows, then 128-row tiles, 64 wide up to 16384 output rows."""
    del k
    if m <= 16:
        return GemmConfig(16, 64, 2, 4, 3)
    if m <= 64:
        return GemmConfig(64, 64, 2, 4, 3)
    return GemmConfig(128, 64 if n <= 16384 else 128, 2, 4, 3)


OWN_GEMM_MAX_ROWS = 64


def prefers_own_gemm(ggml_type: GGMLType, m: int) -> bool:
    """Whether ``dequant_matmul`` beat fp16 dequantization + cuBLAS for an ``m``-row product
    on the H200 (bench/sweep_gemm.py, BENCHMARKS.md): up to 64 rows in every format (the
    round trip writes and reads the whole fp16 matrix whatever m is: 8B Q4_K_M's linears
    21.8 vs 26.1 ms at m = 16), and Q8_0's layout at every m (35.5 vs 42.9 ms at m = 512,
    where its decode is cheap and its fp16 expansion dear); the nibble formats' decode costs
    more than the round trip from 128 rows on (28.0 vs 26.7 ms; 62.0 vs 32.5 at 512)."""
    return ggml_type == GGMLType.Q8_0 or m <= OWN_GEMM_MAX_ROWS


def dequant_matmul(w: PackedWeight, x: torch.Tensor, out: torch.Tensor | None = None,
                   cols: torch.Tensor | None = None, cfg: GemmConfig | None = None) -> torch.Tensor:
    """y = x @ W^T for a packed W ``[n, k]`` and x ``[M, k]`` (fp16/bf16/fp32): float32
    ``[M, n]``, the weights never written out as fp16. x is rounded to fp16 for the tensor
    cores (as the cuBLAS path does) and its columns put in the packed order (``cols``: w's
    ``permuted_columns``, computed when not given)."""
    if w.ggml_type not in FMT_ID:
        raise ValueError(f"dequant_matmul: no kernel for {w.ggml_type.name}")
    if x.dim() != 2 or x.shape[1] != w.k:
        raise ValueError(f"dequant_matmul: x must be [M, {w.k}], got {tuple(x.shape)}")
    if x.device != w.device:
        raise ValueError(f"dequant_matmul: x is on {x.device}, the weight on {w.device}")
    m = x.shape[0]
    out = gemv_out(out, m, w.n, x.device, "dequant_matmul")
    if m == 0 or w.n == 0:
        return out
    xp = x.to(torch.float16)[:, permuted_columns(w) if cols is None else cols]
    if cfg is None:
        cfg = gemm_config(m, w.n, w.k)
    elif not (all(pow2_at_most(v, 256) and v >= 16 for v in (cfg.block_m, cfg.block_n))
              and pow2_at_most(cfg.block_s, 32) and cfg.num_warps in (1, 2, 4, 8)
              and 1 <= cfg.num_stages <= 5):  # fmt: skip
        raise ValueError(f"dequant_matmul: bad tile {cfg} (block_m, block_n powers of two in "
                         "16..256, block_s one in 1..32, num_warps 1, 2, 4 or 8, 1..5 stages)")
    grid = (triton.cdiv(w.n, cfg.block_n) * triton.cdiv(m, cfg.block_m),)
    _dequant_gemm_kernel[grid](
        xp, *weight_arrays(w), out, m, w.n, w.k, xp.stride(0), out.stride(0),
        FMT=FMT_ID[w.ggml_type], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_S=cfg.block_s, EVEN_K=(w.k // 32) % cfg.block_s == 0, PREFETCH=cfg.prefetch,
        SCALE16=scale16(w),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
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
        SCALE16=scale16(w),
        num_warps=NUM_WARPS,
    )  # fmt: skip
    return out


def gather_rows(w: PackedWeight, rows: torch.Tensor) -> PackedWeight:
    """The packed weight of ``rows`` [T] (int64, on w's device): every array is row-major by
    output row, so a row gather of each array is a packed matrix of those rows."""
    picked = {name: t.index_select(0, rows) for name, t in w.tensors.items()}
    return PackedWeight(w.ggml_type, int(rows.shape[0]), w.k, picked)
