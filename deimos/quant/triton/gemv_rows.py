"""Decode GEMV on integer activations for a few rows at once (2..8: a small decode batch):
y[r, n] = sum_k W[n, k] * x[r, k], each packed weight word and each group's scales decoded ONCE
a loop step and dotted with every row's x.

gemv_q8 runs one program per (row tile, activation row): R rows decode (and read) the weights
R times, and its time grows with R. Here a program owns a row tile and all R activation rows:
the weight words, their codes (masks, fifth/high bits merged) and the group scales are made
once a step, then for each row r (ROWS a constexpr, unrolled) its x words (the two int8 planes
of QuantizedX, from L1/L2), its group sums and scale are loaded and dotted by dp4a into its
own accumulator. The extra work per row is the x loads and the dp4a's, not the decode.

Numerics: each row's float arithmetic is gemv_q8's, expression for expression (the integer
dots are exact in any order): with the same tile a row's result equals gemv_q8 on that row
alone bit for bit when the compiler reduces the [BLOCK_N, BLOCK_S] accumulator in the same
order (always in the interpreter; on the GPU the tests check it). The launch rule keeps
gemv_q8's groups per step (``block_s``) so the order of the group sums is the same, and only
rearranges threads (``rows_config``).

Oracle: the dequantized weight times ``quantize_x_reference(x)`` (gemv_q8.py), and gemv_q8
row by row.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from deimos.gguf.constants import GGMLType
from deimos.quant.triton.dequant_gemv import (
    FMT_ID,
    MAX_BATCH,
    Q2_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    gemv_grid,
    gemv_out,
    group_scales,
    group_words,
    masked_load,
    pow2_at_most,
    q2k_scales,
    scale16,
    weight_arrays,
)
from deimos.quant.triton.gemv_q8 import (
    _INTERPRETED,
    INTERPRETER_TILE,
    PLANE,
    Q8Config,
    QuantizedX,
    _dp4a,
    _q6_high,
    _spread1,
    q8_config,
    scaled_dot,
)
from deimos.quant.triton.layout import PackedWeight
from deimos.quant.triton.pdl import launch_options, pdl_on, pdl_start

MAX_ROWS = MAX_BATCH  # QuantizedX holds at most 8 rows


@triton.jit
def _row_term(p_xq, p_xd, p_xs, o_x, m_x, u, m_s, zero, c0, c1, c2, c3, c4, c5, c6, c7,
              s_lo, s_hi, mn, mn_hi, S_TOTAL, FMT: tl.constexpr, ASM: tl.constexpr,
              MASKED: tl.constexpr, SCALE16: tl.constexpr):  # fmt: skip
    """One activation row's share of a step, float32 [BLOCK_N, BLOCK_S]: xd * (the groups' dot
    of the decoded codes ``c*`` with the row's x, scales applied), written as gemv_q8's kernel
    writes it (same float expressions, same order). p_*: the row's QuantizedX entries.
    Codes by format: Q8_0 c0 = the words (SCALE16: c0, c1 = their bytes 0-1, 2-3); Q2_K
    c(2p), c(2p+1) = crumb plane p's bytes 0-1, 2-3; Q6_K c0, c1 = parity 0, 1 bytes 0-1 and
    c2, c3 = bytes 2-3; other nibble formats c0, c1 = parity 0, 1. Unused ones: anything."""
    # x plane 0 (coarse codes) at words 16u + 0..7, plane 1 (residual codes) at 16u + 8..15
    if FMT == Q8_0:
        b_x = masked_load(p_xq + o_x, m_x, MASKED)
        b_xr = masked_load(p_xq + o_x + 8, m_x, MASKED)
        if SCALE16:
            d_lo = _dp4a(c0, b_x, zero, ASM) * PLANE + _dp4a(c0, b_xr, zero, ASM)
            d_hi = _dp4a(c1, b_x, zero, ASM) * PLANE + _dp4a(c1, b_xr, zero, ASM)
        else:
            d_lo = _dp4a(c0, b_x, zero, ASM) * PLANE + _dp4a(c0, b_xr, zero, ASM)
            d_hi = d_lo
    elif FMT == Q2_K:  # crumb plane p: x word 2p + w
        x_p = masked_load(p_xq + o_x, m_x, MASKED)
        x_pr = masked_load(p_xq + o_x + 8, m_x, MASKED)
        a1 = _dp4a(c0, x_p, zero, ASM)
        a2 = _dp4a(c0, x_pr, zero, ASM)
        h1 = _dp4a(c1, x_p, zero, ASM)
        h2 = _dp4a(c1, x_pr, zero, ASM)
        x_p = masked_load(p_xq + o_x + 2, m_x, MASKED)
        x_pr = masked_load(p_xq + o_x + 10, m_x, MASKED)
        a1 = _dp4a(c2, x_p, a1, ASM)
        a2 = _dp4a(c2, x_pr, a2, ASM)
        h1 = _dp4a(c3, x_p, h1, ASM)
        h2 = _dp4a(c3, x_pr, h2, ASM)
        x_p = masked_load(p_xq + o_x + 4, m_x, MASKED)
        x_pr = masked_load(p_xq + o_x + 12, m_x, MASKED)
        a1 = _dp4a(c4, x_p, a1, ASM)
        a2 = _dp4a(c4, x_pr, a2, ASM)
        h1 = _dp4a(c5, x_p, h1, ASM)
        h2 = _dp4a(c5, x_pr, h2, ASM)
        x_p = masked_load(p_xq + o_x + 6, m_x, MASKED)
        x_pr = masked_load(p_xq + o_x + 14, m_x, MASKED)
        a1 = _dp4a(c6, x_p, a1, ASM)
        a2 = _dp4a(c6, x_pr, a2, ASM)
        h1 = _dp4a(c7, x_p, h1, ASM)
        h2 = _dp4a(c7, x_pr, h2, ASM)
        d_lo = a1 * PLANE + a2
        d_hi = h1 * PLANE + h2
    else:
        x0 = masked_load(p_xq + o_x, m_x, MASKED)  # x words 0..3: parity 0
        x1 = masked_load(p_xq + o_x + 4, m_x, MASKED)  # x words 4..7: parity 1
        x0r = masked_load(p_xq + o_x + 8, m_x, MASKED)
        x1r = masked_load(p_xq + o_x + 12, m_x, MASKED)
        d_lo = (_dp4a(c0, x0, _dp4a(c1, x1, zero, ASM), ASM) * PLANE
                + _dp4a(c0, x0r, _dp4a(c1, x1r, zero, ASM), ASM))  # fmt: skip
        if FMT == Q6_K:
            d_hi = (_dp4a(c2, x0, _dp4a(c3, x1, zero, ASM), ASM) * PLANE
                    + _dp4a(c2, x0r, _dp4a(c3, x1r, zero, ASM), ASM))  # fmt: skip
        else:
            d_hi = d_lo
    return scaled_dot(d_lo, d_hi, s_lo, s_hi, mn, mn_hi, p_xs, p_xd, u, m_s, FMT, MASKED, SCALE16)


@triton.jit
def _gemv_rows_kernel(
    p_qw, p_qh, p_s, p_d, p_m,  # weight arrays (unused ones get any pointer)
    p_xq, p_xd, p_xs, p_y,  # x codes [R, K/2] i32, scales [R, K/32] f32, code sums [R, K/16] i32, y [R, N]
    N, K,
    FMT: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
    ASM: tl.constexpr, XB: tl.constexpr = False, EVEN: tl.constexpr = False,
    PDL: tl.constexpr = False, SCALE16: tl.constexpr = False, PREFETCH: tl.constexpr = False,
):  # fmt: skip
    """Rows i_n BLOCK_N .. of all ROWS outputs. Tiles, EVEN, XB, SCALE16 as gemv_q8's kernel
    (rows past N clamped to row N - 1 for loading, never stored). PREFETCH: the next step's
    weight words are loaded before this step's dots (twice the weight bytes in flight a warp,
    for the occupancy that R rows' registers cost; the prefetch past the last group masked)."""
    pdl_start(PDL)
    W: tl.constexpr = 8 if FMT == Q8_0 else (2 if FMT == Q2_K else 4)  # weight words per group
    HAS_H: tl.constexpr = FMT == Q6_K or FMT == Q5_K or FMT == Q5_0 or FMT == Q5_1
    i_n = tl.program_id(0)
    S_TOTAL = K // 32
    MASKED: tl.constexpr = not EVEN
    o_y = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_y = o_y < N
    o_n = tl.minimum(o_y, N - 1).to(tl.int64)
    m_n = o_n >= 0  # all true: the shape the masks broadcast from
    o_s = tl.arange(0, BLOCK_S)
    o_w = tl.arange(0, W)
    XQ = K // 2  # a row's strides in QuantizedX's three arrays
    XS = 2 * S_TOTAL
    acc0 = tl.zeros([BLOCK_N, BLOCK_S], dtype=tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    acc4 = acc0
    acc5 = acc0
    acc6 = acc0
    acc7 = acc0
    if PREFETCH:
        n_w, n_h, _ = group_words(p_qw, p_qh, o_n, m_n, o_s, o_s < S_TOTAL, S_TOTAL, FMT, MASKED)
    for s0 in range(0, S_TOTAL, BLOCK_S):
        u = s0 + o_s
        m_s = u < S_TOTAL
        m_ns = m_n[:, None] & m_s[None, :]
        # the decode, once for every row: words, codes, scales
        if PREFETCH:
            b_w = n_w
            b_h = b_w
            if HAS_H:
                b_h = n_h
            u_n = u + BLOCK_S
            n_w, n_h_next, _ = group_words(p_qw, p_qh, o_n, m_n, u_n, u_n < S_TOTAL, S_TOTAL, FMT, True)
            if HAS_H:
                n_h = n_h_next
        else:
            b_w, b_h, _ = group_words(p_qw, p_qh, o_n, m_n, u, m_s, S_TOTAL, FMT, MASKED)
        if XB:
            o_x = u[None, :, None] * 16 + o_w[None, None, :]
            m_x = m_s[None, :, None] & (o_w < W)[None, None, :]
        else:
            o_x = u[None, :, None] * 16 + o_w[None, None, :] + (o_n * 0)[:, None, None]
            m_x = (m_n[:, None] & m_s[None, :])[:, :, None] & (o_w < W)[None, None, :]
        zero = tl.zeros([BLOCK_N, BLOCK_S, W], dtype=tl.int32)
        c0, c1, c2, c3, c4, c5, c6, c7 = b_w, b_w, b_w, b_w, b_w, b_w, b_w, b_w
        if FMT == Q8_0:
            if SCALE16:
                c0 = b_w & 0xFFFF
                c1 = b_w & -65536
        elif FMT == Q2_K:  # (word >> 2p) & 0x03030303: bytes 0-1 elements 0-15, 2-3: 16-31
            c = b_w & 0x03030303
            c0, c1 = c & 0xFFFF, c & -65536
            c = (b_w >> 2) & 0x03030303
            c2, c3 = c & 0xFFFF, c & -65536
            c = (b_w >> 4) & 0x03030303
            c4, c5 = c & 0xFFFF, c & -65536
            c = (b_w >> 6) & 0x03030303
            c6, c7 = c & 0xFFFF, c & -65536
        else:
            c0 = b_w & 0x0F0F0F0F
            c1 = (b_w >> 4) & 0x0F0F0F0F
            if FMT == Q6_K:
                e = _q6_high(b_h)
                c0 |= e & 0x30303030
                c1 |= (e >> 2) & 0x30303030
                c2, c3 = c0 & -65536, c1 & -65536  # bytes 2-3: elements 16-31 (second scale)
                c0, c1 = c0 & 0xFFFF, c1 & 0xFFFF
            elif FMT == Q5_K or FMT == Q5_0 or FMT == Q5_1:
                c0 |= _spread1(b_h, 0)
                c1 |= _spread1(b_h, 1)
        if FMT == Q2_K:
            s_lo, s_hi, mn, mn_hi = q2k_scales(p_s, p_d, p_m, o_n, u, m_ns, S_TOTAL, MASKED)
        else:
            s_lo, s_hi, mn = group_scales(p_s, p_d, p_m, o_n, u, m_ns, S_TOTAL, FMT, MASKED, SCALE16)
            mn_hi = mn
        # each row: its x words dotted with the codes, into its own accumulator
        acc0 += _row_term(p_xq, p_xd, p_xs, o_x, m_x, u, m_s, zero, c0, c1, c2, c3, c4, c5, c6,
                          c7, s_lo, s_hi, mn, mn_hi, S_TOTAL, FMT, ASM, MASKED, SCALE16)
        if ROWS > 1:
            acc1 += _row_term(p_xq + XQ, p_xd + S_TOTAL, p_xs + XS, o_x, m_x, u, m_s, zero,
                              c0, c1, c2, c3, c4, c5, c6, c7, s_lo, s_hi, mn, mn_hi, S_TOTAL,
                              FMT, ASM, MASKED, SCALE16)
        if ROWS > 2:
            acc2 += _row_term(p_xq + 2 * XQ, p_xd + 2 * S_TOTAL, p_xs + 2 * XS, o_x, m_x, u, m_s,
                              zero, c0, c1, c2, c3, c4, c5, c6, c7, s_lo, s_hi, mn, mn_hi,
                              S_TOTAL, FMT, ASM, MASKED, SCALE16)
        if ROWS > 3:
            acc3 += _row_term(p_xq + 3 * XQ, p_xd + 3 * S_TOTAL, p_xs + 3 * XS, o_x, m_x, u, m_s,
                              zero, c0, c1, c2, c3, c4, c5, c6, c7, s_lo, s_hi, mn, mn_hi,
                              S_TOTAL, FMT, ASM, MASKED, SCALE16)
        if ROWS > 4:
            acc4 += _row_term(p_xq + 4 * XQ, p_xd + 4 * S_TOTAL, p_xs + 4 * XS, o_x, m_x, u, m_s,
                              zero, c0, c1, c2, c3, c4, c5, c6, c7, s_lo, s_hi, mn, mn_hi,
                              S_TOTAL, FMT, ASM, MASKED, SCALE16)
        if ROWS > 5:
            acc5 += _row_term(p_xq + 5 * XQ, p_xd + 5 * S_TOTAL, p_xs + 5 * XS, o_x, m_x, u, m_s,
                              zero, c0, c1, c2, c3, c4, c5, c6, c7, s_lo, s_hi, mn, mn_hi,
                              S_TOTAL, FMT, ASM, MASKED, SCALE16)
        if ROWS > 6:
            acc6 += _row_term(p_xq + 6 * XQ, p_xd + 6 * S_TOTAL, p_xs + 6 * XS, o_x, m_x, u, m_s,
                              zero, c0, c1, c2, c3, c4, c5, c6, c7, s_lo, s_hi, mn, mn_hi,
                              S_TOTAL, FMT, ASM, MASKED, SCALE16)
        if ROWS > 7:
            acc7 += _row_term(p_xq + 7 * XQ, p_xd + 7 * S_TOTAL, p_xs + 7 * XS, o_x, m_x, u, m_s,
                              zero, c0, c1, c2, c3, c4, c5, c6, c7, s_lo, s_hi, mn, mn_hi,
                              S_TOTAL, FMT, ASM, MASKED, SCALE16)
    tl.store(p_y + o_y, tl.sum(acc0, axis=1), mask=m_y)
    if ROWS > 1:
        tl.store(p_y + N + o_y, tl.sum(acc1, axis=1), mask=m_y)
    if ROWS > 2:
        tl.store(p_y + 2 * N + o_y, tl.sum(acc2, axis=1), mask=m_y)
    if ROWS > 3:
        tl.store(p_y + 3 * N + o_y, tl.sum(acc3, axis=1), mask=m_y)
    if ROWS > 4:
        tl.store(p_y + 4 * N + o_y, tl.sum(acc4, axis=1), mask=m_y)
    if ROWS > 5:
        tl.store(p_y + 5 * N + o_y, tl.sum(acc5, axis=1), mask=m_y)
    if ROWS > 6:
        tl.store(p_y + 6 * N + o_y, tl.sum(acc6, axis=1), mask=m_y)
    if ROWS > 7:
        tl.store(p_y + 7 * N + o_y, tl.sum(acc7, axis=1), mask=m_y)


class RowsConfig(NamedTuple):
    """A launch of gemv_rows: gemv_q8's tile (``Q8Config``: block_n rows a program, block_s
    groups a step, num_warps, xb) and ``prefetch`` (the kernel's PREFETCH). A plain Q8Config
    is accepted as the same tile without prefetch."""

    block_n: int
    block_s: int
    num_warps: int
    xb: bool = False
    prefetch: bool = False


def rows_config(ggml_type: GGMLType, n: int, k: int, rows: int) -> RowsConfig:
    """The launch rule: gemv_q8's one-row tile at 32 groups a step (measured, below). The
    registers variant, kept for the x-broadcast tiles and as a sweep candidate:
    - A tile that already holds rows in registers with x broadcast (``xb``: Q8_0, the k/v
      shapes) stays: each thread loads a row's x words once for all its weight rows.
    - Rows on warps (the nibble formats, Q6_K; no x broadcast) become the same rows in
      registers, threads along the groups (``num_warps = block_s / 32``): with rows on warps
      every warp loads each activation row's x for its weight row, 64 bytes of x per 18 of
      Q4_K weights per row from L1, R times a step (estimated: an L1 bound near 350 us for
      llama 8B's matrices at 8 rows); in registers a thread's x words serve its block_n rows.
    Registers (sm_90, tools/compile_kernels.py): Q4_K (4, 32, 1, xb) 116-126 at 2 rows, 128-158
    at 4, 219-224 at 8; Q6_K (4, 64, 2, xb) 128-168 / 168-204 / 255; Q8_0 (2, 32, 1, xb) 64-168;
    Q8_0 (2, 128, 1, xb) and Q2_K from 4 rows at 255; no spills. ptxas hoists every row's x
    loads (16 words a row and group): at 8 rows a 1-warp program holds 9 of an SM's 64 warps,
    about half the weight bytes in flight of gemv_q8's one-row tiles; ``prefetch`` (off until
    measured) doubles them for ~16-32 more registers.
    """
    base = q8_config(ggml_type, n, k, 1)
    if base.xb or base.block_s < 32:
        return RowsConfig(*base)
    # measured (H200, bench/sweep_gemv.py --rows 2 / 4, llama 8B Q4_K_M, 2026-12-02): rows on
    # warps at 32 groups a step beat the registers tile above on every shape timed: Q4_K
    # 28672x4096 at 2 rows 37.9 us against 54.8, Q6_K 128256x4096 177 / 296 (2 rows) and
    # 316 / 447 (4 rows), Q6_K 4096x14336 23.2 / 48.3
    return RowsConfig(base.block_n, 32, base.num_warps, False)


def gemv_rows(w: PackedWeight, x: QuantizedX, out: torch.Tensor | None = None,
              cfg: RowsConfig | Q8Config | None = None) -> torch.Tensor:
    """y = W x for a packed quantized W ``[n, k]`` and R = 1..8 activation rows from
    ``quantize_x`` (``x.xq`` int32 ``[R, k/2]``, ``x.xd`` float32 ``[R, k/32]``, ``x.xs`` int32
    ``[R, k/16]``, contiguous): float32 ``[R, n]`` (``out`` if given: contiguous float32
    ``[R, n]``). Each weight word is decoded once for all R rows; row r equals
    ``gemv_q8(w, x row r)`` (module docstring). ``cfg``: the tile (default ``rows_config``;
    the interpreter's tile on the CPU)."""
    if w.ggml_type not in FMT_ID:
        raise ValueError(f"gemv_rows: no kernel for {w.ggml_type.name}")
    rows, k = x.shape
    if k != w.k:
        raise ValueError(f"gemv_rows: x has K = {k}, the {w.ggml_type.name} weight has K = {w.k}")
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"gemv_rows: {rows} activation rows, not in 1..{MAX_ROWS}")
    if x.xq.device != w.device:
        raise ValueError(f"gemv_rows: x is on {x.xq.device}, the weight on {w.device}")
    if not all(t.is_contiguous() for t in x):
        raise ValueError("gemv_rows: x's arrays must be contiguous")
    out = gemv_out(out, rows, w.n, x.xq.device, "gemv_rows")
    if cfg is None:
        cfg = INTERPRETER_TILE if w.device.type == "cpu" else rows_config(w.ggml_type, w.n, k, rows)
    elif not (pow2_at_most(cfg.block_n, 64) and 16 <= cfg.block_s <= 512 and pow2_at_most(cfg.block_s, 512)
              and cfg.num_warps in (1, 2, 4, 8)):  # fmt: skip
        raise ValueError(f"gemv_rows: bad tile {cfg} (block_n a power of two <= 64, block_s one in "
                         "16..512, num_warps 1, 2, 4 or 8)")
    _gemv_rows_kernel[gemv_grid(w.n, 1, cfg.block_n)[:1]](
        *weight_arrays(w), x.xq, x.xd, x.xs, out,
        w.n, k, FMT=FMT_ID[w.ggml_type], ROWS=rows, BLOCK_N=cfg.block_n, BLOCK_S=cfg.block_s,
        ASM=not _INTERPRETED, XB=cfg.xb, EVEN=(k // 32) % cfg.block_s == 0, SCALE16=scale16(w),
        PREFETCH=bool(getattr(cfg, "prefetch", False)), num_warps=cfg.num_warps,
        **launch_options(pdl_on(out.device)),
    )  # fmt: skip
    return out
