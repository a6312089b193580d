"""Q4_K and Q6_K tiles for the tensor cores decoded after the copy to shared memory (session
48): the inner loop of a quantized GEMM program over the engine's own layouts (layout.py), an
alternative to gemm_q's ``decode_tile``.

gemm_q decodes a tile of packed words in registers in the layout its loads gave, then Triton
moves the decoded float16 tile through shared memory into the dot's operand layout (in the
sm_90 SASS: 64 16-bit shared-memory stores and ~210 moves a 64-weight step a thread, ~11
instructions a weight in all). Here a program loads a group's 16 code bytes a row as a
``[BN, 16]`` uint8 tile that goes to the dot unchanged: Triton copies it into shared memory
with cp.async (pipelined over ``num_stages``), reads it back in the dot's operand layout and
only then decodes, in registers, each 4-byte register at once (``codes16``: two byte permutes,
two masks with the float16 magic numbers, two float16x2 subtractions for four codes). Byte
i = 4 w + b of group u holds codes 2 b (low nibble) and 2 b + 1 (high nibble) of word w, which
are elements 32 u + 8 b + w and 32 u + 8 b + w + 4: the low nibbles of the 16 bytes are one
K = 16 half of the group and the high nibbles the other, each one float16 ``tl.dot`` with x's
matching columns (``x_halves``). In the packed words' column order (gemm_q's contract,
``permuted_columns``) code k of word w is column 32 u + 8 w + k, so byte i's low nibble
multiplies column 32 u + 2 i and its high one 32 u + 2 i + 1; in element order the columns
are gathered; in the HALVES order each half is one contiguous load.

Q6_K (``q6k_product``) shares Q4_K's low nibbles; a code's two high bits sit in int16 entry
4 u + w of ``qh`` (layout.Q6_HIGH_SHIFT): for byte i = 4 w + b, in qh byte 2 w + b % 2, the
nibble (bits 0-1 for code 2 b, 2-3 for 2 b + 1) high where b < 2, low otherwise. Each code
byte's high-bit byte is loaded beside it (each qh byte twice) and ``codes6`` makes four codes
at once. Its scale is one a 16 elements: bytes with b < 2 hold elements < 16.

Weights are made as gemm_q's default makes them: float32 ``q (d sc) - dmin m`` rounded once to
float16 (the dequantized copies' weights), or with ``HALF`` the group's scale and min rounded to
float16 and applied by float16 fused multiply-adds (gemm_q's ``half``).

Oracle: gemm_q_reference / naive.dequantize_packed, as for gemm_q.
"""

from __future__ import annotations

import triton
import triton.language as tl

from deimos.gguf.constants import GGMLType
from deimos.quant.triton.dequant_gemv import Q5_K, Q6_K, Q8_0, _fma, k4_decode

# the kernel formats with a product here (Q8_0: its layout's formats too)
MMQ_TYPES = (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.Q8_0)

# Four bytes (packed in $2) -> their low (or high) nibbles as four float16 in $0, $1: bytes 0, 1
# (then 2, 3) copied to bytes 0 and 2 of a register (prmt), the nibble masked into a float16
# whose unit is that nibble's lowest bit: 1024 + n (low nibble, bits 0-3 of 1024's mantissa),
# 64 + n (high nibble, bits 4-7 of 64's mantissa count ones), then the magic subtracted: exact.
_LO16 = tl.constexpr(
    "{.reg .b32 a, b, m; prmt.b32 a, $2, $2, 0x1100; prmt.b32 b, $2, $2, 0x3322;"
    "lop3.b32 a, a, 0x000F000F, 0x64006400, 0xEA; lop3.b32 b, b, 0x000F000F, 0x64006400, 0xEA;"
    "mov.b32 m, 0x64006400; sub.rn.f16x2 $0, a, m; sub.rn.f16x2 $1, b, m;}")
_HI16 = tl.constexpr(
    "{.reg .b32 a, b, m; prmt.b32 a, $2, $2, 0x1100; prmt.b32 b, $2, $2, 0x3322;"
    "lop3.b32 a, a, 0x00F000F0, 0x54005400, 0xEA; lop3.b32 b, b, 0x00F000F0, 0x54005400, 0xEA;"
    "mov.b32 m, 0x54005400; sub.rn.f16x2 $0, a, m; sub.rn.f16x2 $1, b, m;}")


@triton.jit
def codes16(b, HIGH: tl.constexpr, ASM: tl.constexpr):
    """The low (HIGH: high) nibbles of uint8 ``b`` as float16, exact; inline PTX on a GPU
    (``ASM``), the same values by Triton's operations in the interpreter."""
    if ASM:
        if HIGH:
            q = tl.inline_asm_elementwise(_HI16, "=r,=r,r", [b], dtype=tl.float16, is_pure=True, pack=4)
        else:
            q = tl.inline_asm_elementwise(_LO16, "=r,=r,r", [b], dtype=tl.float16, is_pure=True, pack=4)
    elif HIGH:
        q = (b >> 4).to(tl.float16)
    else:
        q = (b & 0xF).to(tl.float16)
    return q


# Q8_0's layout: four signed code bytes (packed in $2) -> four float16 in $0, $1: the sign bits
# flipped (c + 128 as an unsigned byte), each byte under 0x64 (the float16 1024 + c + 128),
# then 1152 subtracted: exact
_I8 = tl.constexpr(
    "{.reg .b32 x, k, a, b, m; xor.b32 x, $2, 0x80808080; mov.b32 k, 0x64646464;"
    "prmt.b32 a, x, k, 0x4140; prmt.b32 b, x, k, 0x4342; mov.b32 m, 0x64806480;"
    "sub.rn.f16x2 $0, a, m; sub.rn.f16x2 $1, b, m;}")


@triton.jit
def codes8(b, ASM: tl.constexpr):
    """Signed code bytes (uint8 ``b`` holding int8) as float16, exact."""
    if ASM:
        q = tl.inline_asm_elementwise(_I8, "=r,=r,r", [b], dtype=tl.float16, is_pure=True, pack=4)
    else:
        q = (((b.to(tl.int32) + 128) & 255) - 128).to(tl.float16)
    return q


# Q6_K: code bytes $2, their high-bit bytes $3 whose nibble is the high one where the select
# byte $4 is 0x0F (the low one where 0), four at a time -> four float16 codes less 32 in $0, $1
_Q6_SEL = "shr.b32 t, $3, 4; lop3.b32 s, t, $3, $4, 0xE4;"  # s = (t & sel) | ($3 & ~sel)
_Q6_TAIL = ("prmt.b32 a, c, c, 0x1100; prmt.b32 b, c, c, 0x3322;"
            "lop3.b32 a, a, 0x003F003F, 0x64006400, 0xEA; lop3.b32 b, b, 0x003F003F, 0x64006400, 0xEA;"
            "mov.b32 m, 0x64206420; sub.rn.f16x2 $0, a, m; sub.rn.f16x2 $1, b, m;}")
_Q6LO = tl.constexpr("{.reg .b32 t, s, c, a, b, m;" + _Q6_SEL
                     + "shl.b32 t, s, 4; and.b32 t, t, 0x30303030; lop3.b32 c, $2, 0x0F0F0F0F, t, 0xEA;"
                     + _Q6_TAIL)
_Q6HI = tl.constexpr("{.reg .b32 t, s, c, a, b, m;" + _Q6_SEL
                     + "shl.b32 t, s, 2; and.b32 t, t, 0x30303030; shr.b32 c, $2, 4;"
                     + "lop3.b32 c, c, 0x0F0F0F0F, t, 0xEA;" + _Q6_TAIL)


@triton.jit
def codes6(b, hb, sel, HIGH: tl.constexpr, ASM: tl.constexpr):
    """Q6_K's codes less 32 as float16, exact, from the low-nibble bytes ``b`` (their high
    nibbles: HIGH), the high-bit bytes ``hb`` and the nibble select ``sel`` (0x0F: hb's high
    nibble; 0: its low one)."""
    if ASM:
        if HIGH:
            q = tl.inline_asm_elementwise(_Q6HI, "=r,=r,r,r,r", [b, hb, sel], dtype=tl.float16,
                                          is_pure=True, pack=4)
        else:
            q = tl.inline_asm_elementwise(_Q6LO, "=r,=r,r,r,r", [b, hb, sel], dtype=tl.float16,
                                          is_pure=True, pack=4)
    else:
        nib = tl.where(sel != 0, hb >> 4, hb & 0xF)
        if HIGH:
            c = (b >> 4) | (((nib >> 2) & 3) << 4)
        else:
            c = (b & 0xF) | ((nib & 3) << 4)
        q = (c.to(tl.int32) - 32).to(tl.float16)
    return q


@triton.jit
def _byte(w, k: tl.constexpr):
    """Signed byte k of int32 words ``w`` (little-endian), as int32."""
    return (w << (24 - 8 * k)) >> 24


# x's column orders (``X_ORDER``): as the elements; the packed words' order (gemm_q's contract,
# dequant.permuted_columns); by halves (``halves_columns``: a group's low-nibble half, then its
# high one, each in byte order: one contiguous load a half). ``x_halves`` reads each.
ELEMENTS, WORDS, HALVES = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def x_halves(p_g, m_m, X_ORDER: tl.constexpr):
    """A group's x as its two ``[BM, 16]`` float16 halves (h = 0 multiplies the bytes' low
    nibbles, 1 the high ones; column i of each is byte i's), from ``p_g`` (``[BM, 1]`` pointers
    to each row's group start; rows off ``m_m`` read as 0). HALVES: two contiguous loads. The
    other orders load the group's 32 columns contiguously and reorder them in registers
    (session 49, H100: a column-by-column gather of the halves ran the Q4_K product 2-4x
    slower than the HALVES order): WORDS (column 2 i + h) splits the pairs; ELEMENTS (element
    8 b + 4 h + w is byte 4 w + b's nibble h) views the 32 as [b, h, w] and permutes to [w, b, h]."""
    BM: tl.constexpr = p_g.shape[0]
    if X_ORDER == 2:
        o_i = tl.arange(0, 16)
        x0 = tl.load(p_g + o_i[None, :], mask=m_m[:, None], other=0.0)
        x1 = tl.load(p_g + 16 + o_i[None, :], mask=m_m[:, None], other=0.0)
    else:
        x = tl.load(p_g + tl.arange(0, 32)[None, :], mask=m_m[:, None], other=0.0)
        if X_ORDER == 0:
            x = tl.reshape(tl.permute(tl.reshape(x, (BM, 4, 2, 4)), (0, 3, 1, 2)), (BM, 16, 2))
        else:
            x = tl.reshape(x, (BM, 16, 2))
        x0, x1 = tl.split(x)
    return x0, x1


@triton.jit
def x_pairs(p_g, m_m, X_ORDER: tl.constexpr):
    """A group's x as one ``[BM, 32]`` float16 tile in the pairs' order: column 2 i + h
    multiplies byte i's nibble h (the packed words' order, WORDS: one contiguous load)."""
    BM: tl.constexpr = p_g.shape[0]
    if X_ORDER == 2:
        x0, x1 = x_halves(p_g, m_m, X_ORDER)
        x = tl.reshape(tl.join(x0, x1), (BM, 32))
    else:
        x = tl.load(p_g + tl.arange(0, 32)[None, :], mask=m_m[:, None], other=0.0)
        if X_ORDER == 0:
            x = tl.reshape(tl.permute(tl.reshape(x, (BM, 4, 2, 4)), (0, 3, 1, 2)), (BM, 32))
    return x


def halves_columns(k: int):
    """The element at each column of x in the HALVES order (torch int64 ``[k]``)."""
    import torch

    i = torch.arange(16)
    within = torch.cat([8 * (i % 4) + i // 4, 8 * (i % 4) + i // 4 + 4])
    return (torch.arange(k // 32)[:, None] * 32 + within[None, :]).reshape(-1)


@triton.jit
def q4k_product(acc, p_qw, p_meta, r_qw, r_meta, o_n, p_xr, m_m, blk_lo, blk_hi,
                X_ORDER: tl.constexpr, HALF: tl.constexpr, ASM: tl.constexpr,
                SWAP: tl.constexpr = False, JOIN: tl.constexpr = False, p_qh=None, r_qh=0):
    """acc ``[BM, BN]`` + x W^T over K's blocks of 256 ``blk_lo .. blk_hi`` (all: 0, K / 256)
    for rows ``o_n`` (int64 ``[BN]``, in range) of a packed Q4_K weight (``p_qw`` int32 words,
    ``r_qw`` words a row; ``p_meta``, ``r_meta`` words a row) and x rows ``p_xr`` (``[BM, 1]``
    pointers to each row's first column, float16, its columns in ``X_ORDER``; rows off ``m_m``
    read as 0). SWAP: acc is ``[BN, BM]`` and gets W x^T, the weights the dot's first operand
    (the tensor cores' warps then split the weight rows: each warp decodes only its own, where
    with x first and more than 16 rows of x warps split x's rows and each decodes every weight
    row of the tile). JOIN: a group's two halves joined into one K = 32 dot (columns in the
    pairs' order, ``x_pairs``) instead of two K = 16 dots. ``p_qh``: Q5_K's fifth bits
    (``q5k_product``)."""
    o_i = tl.arange(0, 16)
    BN: tl.constexpr = o_n.shape[0]
    p_q = p_qw.to(tl.pointer_type(tl.uint8)) + o_n[:, None] * (r_qw * 4) + o_i[None, :]
    p_mt = p_meta + o_n * r_meta
    if p_qh is not None:
        p_h = p_qh.to(tl.pointer_type(tl.uint8)) + o_n[:, None] * r_qh + tl.arange(0, 4)[None, :]
        shift = (2 * (o_i % 4))[None, :]
    for blk in range(blk_lo, blk_hi):
        w0 = tl.load(p_mt + blk * 4)
        w1 = tl.load(p_mt + blk * 4 + 1)
        w2 = tl.load(p_mt + blk * 4 + 2)
        w3 = tl.load(p_mt + blk * 4 + 3)
        for j in tl.static_range(8):
            u = blk * 8 + j
            b = tl.load(p_q + u * 16)  # [BN, 16] code bytes of group u
            hi0, hi1 = None, None
            if p_qh is not None:  # a group's 4 fifth-bit bytes (one a word), to byte 4 w + b's
                h4 = tl.load(p_h + u * 4).to(tl.int32)
                hb = tl.reshape(tl.broadcast_to(h4[:, :, None], (BN, 4, 4)), (BN, 16))
                hi0, hi1 = (hb >> shift) & 1, (hb >> (shift + 1)) & 1
            if j < 4:
                sc, mn = k4_decode(w0, w1, w3, j)
            else:
                sc, mn = k4_decode(w0, w2, w3, j)
            if JOIN:
                w = tl.reshape(tl.join(_q4_weights(b, sc, mn, False, HALF, ASM, hi0),
                                       _q4_weights(b, sc, mn, True, HALF, ASM, hi1)), (BN, 32))
                x = x_pairs(p_xr + u * 32, m_m, X_ORDER)
                if SWAP:
                    acc = tl.dot(w, tl.trans(x), acc, out_dtype=tl.float32)
                else:
                    acc = tl.dot(x, tl.trans(w), acc, out_dtype=tl.float32)
            else:
                xs = x_halves(p_xr + u * 32, m_m, X_ORDER)
                for h in tl.static_range(2):
                    w = _q4_weights(b, sc, mn, h == 1, HALF, ASM, hi0 if h == 0 else hi1)
                    if SWAP:
                        acc = tl.dot(w, tl.trans(xs[h]), acc, out_dtype=tl.float32)
                    else:
                        acc = tl.dot(xs[h], tl.trans(w), acc, out_dtype=tl.float32)
    return acc


@triton.jit
def _q4_weights(b, sc, mn, HIGH: tl.constexpr, HALF: tl.constexpr, ASM: tl.constexpr, hi=None):
    """A group's float16 weights ``[BN, 16]`` from its code bytes' low (or high) nibbles, plus
    16 where ``hi`` (Q5_K's fifth bits, 0 or 1 a code) is 1."""
    q = codes16(b, HIGH, ASM)
    if hi is not None:
        q = q + (hi * 16).to(tl.float16)
    if HALF:
        w = _fma(q, sc.to(tl.float16)[:, None], -mn.to(tl.float16)[:, None], True, ASM)
    else:
        w = _fma(q.to(tl.float32), sc[:, None], -mn[:, None], False, ASM).to(tl.float16)
    return w


@triton.jit
def q5k_product(acc, p_qw, p_qh, p_meta, r_qw, r_qh, r_meta, o_n, p_xr, m_m, blk_lo, blk_hi,
                X_ORDER: tl.constexpr, HALF: tl.constexpr, ASM: tl.constexpr):
    """q4k_product for a packed Q5_K weight: Q4_K's codes and scales (``p_qw``, ``p_meta``)
    plus each code's fifth bit (``p_qh`` uint8, ``r_qh`` bytes a row: bit k of byte 4 u + w
    is code k of word w's, so byte i = 4 w + b's two codes 2 b and 2 b + 1 take bits 2 b and
    2 b + 1 of the group's byte w). A group's 4 bytes are one contiguous load a row, widened
    to the 16 code bytes' in registers."""
    return q4k_product(acc, p_qw, p_meta, r_qw, r_meta, o_n, p_xr, m_m, blk_lo, blk_hi, X_ORDER, HALF, ASM,
                       False, False, p_qh, r_qh)


@triton.jit
def q8_product(acc, p_qw, p_d, r_qw, r_d, o_n, p_xr, m_m, blk_lo, blk_hi, X_ORDER: tl.constexpr,
               HALF: tl.constexpr, ASM: tl.constexpr, SCALE16: tl.constexpr = False):
    """q4k_product for a weight in Q8_0's layout (Q8_0, and the formats packed as its codes:
    IQ4_XS, MXFP4, IQ4_NL, the ternary and IQ1-IQ3 formats): a group's 32 code bytes (byte
    i = 4 w + b of word w holds element 8 b + w: the packed words' column order) one K = 32
    dot; ``p_d`` its scales, float16 or float32, one a group (``r_d`` a row) or with SCALE16
    one a 16 (bytes with b < 2 hold the first 16). Blocks of 8 groups (K a multiple of 256)."""
    BN: tl.constexpr = o_n.shape[0]
    o_i = tl.arange(0, 32)
    p_q = p_qw.to(tl.pointer_type(tl.uint8)) + o_n[:, None] * (r_qw * 4) + o_i[None, :]
    NS: tl.constexpr = 16 if SCALE16 else 8  # scales a block
    p_sc = p_d + o_n[:, None] * r_d + tl.arange(0, NS)[None, :]
    first = (o_i % 4 < 2)[None, :]
    for blk in range(blk_lo, blk_hi):
        sc = tl.load(p_sc + blk * NS).to(tl.float32)  # [BN, NS]: one contiguous load a row
        if SCALE16:
            s_lo, s_hi = tl.split(tl.reshape(sc, (BN, 8, 2)))
        else:
            s_lo = sc
            s_hi = sc
        for j in tl.static_range(8):
            u = blk * 8 + j
            q = codes8(tl.load(p_q + u * 32), ASM)  # [BN, 32]
            sel = (tl.arange(0, 8) == j)[None, :]
            a = tl.sum(tl.where(sel, s_lo, 0.0), axis=1)  # group j's scale(s), [BN]
            c = tl.sum(tl.where(sel, s_hi, 0.0), axis=1)
            if HALF:
                w = q * tl.where(first, a.to(tl.float16)[:, None], c.to(tl.float16)[:, None])
            else:
                w = (q.to(tl.float32) * tl.where(first, a[:, None], c[:, None])).to(tl.float16)
            x = tl.load(p_xr + u * 32 + o_i[None, :], mask=m_m[:, None], other=0.0)
            if X_ORDER == 0:  # element order: [b, w] -> [w, b]
                x = tl.reshape(tl.permute(tl.reshape(x, (x.shape[0], 4, 8)), (0, 2, 1)), (x.shape[0], 32))
            acc = tl.dot(x, tl.trans(w), acc, out_dtype=tl.float32)
    return acc


@triton.jit
def q6k_product(acc, p_qw, p_qh, p_sc, p_d, r_qw, r_qh, r_sc, r_d, o_n, p_xr, m_m, blk_lo, blk_hi,
                X_ORDER: tl.constexpr, HALF: tl.constexpr, ASM: tl.constexpr):
    """q4k_product for a packed Q6_K weight (``p_qw`` int32 low-nibble words, ``p_qh`` int16
    high bits, ``p_sc`` int8 scales a 16, ``p_d`` float16 a block; ``r_*`` each array's
    elements a row)."""
    BN: tl.constexpr = o_n.shape[0]
    o_i = tl.arange(0, 16)
    p_q = p_qw.to(tl.pointer_type(tl.uint8)) + o_n[:, None] * (r_qw * 4) + o_i[None, :]
    # a group's 8 high-bit bytes, one contiguous (cp.async) load a row, widened in registers
    # to byte i's: qh byte 2 (i // 4) + i % 2 (a gather of bytes there is a 2-byte global load
    # a pair, not pipelined: session 49's SASS)
    p_h = p_qh.to(tl.pointer_type(tl.uint8)) + o_n[:, None] * (r_qh * 2) + tl.arange(0, 8)[None, :]
    first = (o_i % 4 < 2)[None, :]  # bytes of the group's first 16 elements
    sel = tl.where(first, 0x0F, 0).to(tl.uint8) + tl.zeros([BN, 16], dtype=tl.uint8)
    # a block's 16 scales as 4 words a row (one 16-byte load), not a byte load a group
    p_s = p_sc.to(tl.pointer_type(tl.int32)) + o_n * (r_sc // 4)
    for blk in range(blk_lo, blk_hi):
        d = tl.load(p_d + o_n * r_d + blk).to(tl.float32)
        sw0 = tl.load(p_s + blk * 4)
        sw1 = tl.load(p_s + blk * 4 + 1)
        sw2 = tl.load(p_s + blk * 4 + 2)
        sw3 = tl.load(p_s + blk * 4 + 3)
        for j in tl.static_range(8):
            u = blk * 8 + j
            b = tl.load(p_q + u * 16)  # [BN, 16] low-nibble bytes of group u
            h8 = tl.reshape(tl.load(p_h + u * 8), (BN, 4, 2))  # [row, w, pair]
            hb = tl.reshape(tl.permute(tl.join(h8, h8), (0, 1, 3, 2)), (BN, 16))  # byte 4 w + 2 d + p
            sw = sw0 if j < 2 else (sw1 if j < 4 else (sw2 if j < 6 else sw3))
            s_a = _byte(sw, (2 * j) % 4).to(tl.float32) * d
            s_b = _byte(sw, (2 * j + 1) % 4).to(tl.float32) * d
            xs = x_halves(p_xr + u * 32, m_m, X_ORDER)
            for h in tl.static_range(2):
                q = codes6(b, hb, sel, h == 1, ASM)
                if HALF:
                    w = q * tl.where(first, s_a.to(tl.float16)[:, None], s_b.to(tl.float16)[:, None])
                else:
                    w = (q.to(tl.float32) * tl.where(first, s_a[:, None], s_b[:, None])).to(tl.float16)
                acc = tl.dot(xs[h], tl.trans(w), acc, out_dtype=tl.float32)
    return acc


@triton.jit
def mmq_product(acc, FMT: tl.constexpr, p_qw, p_qh, p_s, p_d, r_qw, r_qh, r_s, r_d, o_n, p_xr, m_m,
                blk_lo, blk_hi, X_ORDER: tl.constexpr, HALF: tl.constexpr, ASM: tl.constexpr,
                SCALE16: tl.constexpr = False, SWAP: tl.constexpr = False,
                JOIN: tl.constexpr = False):  # fmt: skip
    """The product of kernel format FMT over blocks blk_lo..blk_hi (Q8_0's layout, Q6_K, Q5_K,
    else Q4_K): the one dispatch gemm_q's and moe_gemm's kernels share. SWAP and JOIN: Q4_K's
    (``q4k_product``; acc ``[BN, BM]`` with SWAP)."""
    if FMT == Q8_0:
        acc = q8_product(acc, p_qw, p_d, r_qw, r_d, o_n, p_xr, m_m, blk_lo, blk_hi, X_ORDER, HALF, ASM, SCALE16)
    elif FMT == Q6_K:
        acc = q6k_product(acc, p_qw, p_qh, p_s, p_d, r_qw, r_qh, r_s, r_d, o_n, p_xr, m_m, blk_lo, blk_hi,
                          X_ORDER, HALF, ASM)
    elif FMT == Q5_K:
        acc = q5k_product(acc, p_qw, p_qh, p_s, r_qw, r_qh, r_s, o_n, p_xr, m_m, blk_lo, blk_hi, X_ORDER, HALF,
                          ASM)
    else:
        acc = q4k_product(acc, p_qw, p_s, r_qw, r_s, o_n, p_xr, m_m, blk_lo, blk_hi, X_ORDER, HALF, ASM, SWAP,
                          JOIN)
    return acc
