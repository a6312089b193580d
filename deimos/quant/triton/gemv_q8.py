"""Decode GEMV on integer activations: y[b, n] = sum_k W[n, k] * x[b, k] with x turned once
per activation into 15-bit fixed point per group of 32 (x = d * (254 q1 + q2), q1 and q2
int8: two code planes) and the weight codes multiplied with both planes by ``dp4a`` (four
int8 products summed in one instruction).

Why two planes: one int8 plane (llama.cpp's q8_1) moves a tiny random model's decode logits
by 2.5e-2 relative RMS against the float32 reference (measured on the H200); the second plane
makes x exact to ~1e-5 of each group's max for one more dp4a per word.

Why: the fp32 kernel (dequant_gemv.py) spends ~5 instructions per weight (extract, convert,
FMA, an x load) against a budget of ~4 at the bandwidth roof, and reads 4 bytes of x per
weight from L1/L2. Here a 32-bit word of codes is masked into four bytes (2 ops) and dotted
with four x bytes (1 op): ~0.75 instructions per weight for 4-bit codes, x is a quarter of the
bytes, and the scales are applied once per group of 32 in float.

x layout (``quantize_x``): group u of a row is sixteen int32 words, q1's eight then q2's;
byte j of word q (of either plane) is the code of element 32u + q + 8j. The weight layouts (layout.py) put code k of word w at element
32u + W k + w (W = 4 words for nibble formats, 8 for Q8_0, 2 for Q2_K), so:
  - Q8_0: weight word w and x word w hold the same four elements;
  - nibble formats: (word w >> 4p) & 0x0F0F0F0F holds codes k = p, p+2, p+4, p+6 of word w,
    elements 4p + w + 8j: x word 4p + w. Fifth bits (Q5_K, Q5_0, Q5_1) come from their array,
    moved into bit 4 of each byte by a multiply that spreads the bit fields (no carry reaches a
    kept bit; see _spread1); Q6_K's two high bits are stored so that two masks and a shift put
    them in bits 4-5 (``_q6_high``).
  - Q2_K: (word w >> 2p) & 0x03030303 holds codes p, p+4, p+8, p+12 of word w, elements
    2p + w + 8j: x word 2p + w; bytes 0-1 are the group's first 16 elements, 2-3 its last.
Offsets (Q4_0: 8, Q5_0: 16, Q6_K: 32) are subtracted as offset * sum of the x codes, exact
in integers; Q6_K's two scales per group (elements 0-15, 16-31 = bytes 0-1, 2-3) take two
dot products per word.

Oracle: the dequantized weight times ``quantize_x_reference(x)`` (torch), what the kernel
computes up to float rounding.

The interpreter cannot run inline PTX: there ``_dp4a`` is emulated with shifts (same result).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from deimos.gguf.constants import GGMLType
from deimos.quant.triton.dequant_gemv import (
    FMT_ID,
    Q2_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    activation_rows,
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
from deimos.quant.triton.pdl import ahead_on, launch_options, pdl_on, pdl_start
from deimos.quant.triton.layout import PackedWeight

# read once: whether kernels run in Triton's interpreter (no inline PTX there)
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# x is kept as the 15-bit fixed-point integer PLANE * q1 + q2 per group: two int8 planes
PLANE_INT = 254
PLANE = tl.constexpr(PLANE_INT)


@triton.jit
def _dp4a(a, b, c, ASM: tl.constexpr):
    """c + sum over the 4 bytes of int32 a, b of signed byte products."""
    if ASM:
        return tl.inline_asm_elementwise(
            "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
            dtype=tl.int32, is_pure=True, pack=1,
        )  # fmt: skip
    else:
        acc = c
        for j in tl.static_range(4):
            acc += ((a << (24 - 8 * j)) >> 24) * ((b << (24 - 8 * j)) >> 24)
        return acc


@triton.jit
def _spread1(h, p: tl.constexpr):
    """uint8 ``h`` (bit k = fifth bit of code k): bits p, p+2, p+4, p+6 -> bit 4 of bytes 0..3.
    (h >> p) & 0x55 has bits at 0, 2, 4, 6; times 0x41041 (shifts 0, 6, 12, 18) they land at
    0, 8, 16, 24; the other products meet only at bits 6, 12, 18, whose carries stop at 7, 13,
    19: no kept bit is touched."""
    return ((((h >> p) & 0x55) * 0x41041) & 0x01010101) << 4


@triton.jit
def _q6_high(h):
    """Q6_K's int16 high-bit entry (layout.Q6_HIGH_SHIFT: nibble j of codes 2j, 2j+1 at bits
    4, 12, 0, 8) -> nibble j at bits 4-7 of byte j: bits 4-5 of byte j = high bits of code 2j,
    bits 6-7 = of code 2j + 1. Sign-extended bits of h (16..31) are masked or shifted out."""
    return (h & 0xF0F0) | ((h << 20) & -0x0F100000)  # -0x0F100000 == 0xF0F00000 as int32


@triton.jit
def _gemv_q8_kernel(
    p_qw, p_qh, p_s, p_d, p_m,  # weight arrays (unused ones get any pointer)
    p_xq, p_xd, p_xs, p_y,  # x codes [B, K/2] i32, scales [B, K/32] f32, code sums [B, K/16] i32
    N, K,
    FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, ASM: tl.constexpr,
    XB: tl.constexpr = False, EVEN: tl.constexpr = False, PDL: tl.constexpr = False,
    SCALE16: tl.constexpr = False, AHEAD: tl.constexpr = False,
):  # fmt: skip
    """Program (i_n, i_b): rows i_n BLOCK_N .. of y row i_b (``gemv_q8_rows``). PDL:
    deimos.quant.triton.pdl; AHEAD (with PDL): the first weights loaded before the wait."""
    if not AHEAD:
        pdl_start(PDL)
    i_n = tl.program_id(0)  # row tiles on axis 0: a 262144-row vocabulary is 65536 tiles,
    i_b = tl.program_id(1)  # past CUDA's 65535 limit of the other axes
    y = gemv_q8_rows(p_qw, p_qh, p_s, p_d, p_m, p_xq, p_xd, p_xs, i_n, i_b, N, K, FMT=FMT,
                     BLOCK_N=BLOCK_N, BLOCK_S=BLOCK_S, ASM=ASM, XB=XB, EVEN=EVEN, SCALE16=SCALE16,
                     WAIT=AHEAD)
    o_y = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(p_y + i_b * N + o_y, y, mask=o_y < N)


@triton.jit
def _step_weights(p_qw, p_qh, p_s, p_d, p_m, o_n, m_n, u, m_s, S_TOTAL,
                  FMT: tl.constexpr, MASKED: tl.constexpr, SCALE16: tl.constexpr):
    """One loop step's weight loads (groups ``u`` of rows ``o_n``): the code words, their high
    bits' entries, the words' mask and the groups' scales (s_lo, s_hi, m_lo, m_hi: Q2_K's
    scales and mins of each half; the other formats' ``group_scales`` with m_hi = m_lo).
    Nothing here was written by another kernel of the step: a program may load it before
    waiting on the kernel before it (``gemv_q8_rows``' WAIT)."""
    m_ns = m_n[:, None] & m_s[None, :]
    b_w, b_h, m_w = group_words(p_qw, p_qh, o_n, m_n, u, m_s, S_TOTAL, FMT, MASKED)
    if FMT == Q2_K:
        s_lo, s_hi, mn_lo, mn_hi = q2k_scales(p_s, p_d, p_m, o_n, u, m_ns, S_TOTAL, MASKED)
    else:
        s_lo, s_hi, mn_lo = group_scales(p_s, p_d, p_m, o_n, u, m_ns, S_TOTAL, FMT, MASKED, SCALE16)
        mn_hi = mn_lo
    return b_w, b_h, m_w, s_lo, s_hi, mn_lo, mn_hi


@triton.jit
def _step_dot(b_w, b_h, m_w, s_lo, s_hi, mn_lo, mn_hi, p_xq, p_xd, p_xs, i_b, o_n, u, m_s, S_TOTAL,
              FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, ASM: tl.constexpr,
              XB: tl.constexpr, MASKED: tl.constexpr, SCALE16: tl.constexpr):  # fmt: skip
    """One loop step's products (``_step_weights``' loads times x row i_b's groups ``u``;
    ``p_xq`` already at the row): float32 ``[BLOCK_N, BLOCK_S]``, each group's dot times its
    x scale."""
    W: tl.constexpr = 8 if FMT == Q8_0 else (2 if FMT == Q2_K else 4)  # weight words per group
    o_w = tl.arange(0, W)
    # XB: x words [1, S, W], broadcast over the rows held in registers; else in the weights'
    # full shape (rows broadcast), the weights' register layout
    if XB:
        o_x = u[None, :, None] * 16 + o_w[None, None, :]
        m_x = m_s[None, :, None] & (o_w < W)[None, None, :]
    else:
        o_x = u[None, :, None] * 16 + o_w[None, None, :] + (o_n * 0)[:, None, None]
        m_x = m_w
    zero = tl.zeros([BLOCK_N, BLOCK_S, W], dtype=tl.int32)
    # x plane 0 (coarse codes) at words 16u + 0..7, plane 1 (residual codes) at 16u + 8..15
    if FMT == Q8_0:
        b_x = masked_load(p_xq + o_x, m_x, MASKED)
        b_xr = masked_load(p_xq + o_x + 8, m_x, MASKED)
        if SCALE16:
            w_lo = b_w & 0xFFFF
            w_hi = b_w & -65536
            d_lo = _dp4a(w_lo, b_x, zero, ASM) * PLANE + _dp4a(w_lo, b_xr, zero, ASM)
            d_hi = _dp4a(w_hi, b_x, zero, ASM) * PLANE + _dp4a(w_hi, b_xr, zero, ASM)
        else:
            d_lo = _dp4a(b_w, b_x, zero, ASM) * PLANE + _dp4a(b_w, b_xr, zero, ASM)
            d_hi = d_lo
    elif FMT == Q2_K:  # (word >> 2p) & 0x03030303: elements 2p + w + 8j, x word 2p + w
        a1, a2, h1, h2 = zero, zero, zero, zero
        for p in tl.static_range(4):
            x_p = masked_load(p_xq + o_x + 2 * p, m_x, MASKED)
            x_pr = masked_load(p_xq + o_x + 8 + 2 * p, m_x, MASKED)
            c = (b_w >> (2 * p)) & 0x03030303
            c_lo = c & 0xFFFF  # bytes 0-1: elements 0-15 (first scale and min)
            c_hi = c & -65536
            a1 = _dp4a(c_lo, x_p, a1, ASM)
            a2 = _dp4a(c_lo, x_pr, a2, ASM)
            h1 = _dp4a(c_hi, x_p, h1, ASM)
            h2 = _dp4a(c_hi, x_pr, h2, ASM)
        d_lo = a1 * PLANE + a2
        d_hi = h1 * PLANE + h2
    else:
        x0 = masked_load(p_xq + o_x, m_x, MASKED)  # x words 0..3: parity 0
        x1 = masked_load(p_xq + o_x + 4, m_x, MASKED)  # x words 4..7: parity 1
        x0r = masked_load(p_xq + o_x + 8, m_x, MASKED)
        x1r = masked_load(p_xq + o_x + 12, m_x, MASKED)
        c0 = b_w & 0x0F0F0F0F
        c1 = (b_w >> 4) & 0x0F0F0F0F
        if FMT == Q6_K:
            e = _q6_high(b_h)
            c0 |= e & 0x30303030
            c1 |= (e >> 2) & 0x30303030
        elif FMT == Q5_K or FMT == Q5_0 or FMT == Q5_1:
            c0 |= _spread1(b_h, 0)
            c1 |= _spread1(b_h, 1)
        if FMT == Q6_K:  # bytes 0-1: elements 0-15 (first scale), 2-3: 16-31
            a0, a1 = c0 & 0xFFFF, c1 & 0xFFFF
            b0, b1 = c0 & -65536, c1 & -65536
            d_lo = (_dp4a(a0, x0, _dp4a(a1, x1, zero, ASM), ASM) * PLANE
                    + _dp4a(a0, x0r, _dp4a(a1, x1r, zero, ASM), ASM))  # fmt: skip
            d_hi = (_dp4a(b0, x0, _dp4a(b1, x1, zero, ASM), ASM) * PLANE
                    + _dp4a(b0, x0r, _dp4a(b1, x1r, zero, ASM), ASM))  # fmt: skip
        else:
            d_lo = (_dp4a(c0, x0, _dp4a(c1, x1, zero, ASM), ASM) * PLANE
                    + _dp4a(c0, x0r, _dp4a(c1, x1r, zero, ASM), ASM))  # fmt: skip
            d_hi = d_lo
    return scaled_dot(d_lo, d_hi, s_lo, s_hi, mn_lo, mn_hi, p_xs + i_b * (2 * S_TOTAL),
                      p_xd + i_b * S_TOTAL, u, m_s, FMT, MASKED, SCALE16)


@triton.jit
def scaled_dot(d_lo, d_hi, s_lo, s_hi, mn_lo, mn_hi, p_xs, p_xd, u, m_s,
               FMT: tl.constexpr, MASKED: tl.constexpr, SCALE16: tl.constexpr):  # fmt: skip
    """Groups ``u``' integer dots (``[BLOCK_N, BLOCK_S, W]``: d_lo over a group's first 16
    elements, d_hi its last, or d_lo over all 32) turned into float32 ``[BLOCK_N, BLOCK_S]``
    contributions: the weight scales and mins (``_step_weights``' four), the format's offset
    times the x codes' sums, the x scale. ``p_xs``, ``p_xd``: the activation row's code sums
    and scales. Shared with gemv_rows (each of its rows)."""
    HAS_MIN: tl.constexpr = FMT == Q4_K or FMT == Q5_K or FMT == Q4_1 or FMT == Q5_1
    OFFSET: tl.constexpr = 8 if FMT == Q4_0 else (16 if FMT == Q5_0 else (32 if FMT == Q6_K else 0))
    i_lo = tl.sum(d_lo, axis=2)
    xs_lo = masked_load(p_xs + 2 * u, m_s, MASKED)[None, :]
    xs_hi = masked_load(p_xs + 2 * u + 1, m_s, MASKED)[None, :]
    xd = masked_load(p_xd + u, m_s, MASKED)[None, :]
    if FMT == Q2_K:
        i_hi = tl.sum(d_hi, axis=2)
        dot = (s_lo * i_lo.to(tl.float32) + s_hi * i_hi.to(tl.float32)
               - mn_lo * xs_lo.to(tl.float32) - mn_hi * xs_hi.to(tl.float32))  # fmt: skip
    else:
        if FMT == Q6_K or SCALE16:
            i_hi = tl.sum(d_hi, axis=2)
            dot = (s_lo * (i_lo - OFFSET * xs_lo).to(tl.float32)
                   + s_hi * (i_hi - OFFSET * xs_hi).to(tl.float32))  # fmt: skip
        else:
            dot = s_lo * (i_lo - OFFSET * (xs_lo + xs_hi)).to(tl.float32)
        if HAS_MIN:
            dot += mn_lo * (xs_lo + xs_hi).to(tl.float32)
    return xd * dot


@triton.jit
def gemv_q8_rows(
    p_qw, p_qh, p_s, p_d, p_m, p_xq, p_xd, p_xs, i_n, i_b, N, K,
    FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, ASM: tl.constexpr,
    XB: tl.constexpr, EVEN: tl.constexpr, SCALE16: tl.constexpr, WAIT: tl.constexpr = False,
):  # fmt: skip
    """float32 ``[BLOCK_N]``: rows i_n BLOCK_N .. of W times x row i_b (rows past N: row N - 1's
    value, for the caller to mask). The body every integer-activation GEMV runs (the MoE
    kernels too). EVEN: BLOCK_S divides the groups of a row, so nothing is masked (rows past
    N are clamped to row N - 1 for loading). SCALE16 (Q8_0's layout): a scale per 16
    elements; bytes 0-1 of a word are the group's first 16 elements (32u + 8b + w), 2-3 its
    last, dotted apart as Q6_K's halves.

    WAIT (a kernel launched with PDL whose caller has not waited yet): the first loop step's
    weights and scales are loaded, then ``pdl_start``, then x: the weights (never written in
    a step) stream while the kernel before still runs, instead of after it (the caller's
    program must not have loaded or stored anything another kernel of the step writes)."""
    S_TOTAL = K // 32
    MASKED: tl.constexpr = not EVEN
    o_y = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_n = tl.minimum(o_y, N - 1).to(tl.int64)  # rows that are loaded (the caller stores o_y < N)
    m_n = o_n >= 0  # every loaded row exists (all true; the shape the masks broadcast from)
    o_s = tl.arange(0, BLOCK_S)
    p_xq += i_b * (K // 2)
    acc = tl.zeros([BLOCK_N, BLOCK_S], dtype=tl.float32)
    first = 0
    if WAIT:  # the first step peeled: its weights in flight across the wait
        m_s = o_s < S_TOTAL
        b_w, b_h, m_w, s_lo, s_hi, mn_lo, mn_hi = _step_weights(
            p_qw, p_qh, p_s, p_d, p_m, o_n, m_n, o_s, m_s, S_TOTAL, FMT, MASKED, SCALE16)
        pdl_start(True)
        acc += _step_dot(b_w, b_h, m_w, s_lo, s_hi, mn_lo, mn_hi, p_xq, p_xd, p_xs, i_b, o_n,
                         o_s, m_s, S_TOTAL, FMT, BLOCK_N, BLOCK_S, ASM, XB, MASKED, SCALE16)
        first = BLOCK_S
    for s0 in range(first, S_TOTAL, BLOCK_S):
        u = s0 + o_s
        m_s = u < S_TOTAL
        b_w, b_h, m_w, s_lo, s_hi, mn_lo, mn_hi = _step_weights(
            p_qw, p_qh, p_s, p_d, p_m, o_n, m_n, u, m_s, S_TOTAL, FMT, MASKED, SCALE16)
        acc += _step_dot(b_w, b_h, m_w, s_lo, s_hi, mn_lo, mn_hi, p_xq, p_xd, p_xs, i_b, o_n,
                         u, m_s, S_TOTAL, FMT, BLOCK_N, BLOCK_S, ASM, XB, MASKED, SCALE16)
    return tl.sum(acc, axis=1)


@triton.jit
def quantize_groups(x, o_g, m_g, p_xq, p_xd, p_xs):
    """Groups ``x`` float32 [G, 4, 8] (element 8j + q of group g at [g, j, q]) of one row ->
    the row's QuantizedX entries for groups ``o_g`` (masked by ``m_g``); p_* point at the
    row. v = x / d with d = max|x| / 127 becomes the integer PLANE * q1 + q2 (q1 = round(v),
    q2 = round((v - q1) * PLANE), both int8): the two code planes packed as drawn in the module
    docstring, d / PLANE, and the integer sums of each group's two halves. Shared by
    ``quantize_x`` and the kernels that make an activation (norm, gated activation, attention)
    and hand it to the GEMV already quantized."""
    o_j = tl.arange(0, 4)
    o_q = tl.arange(0, 8)
    amax = tl.max(tl.max(tl.abs(x), axis=2), axis=1)  # [G]
    inv = tl.where(amax > 0, 127.0 / tl.maximum(amax, 1e-30), 0.0)
    v = x * inv[:, None, None]
    q1 = _round(v)
    q2 = _round((v - q1) * PLANE)
    q1i = q1.to(tl.int32)
    q2i = q2.to(tl.int32)
    shift = (8 * o_j)[None, :, None]
    w1 = tl.sum((q1i & 0xFF) << shift, axis=1)  # disjoint bits: the sum is the OR
    w2 = tl.sum((q2i & 0xFF) << shift, axis=1)
    base = p_xq + o_g[:, None] * 16 + o_q[None, :]
    tl.store(base, w1, mask=m_g[:, None])
    tl.store(base + 8, w2, mask=m_g[:, None])
    tl.store(p_xd + o_g, amax / (127.0 * PLANE), mask=m_g)
    half = tl.sum(q1i * PLANE + q2i, axis=2)  # [G, j]: j = 0, 1 -> elements 0-15; 2, 3 -> 16-31
    lo = tl.sum(tl.where(o_j[None, :] < 2, half, 0), axis=1)
    hi = tl.sum(tl.where(o_j[None, :] >= 2, half, 0), axis=1)
    tl.store(p_xs + 2 * o_g, lo, mask=m_g)
    tl.store(p_xs + 2 * o_g + 1, hi, mask=m_g)


@triton.jit
def _quantize_x_kernel(p_x, p_xq, p_xd, p_xs, K, BLOCK_G: tl.constexpr):
    """Groups of one row [BLOCK_G, 32] -> their QuantizedX entries (``quantize_groups``)."""
    i_b = tl.program_id(0)
    i_g = tl.program_id(1)
    S_TOTAL = K // 32
    o_g = i_g * BLOCK_G + tl.arange(0, BLOCK_G)
    m_g = o_g < S_TOTAL
    o_j = tl.arange(0, 4)
    o_q = tl.arange(0, 8)
    o_e = o_g[:, None, None] * 32 + o_j[None, :, None] * 8 + o_q[None, None, :]  # [G, j, q]
    x = tl.load(p_x + i_b * K + o_e, mask=m_g[:, None, None], other=0.0).to(tl.float32)
    quantize_groups(x, o_g, m_g, p_xq + i_b * (K // 2), p_xd + i_b * S_TOTAL,
                    p_xs + i_b * (2 * S_TOTAL))  # fmt: skip


@triton.jit
def _round(v):
    """Round half away from zero (C's roundf)."""
    return tl.where(v >= 0, tl.floor(v + 0.5), tl.ceil(v - 0.5))


class QuantizedX(NamedTuple):
    """An activation quantized once for every projection that reads it (module docstring).

    xq: int32 ``[B, K/2]`` the two code planes; xd: float32 ``[B, K/32]`` group scales
    (x = xd * (PLANE * q1 + q2)); xs: int32 ``[B, K/16]`` sums of PLANE * q1 + q2 over each
    group's first and last 16 elements.
    """

    xq: torch.Tensor
    xd: torch.Tensor
    xs: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.xq.shape[0], self.xq.shape[1] * 2


QUANT_BLOCK_G = 16


def quantize_x(x: torch.Tensor) -> QuantizedX:
    """x ``[K]`` or ``[B, K]`` (fp16/bf16/fp32), K a multiple of 32, B <= 8 -> ``QuantizedX``."""
    x2 = activation_rows(x, "quantize_x").contiguous()
    b, k = x2.shape
    qx = empty_quantized(b, k, x2.device)
    _quantize_x_kernel[(b, triton.cdiv(k // 32, QUANT_BLOCK_G))](
        x2, qx.xq, qx.xd, qx.xs, k, BLOCK_G=QUANT_BLOCK_G, num_warps=4
    )
    return qx


def empty_quantized(b: int, k: int, device: torch.device | str) -> QuantizedX:
    """Buffers for the QuantizedX of a ``[b, k]`` activation (a kernel fills them)."""
    return QuantizedX(torch.empty((b, k // 2), dtype=torch.int32, device=device),
                      torch.empty((b, k // 32), dtype=torch.float32, device=device),
                      torch.empty((b, k // 16), dtype=torch.int32, device=device))  # fmt: skip


def quantize_x_reference(x: torch.Tensor) -> torch.Tensor:
    """What ``quantize_x`` represents, as float32 ``[B, K]`` (the dequantized x): torch."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    g = x2.view(x2.shape[0], -1, 32)
    amax = g.abs().amax(dim=2, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    v = g * inv

    def rnd(t: torch.Tensor) -> torch.Tensor:
        return torch.where(t >= 0, torch.floor(t + 0.5), torch.ceil(t - 0.5))

    q1 = rnd(v)
    q2 = rnd((v - q1) * PLANE_INT)
    return ((q1 * PLANE_INT + q2) * (amax / (127.0 * PLANE_INT))).view_as(x2)


class Q8Config(NamedTuple):
    """A launch of the integer-activation GEMV: a program computes ``block_n`` rows, ``block_s``
    groups of 32 per loop step, on ``num_warps`` warps. ``xb``: x is loaded once per thread as
    ``[1, block_s, W]`` and broadcast over the rows in registers (the tile then wants
    ``block_s = 32 * num_warps``: threads along the groups, rows in registers); without it x
    is loaded in the weights' full ``[block_n, block_s, W]`` shape (rows on warps: every warp
    loads the same x from L1)."""

    block_n: int
    block_s: int
    num_warps: int
    xb: bool = False


# Triton's interpreter (CPU tensors) runs the programs one after another: there the fewest
# programs win (tests' matrices)
INTERPRETER_TILE = Q8Config(64, 32, 4)


def q8_config(ggml_type: GGMLType, n: int, k: int, b: int) -> Q8Config:
    """The launch rule, from bench/sweep_gemv.py on the H200 (2026-11-29, every matrix of the
    four benchmark models under 14-31 tiles each; BENCHMARKS.md):
    - Q8_0 (bound by bytes: 2 bytes of x per weight byte) gains most from loading x once per
      thread: one warp a program, x broadcast over 1-2 rows in registers. 8B shapes 62-78% ->
      71-98% of the roof (4096x14336: 27.9 -> 17.7 us; 28672x4096: 38.2 -> 30.9 us). Set
      again from a third sweep (2026-11-29, up to 8 groups a thread and step): two rows
      from K <= 4096 (28672x4096 36.6 -> 30.6 us, 128256x4096 156 -> 123 us), four groups a
      thread at 6144 rows (7.3 -> 6.7 us), rows on 4 warps at 4096x4096 (7.0 -> 4.9 us):
      8B Q8_0's GEMVs 2320 -> 2009 us a token.
    - The nibble formats are bound by instructions (the scale decode), not by x loads: rows on
      warps, 4 rows a program. Two groups a thread and step (fewer loop instructions a group)
      pay off on long rows: Q4_K from K = 8192 (4096x14336: 13.0 -> 12.7 us; at K = 4096 one
      group stays best, 28672x4096: 27.4 vs 28.9 us), Q6_K from 128 groups (4096x14336: 19.1
      -> 16.6 us). Few rows (N <= 1024, k/v): x broadcast over one row (Q4_K) or four groups a
      thread (Q6_K: 3.8 -> 3.3 us).
    """
    del b
    groups = k // 32
    if ggml_type == GGMLType.Q8_0:
        if n <= 1024 and k >= 2048:
            return Q8Config(1, 128, 2, True)
        if k <= 1024:
            return Q8Config(8, 16, 4) if n >= 65536 else Q8Config(8, 32, 1, True)
        if k >= 8192:
            return Q8Config(1, 64, 1, True)
        if n >= 16384:
            return Q8Config(2, 32, 1, True)
        return Q8Config(2, 128, 1, True) if n > 4096 else Q8Config(2, 32, 4)
    if ggml_type == GGMLType.Q6_K:
        if n <= 1024 and k >= 4096:
            return Q8Config(4, 128, 4)
        return Q8Config(4, 64 if groups >= 128 else 32, 4)
    if n <= 1024 and k >= 4096:
        return Q8Config(1, 128, 2, True)
    return Q8Config(4, 64 if groups >= 256 else 32, 4)


def gemv_q8(w: PackedWeight, x: QuantizedX, out: torch.Tensor | None = None,
            cfg: Q8Config | None = None) -> torch.Tensor:
    """y = W x for a packed quantized W ``[n, k]`` and an activation from ``quantize_x``:
    float32 ``[B, n]`` (``out`` if given: contiguous float32 ``[B, n]``)."""
    if w.ggml_type not in FMT_ID:
        raise ValueError(f"gemv_q8: no kernel for {w.ggml_type.name}")
    b, k = x.shape
    if k != w.k:
        raise ValueError(f"gemv_q8: x has K = {k}, the {w.ggml_type.name} weight has K = {w.k}")
    if x.xq.device != w.device:
        raise ValueError(f"gemv_q8: x is on {x.xq.device}, the weight on {w.device}")
    out = gemv_out(out, b, w.n, x.xq.device, "gemv_q8")
    if cfg is None:
        cfg = INTERPRETER_TILE if w.device.type == "cpu" else q8_config(w.ggml_type, w.n, k, b)
    elif not (pow2_at_most(cfg.block_n, 64) and 16 <= cfg.block_s <= 512 and pow2_at_most(cfg.block_s, 512)
              and cfg.num_warps in (1, 2, 4, 8)):  # fmt: skip
        raise ValueError(f"gemv_q8: bad tile {cfg} (block_n a power of two <= 64, block_s one in "
                         "16..512, num_warps 1, 2, 4 or 8)")
    _gemv_q8_kernel[gemv_grid(w.n, b, cfg.block_n)](
        *weight_arrays(w), x.xq, x.xd, x.xs, out,
        w.n, k, FMT=FMT_ID[w.ggml_type], BLOCK_N=cfg.block_n, BLOCK_S=cfg.block_s,
        ASM=not _INTERPRETED, XB=cfg.xb, EVEN=(k // 32) % cfg.block_s == 0, SCALE16=scale16(w),
        num_warps=cfg.num_warps, AHEAD=ahead_on(out.device),
        **launch_options(pdl_on(out.device)),
    )  # fmt: skip
    return out
