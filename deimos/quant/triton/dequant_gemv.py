"""What every kernel over packed weights shares (layout.py draws the layouts): the format ids
(the kernels' FMT constexpr), a group's packed words and its scales (``group_words``,
``group_scales``), code extraction (``_codes``, for the dequantization kernels), the GEMV's
grid, output and input checks. The decode GEMV itself is gemv_q8.py (integer activations);
the float32-activation GEMV that stood here first (measured at 26-60% of the roof, BENCHMARKS.md)
was replaced by it and removed.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from deimos.gguf.constants import GGMLType
from deimos.quant.triton.layout import PackedWeight

# The kernel's FMT constexpr: the formats in priority order.
FMT_ID: dict[GGMLType, int] = {
    t: i
    for i, t in enumerate(
        [GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.Q5_K, GGMLType.Q4_0,
         GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q2_K]
    )
}  # fmt: skip
Q4_K = tl.constexpr(FMT_ID[GGMLType.Q4_K])
Q6_K = tl.constexpr(FMT_ID[GGMLType.Q6_K])
Q8_0 = tl.constexpr(FMT_ID[GGMLType.Q8_0])
Q5_K = tl.constexpr(FMT_ID[GGMLType.Q5_K])
Q4_0 = tl.constexpr(FMT_ID[GGMLType.Q4_0])
Q4_1 = tl.constexpr(FMT_ID[GGMLType.Q4_1])
Q5_0 = tl.constexpr(FMT_ID[GGMLType.Q5_0])
Q5_1 = tl.constexpr(FMT_ID[GGMLType.Q5_1])
Q2_K = tl.constexpr(FMT_ID[GGMLType.Q2_K])
MAX_BATCH = 8
# 2^23 as float: for 0 <= q < 2^23 the bits (q | 0x4B000000) are the float 2^23 + q exactly.
MAGIC_BITS = tl.constexpr(0x4B000000)
MAGIC = tl.constexpr(8388608.0)


@triton.jit
def _code_float(q, OFFSET: tl.constexpr, HALF: tl.constexpr = False):
    """int32 codes 0 <= q < 2^23 -> float32 q - OFFSET, exactly, without an int->float convert.
    HALF (codes < 1024): float16 instead, from the float16 magic 1024 (bits 0x6400: 1024 + q
    for q < 1024), again exact (|q - OFFSET| <= 256)."""
    if HALF:
        v = (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - (1024.0 + OFFSET)
    else:
        v = (q | MAGIC_BITS).to(tl.float32, bitcast=True) - (MAGIC + OFFSET)
    return v


@triton.jit
def _codes(b_w, b_h, k, FMT: tl.constexpr, HALF: tl.constexpr = False):
    """Code number k of every word, as float32 (HALF: float16) with the format's zero point
    removed."""
    if FMT == Q8_0:
        # byte k, signed; ^ 0x80 maps -128..127 to 0..255
        return _code_float(((b_w >> (8 * k)) & 0xFF) ^ 0x80, 128.0, HALF)
    if FMT == Q2_K:  # crumb k (layout._crumb_words)
        return _code_float((b_w >> (2 * k)) & 3, 0.0, HALF)
    q = (b_w >> (4 * k)) & 0xF
    if FMT == Q6_K:  # code k = 2j + p at bits (4, 12, 0, 8)[j] + 2p (layout.Q6_HIGH_SHIFT)
        j = k // 2
        shift = 4 + 8 * (j % 2) - 4 * (j // 2) + 2 * (k % 2)
        return _code_float(q | (((b_h >> shift) & 3) << 4), 32.0, HALF)
    if FMT == Q5_K or FMT == Q5_1:
        return _code_float(q | (((b_h >> k) & 1) << 4), 0.0, HALF)
    if FMT == Q5_0:
        return _code_float(q | (((b_h >> k) & 1) << 4), 16.0, HALF)
    if FMT == Q4_0:
        return _code_float(q, 8.0, HALF)
    return _code_float(q, 0.0, HALF)  # Q4_K, Q4_1


@triton.jit
def _f16_bits(v):
    """Low 16 bits of int32 ``v`` read as float16, widened to float32."""
    return (v & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def masked_load(p, m, MASKED: tl.constexpr):
    """``tl.load(p, mask=m, other=0)``, or without a mask when the caller's tiles divide the
    tensor exactly (no zero fill, no predicates: ~15% of a GEMV loop's instructions)."""
    if MASKED:
        return tl.load(p, mask=m, other=0)
    else:
        return tl.load(p)


@triton.jit
def _k4_scales(p_s, o_n, u, m, S_TOTAL, MASKED: tl.constexpr = True):
    """Q4_K/Q5_K: group u's scale d * sc and min dmin * m, float32 [BLOCK_N, BLOCK_S].

    meta words of a block (layout._k4_meta): 0 = d | dmin << 16; byte j % 4 of word 1 + j // 4
    = scale j | (min j & 3) << 6; nibble j of word 3 = min j >> 2 (group j = u % 8).
    """
    p = p_s + o_n[:, None] * (S_TOTAL // 2) + (u // 8 * 4)[None, :]
    j = (u % 8)[None, :]
    w0 = masked_load(p, m, MASKED)
    wa = masked_load(p + 1 + j // 4, m, MASKED)
    w3 = masked_load(p + 3, m, MASKED)
    return k4_decode(w0, wa, w3, j)


@triton.jit
def k4_decode(w0, wa, w3, j):
    """Group j's d * sc and dmin * m (float32) from its block's meta word 0, word 1 + j // 4
    (``wa``) and word 3 (layout._k4_meta)."""
    byte = wa >> ((j % 4) * 8)
    sc = byte & 63
    mn = ((byte >> 6) & 3) | (((w3 >> (4 * j)) & 0xF) << 2)
    d = _f16_bits(w0)
    dmin = _f16_bits(w0 >> 16)
    return d * sc.to(tl.float32), dmin * mn.to(tl.float32)


@triton.jit
def group_scales(p_s, p_d, p_m, o_n, u, m, S_TOTAL, FMT: tl.constexpr, MASKED: tl.constexpr = True,
                 SCALE16: tl.constexpr = False):
    """Scales of groups ``u`` of rows ``o_n``, float32 [BLOCK_N, BLOCK_S] each:
    (scale of the group's first 16 elements, of its last 16, and the min term: what
    multiplies the group sum of x; for formats without a min its value is unused).
    ``MASKED=False``: every (row, group) exists, loads without a mask. ``SCALE16`` (Q8_0's
    layout only): ``d`` holds a scale per 16 elements (``scale16``)."""
    if FMT == Q4_K or FMT == Q5_K:
        s_lo, mn = _k4_scales(p_s, o_n, u, m, S_TOTAL, MASKED)
        s_hi = s_lo
        mn = -mn
    elif FMT == Q6_K:
        o_d = o_n[:, None] * (S_TOTAL // 8) + (u // 8)[None, :]
        b_d = masked_load(p_d + o_d, m, MASKED).to(tl.float32)
        p_sc = p_s + o_n[:, None] * (S_TOTAL * 2) + (u * 2)[None, :]
        s_lo = b_d * masked_load(p_sc, m, MASKED).to(tl.float32)
        s_hi = b_d * masked_load(p_sc + 1, m, MASKED).to(tl.float32)
        mn = s_lo
    elif SCALE16:
        o_h = o_n[:, None] * (2 * S_TOTAL) + (2 * u)[None, :]
        s_lo = masked_load(p_d + o_h, m, MASKED).to(tl.float32)
        s_hi = masked_load(p_d + o_h + 1, m, MASKED).to(tl.float32)
        mn = s_lo
    else:
        o_g = o_n[:, None] * S_TOTAL + u[None, :]
        s_lo = masked_load(p_d + o_g, m, MASKED).to(tl.float32)
        s_hi = s_lo
        if FMT == Q4_1 or FMT == Q5_1:
            mn = masked_load(p_m + o_g, m, MASKED).to(tl.float32)
        else:
            mn = s_lo
    return s_lo, s_hi, mn


@triton.jit
def q2k_scales(p_s, p_d, p_m, o_n, u, m, S_TOTAL, MASKED: tl.constexpr = True):
    """Q2_K: group u's (scale, scale, min, min) of its first and last 16 elements, float32
    [BLOCK_N, BLOCK_S] each: d * (sc & 15), dmin * (sc >> 4) from its two scale bytes (the low
    byte of the int16 entry is the first sub-block's), as ggml computes them."""
    o_g = o_n[:, None] * S_TOTAL + u[None, :]
    sc = masked_load(p_s + o_g, m, MASKED).to(tl.int32)
    lo = sc & 0xFF
    hi = (sc >> 8) & 0xFF
    o_b = o_n[:, None] * (S_TOTAL // 8) + (u // 8)[None, :]
    d = masked_load(p_d + o_b, m, MASKED).to(tl.float32)
    dmin = masked_load(p_m + o_b, m, MASKED).to(tl.float32)
    return (d * (lo & 15).to(tl.float32), d * (hi & 15).to(tl.float32),
            dmin * (lo >> 4).to(tl.float32), dmin * (hi >> 4).to(tl.float32))  # fmt: skip


@triton.jit
def group_words(p_qw, p_qh, o_n, m_n, u, m_s, S_TOTAL, FMT: tl.constexpr, MASKED: tl.constexpr = True):
    """The packed words of groups ``u`` of rows ``o_n`` (int64), each ``[BLOCK_N, BLOCK_S, W]``
    (W = 8 words a group for Q8_0, 2 for Q2_K, 4 for the nibble formats; code k of word w of
    group u is element 32u + W k + w): (qw, the high bits' entries of the same words for the
    formats that have them (Q6_K, Q5_K, Q5_0, Q5_1; qw again for the others), the load mask)."""
    W: tl.constexpr = 8 if FMT == Q8_0 else (2 if FMT == Q2_K else 4)
    o_w = tl.arange(0, W)
    m_w = (m_n[:, None] & m_s[None, :])[:, :, None] & (o_w < W)[None, None, :]
    o_q = o_n[:, None, None] * (S_TOTAL * W) + u[None, :, None] * W + o_w[None, None, :]
    b_w = masked_load(p_qw + o_q, m_w, MASKED)
    if FMT == Q6_K or FMT == Q5_K or FMT == Q5_0 or FMT == Q5_1:
        b_h = masked_load(p_qh + o_q, m_w, MASKED).to(tl.int32)
    else:
        b_h = b_w
    return b_w, b_h, m_w


def pow2_at_most(v: int, most: int) -> bool:
    """Whether ``v`` is a power of two in 1..``most`` (a tile size a launch accepts)."""
    return isinstance(v, int) and 0 < v <= most and v & (v - 1) == 0


def words_per_group(ggml_type: GGMLType) -> int:
    """int32 words a group of 32 takes in the packed layout (the kernels' W): 8 for Q8_0 (a
    byte a code), 2 for Q2_K (2 bits), 4 for the nibble formats."""
    return 8 if ggml_type == GGMLType.Q8_0 else (2 if ggml_type == GGMLType.Q2_K else 4)


def scale16(w: PackedWeight) -> bool:
    """A weight in Q8_0's layout with a scale per 16 elements (IQ2_XS, IQ2_S, IQ1_M): the
    kernels' SCALE16."""
    return w.ggml_type == GGMLType.Q8_0 and w.tensors["d"].shape[1] * 16 == w.k


MAX_GRID_X = 2**31 - 1  # CUDA: grid axis 0; axes 1 and 2 stop at 65535


def gemv_grid(n: int, b: int, block_n: int) -> tuple[int, int]:
    """(row tiles, batch columns): the row tiles on axis 0, the only one that holds a large
    vocabulary's output matrix."""
    tiles = triton.cdiv(n, block_n)
    if tiles > MAX_GRID_X or b > 65535:
        raise ValueError(f"gemv: {n} rows x {b} columns do not fit a CUDA grid")
    return tiles, b


@triton.jit
def _fma(a, b, c, HALF: tl.constexpr, ASM: tl.constexpr):
    """a b + c rounded once: float16 (HALF) by the GPU's fused multiply-add (ASM) or, in the
    interpreter, in float32 rounded to float16 (a float16 product is exact in float32); float32
    otherwise (fused where the compiler fuses)."""
    if HALF and ASM:
        v = tl.fma(a, b, c)
    elif HALF:
        v = (a.to(tl.float32) * b.to(tl.float32) + c.to(tl.float32)).to(tl.float16)
    else:
        v = a * b + c
    return v


def weight_arrays(w: PackedWeight) -> tuple:
    """(qw, qh, scales, d, m): the kernels' weight pointers, qw standing in for arrays the
    format does not have (never read)."""
    t = w.tensors
    qw = t["qw"]
    return (qw, t.get("qh", qw), t.get("meta", t.get("sc", qw)), t.get("d", qw), t.get("m", qw))


def gemv_out(out: torch.Tensor | None, b: int, n: int, device: torch.device, who: str) -> torch.Tensor:
    """A GEMV's output: ``out`` checked (contiguous float32 ``[b, n]``) or a new one."""
    if out is None:
        return torch.empty((b, n), dtype=torch.float32, device=device)
    if out.shape != (b, n) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"{who}: out must be contiguous float32 [{b}, {n}], got {out.dtype} "
                         f"{tuple(out.shape)}")  # fmt: skip
    return out


def activation_rows(x: torch.Tensor, who: str) -> torch.Tensor:
    """x ``[K]`` or ``[B, K]`` checked for a GEMV (K a positive multiple of 32, 1 <= B <=
    MAX_BATCH, floating point) -> ``[B, K]``."""
    if x.dim() not in (1, 2):
        raise ValueError(f"{who}: x must be [K] or [B, K], got shape {tuple(x.shape)}")
    x2 = x.reshape(1, -1) if x.dim() == 1 else x
    b, k = x2.shape
    if k % 32 or k == 0:
        raise ValueError(f"{who}: K = {k} is not a positive multiple of 32")
    if not 1 <= b <= MAX_BATCH:
        raise ValueError(f"{who}: batch {b} not in 1..{MAX_BATCH}")
    if not x2.dtype.is_floating_point:
        raise ValueError(f"{who}: x must be floating point, got {x2.dtype}")
    return x2
