"""Batched decode GEMM over a packed quantized weight: y [M, n] = x [M, k] @ W^T for M = 1..64
activation rows (one a sequence of a continuous-batching decode step), reading each packed
weight once: a program decodes a tile of weight rows in registers and feeds it with the fp16
activation tile to the tensor cores (``tl.dot``, fp32 accumulation).

Why not the prefill pair (``dequantize_fp16`` + ``matmul_f16``): it writes the weight as fp16
and reads it back, ~4-5x the packed bytes. Why not ``gemv_q8`` once per row: it reads the whole
weight once per row. Here the weight is read once, x (M x k fp16, in L2) once per program.

Tile (``GemmQConfig``): a program owns ``block_n`` weight rows and all M rows of x (padded to
``block_m``; tl.dot needs 16 rows), and walks K in steps of ``block_j`` consecutive code words
of each row (a contiguous run of the packed array, ``block_j / W`` whole groups of 32): word
j is word w = j % W of group u = j // W, its code k element 32u + W k + w (layout.py). The
words are loaded a group per thread (``group_words``), decoded by ``decode_tile`` and the
codes of each word stacked in that thread's registers (``tl.join``) at column NK j + k of the
step's tile (NK = 32 / W codes a word): the packed words' column order, in which the caller
hands x (``permuted_columns``), so the x tile is one contiguous load. The decode is float32,
each weight rounded to float16 once (the default: the same weights as the fp16 dequantized
copies the larger batches multiply, so a prompt's logits do not depend on which path ran), or
float16 (``GemmQConfig.half``; ``DEIMOS_DECODE_F16=1`` for the rule and moe_gemm): each
group's scale and min (``group_scales`` / ``q2k_scales``, float32) rounded to float16 once,
the 4-bit formats' codes made by inline PTX with float16 magic numbers (three instructions a
pair of codes) and scaled by one float16x2 fused multiply-add a pair, the other formats'
codes by ``_dequant_kernel``'s operations in float16. The float16 decode is 378 instructions
against 575 a step of 64 weights a thread for Q4_K in the sm_90 SASS, but on an H100 it was
only 1-5% faster (llama 8B's Q4_K matrices at 16 and 64 rows; qwen3moe's prefill +0.6%) for
twice the weights' rounding error, and its weights differed from the other paths' (a cached
prompt's last token then got other logits than the whole prompt's prefill had): off by
default. ``split_k > 1``: K is cut into that many runs of whole steps over the grid's second
axis and the partial sums are atomically added into a zeroed output (when n / block_n alone
gives too few programs to keep the memory system busy).

``GemmQConfig.mmq`` (Q4_K, Q5_K, Q6_K; the rule's choice for Q4_K up to ``MMQ_ROWS`` rows,
``mmq_config``): the loop is ``mmq``'s product instead, the code bytes copied to shared memory
undecoded and decoded in the dot's operand layout (2-2.4x the register decode on an H100 for
Q4_K at 8-32 rows), K split into runs of whole blocks of 256.

Rows past n are clamped to row n - 1 for loading (no row masks in the loop) and never stored;
rows of x past M are masked on load (no memory traffic) and on store.

Oracle: ``gemm_q_reference`` (the packed layout decoded by ``naive.dequantize_packed``, equal
to deimos.quant bit for bit, times x in float64); the float16 decode's own weights:
``naive.dequantize_packed_half``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from deimos.gguf.constants import GGML_BLOCK, GGMLType
from deimos.quant.triton.dequant_gemv import (
    FMT_ID,
    Q2_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_1,
    Q5_K,
    Q8_0,
    _codes,
    _fma,
    gemv_out,
    group_scales,
    group_words,
    pow2_at_most,
    q2k_scales,
    scale16,
    weight_arrays,
    words_per_group,
)
from deimos.quant.triton.gemv_q8 import _INTERPRETED
from deimos.quant.triton.layout import KERNEL_TYPE, PackedWeight
from deimos.quant.triton.mmq import ELEMENTS, MMQ_TYPES, WORDS, mmq_product
from deimos.quant.triton.pdl import launch_options, pdl_on, pdl_start
from deimos.switches import env_switch

MAX_ROWS = 64  # activation rows a call (one M tile: block_m <= 64)
# Q4_K up to this many rows through mmq rather than an fp16 copy (``mmq_config``; past them mmq
# only where the linear has no copy: ``uses_mmq``). H100, session 49
# (bench/exp_gemm_dense_mmq.py, llama 8B's Q4_K matrices, CUDA-graph replays from HBM): at 16
# rows [28672, 4096] 62 us against the register decode's 149 and an fp16 copy's 87, [4096,
# 4096] 14 / 23 / 15; at 32 rows 71 / 201 / 129. At 64 rows an expert stack's plain mmq was
# slower than the register decode (moe_gemm.MMQ_MAX_BLOCK_M); the SWAP + JOIN form is not
# (session 51, dense [28672, 4096]: 107 against 167 us; an fp16 copy 105).
MMQ_ROWS = 32
# The weight decode of gemm_q's rule and of moe_gemm: float32 rounded once (``decode_tile``);
# read once, DEIMOS_DECODE_F16=1 the float16 one, for A/B measurements (as DEIMOS_PDL=0)
HALF_DECODE = env_switch("DEIMOS_DECODE_F16", False)


@triton.jit
def _value(b_w, b_h, s_lo, s_hi, mn_lo, mn_hi, k: tl.constexpr, FMT: tl.constexpr,
           HALF: tl.constexpr, ASM: tl.constexpr):
    """Code k of every word, decoded with ``_dequant_kernel``'s operations: s q (+ mn; Q2_K:
    - mn), s and mn those of the group's first 16 elements for codes k < NK / 2 (NK = 32 / W
    codes a word), of its last 16 for the others; in float16 (HALF) or float32."""
    W: tl.constexpr = 8 if FMT == Q8_0 else (2 if FMT == Q2_K else 4)
    NK: tl.constexpr = 32 // W
    HAS_MIN: tl.constexpr = FMT == Q4_K or FMT == Q5_K or FMT == Q4_1 or FMT == Q5_1
    q = _codes(b_w, b_h, k, FMT, HALF)
    if k < NK // 2:
        s = s_lo
        mn = mn_lo
    else:
        s = s_hi
        mn = mn_hi
    if FMT == Q2_K:
        val = _fma(q, s, -mn, HALF, ASM)
    elif HAS_MIN:
        val = _fma(q, s, mn, HALF, ASM)
    else:
        val = s * q
    return val


@triton.jit
def _stack4(b_w, b_h, s_lo, s_hi, mn_lo, mn_hi, k0: tl.constexpr, STEP: tl.constexpr,
            FMT: tl.constexpr, HALF: tl.constexpr, ASM: tl.constexpr):
    """Codes k0, k0 + STEP, k0 + 2 STEP, k0 + 3 STEP of every word stacked on a new minor
    dimensions ``[..., 2, 2]`` (flattened: in that order), in the registers of the thread that
    holds the word (tl.join's new dimension is in-thread): element [a, b] of
    join(join(v0, v2), join(v1, v3)) is v(2a + b)."""
    v0 = _value(b_w, b_h, s_lo, s_hi, mn_lo, mn_hi, k0, FMT, HALF, ASM)
    v1 = _value(b_w, b_h, s_lo, s_hi, mn_lo, mn_hi, k0 + STEP, FMT, HALF, ASM)
    v2 = _value(b_w, b_h, s_lo, s_hi, mn_lo, mn_hi, k0 + 2 * STEP, FMT, HALF, ASM)
    v3 = _value(b_w, b_h, s_lo, s_hi, mn_lo, mn_hi, k0 + 3 * STEP, FMT, HALF, ASM)
    return tl.join(tl.join(v0, v2), tl.join(v1, v3))


@triton.jit
def _decode_words(b_w, b_h, s_lo, s_hi, mn_lo, mn_hi, FMT: tl.constexpr, BN: tl.constexpr,
                  BS: tl.constexpr, HALF: tl.constexpr, ASM: tl.constexpr):
    """Words ``[BN, BS, W]`` and their groups' scales ``[BN, BS, 1]`` -> float32
    ``[BN, BS * W * NK]``: code k of word w of group s at column (s W + w) NK + k, the packed
    words' column order (``permuted_columns``) of the step's BS groups."""
    W: tl.constexpr = 8 if FMT == Q8_0 else (2 if FMT == Q2_K else 4)
    NK: tl.constexpr = 32 // W
    # join(A, B) of the even codes A and the odd ones B, each stacked in order, flattens to
    # codes 0, 1, 2, ... (the new minor index is a code's low bit); likewise by 4 for NK = 16
    if NK == 4:
        val = _stack4(b_w, b_h, s_lo, s_hi, mn_lo, mn_hi, 0, 1, FMT, HALF, ASM)
    elif NK == 8:
        val = tl.join(_stack4(b_w, b_h, s_lo, s_hi, mn_lo, mn_hi, 0, 2, FMT, HALF, ASM),
                      _stack4(b_w, b_h, s_lo, s_hi, mn_lo, mn_hi, 1, 2, FMT, HALF, ASM))
    else:  # 16 (Q2_K)
        val = tl.join(tl.join(_stack4(b_w, b_h, s_lo, s_hi, mn_lo, mn_hi, 0, 4, FMT, HALF, ASM),
                              _stack4(b_w, b_h, s_lo, s_hi, mn_lo, mn_hi, 2, 4, FMT, HALF, ASM)),
                      tl.join(_stack4(b_w, b_h, s_lo, s_hi, mn_lo, mn_hi, 1, 4, FMT, HALF, ASM),
                              _stack4(b_w, b_h, s_lo, s_hi, mn_lo, mn_hi, 3, 4, FMT, HALF, ASM)))
    return tl.reshape(val, (BN, BS * W * NK))


# inline PTX of ``_nibble_codes``: the eight codes of a word (an int32 repeated in $4..$11) as
# float16 in $0..$3, two a register: byte j of the word (codes 2j, 2j + 1) copied to bytes 0
# and 2 (prmt), its low nibble kept at bits 0-3 and its high one at bits 20-23, ORed with the
# float16 bits of 1024 (ulp 1) and of 64 (ulp 1/16: bits 4-7 of the mantissa count units):
# (1024 + c_2j, 64 + c_2j+1), exact; one float16x2 subtraction of (1024 + OFF, 64 + OFF)
# leaves (c_2j - OFF, c_2j+1 - OFF)
_NIBBLES_ASM = "{\n.reg .b32 m;\nmov.b32 m, MAGIC;\n" + "".join(
    f"prmt.b32 ${j}, $4, $4, 0x{j}{j}{j}{j};\n"
    f"lop3.b32 ${j}, ${j}, 0x00F0000F, 0x54006400, 0xEA;\n"
    f"sub.rn.f16x2 ${j}, ${j}, m;\n" for j in range(4)) + "}"
_NIBBLES_CONSTRAINTS = tl.constexpr("=r,=r,=r,=r," + ",".join(["r"] * 8))
# the subtrahend pair (64 + OFF) << 16 | (1024 + OFF) in float16 bits: OFF 0 (Q4_K, Q4_1), 8 (Q4_0)
_NIBBLES_ASM_0 = tl.constexpr(_NIBBLES_ASM.replace("MAGIC", "0x54006400"))
_NIBBLES_ASM_8 = tl.constexpr(_NIBBLES_ASM.replace("MAGIC", "0x54806408"))


@triton.jit
def _code16(w, i: tl.constexpr, OFF: tl.constexpr):
    """Code i of every word in float16, less OFF (the interpreter's ``_nibble_codes``)."""
    return (((w >> (4 * i)) & 0xF) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - (1024.0 + OFF)


@triton.jit
def _nibble_codes(b_w, FMT: tl.constexpr, ASM: tl.constexpr):
    """The eight 4-bit codes of every word ``[..., W]`` in float16 less the format's zero point
    (Q4_0: 8), exact, as ``[..., W, 2, 2, 2]``: element [a, b, c] is code 4a + 2b + c (the
    in-thread order, so flattening keeps the words' column order). On a GPU one inline-PTX
    block a word (``_NIBBLES_ASM``: three instructions a pair of codes, packed as the
    float16x2 arithmetic after it wants them); in the interpreter the same values a code at a
    time."""
    if ASM:
        w2 = tl.join(b_w, b_w)
        w8 = tl.join(tl.join(w2, w2), tl.join(w2, w2))
        if FMT == Q4_0:
            codes = tl.inline_asm_elementwise(_NIBBLES_ASM_8, _NIBBLES_CONSTRAINTS, [w8],
                                              dtype=tl.float16, is_pure=True, pack=8)
        else:
            codes = tl.inline_asm_elementwise(_NIBBLES_ASM_0, _NIBBLES_CONSTRAINTS, [w8],
                                              dtype=tl.float16, is_pure=True, pack=8)
    else:
        OFF: tl.constexpr = 8.0 if FMT == Q4_0 else 0.0
        codes = tl.join(
            tl.join(tl.join(_code16(b_w, 0, OFF), _code16(b_w, 4, OFF)),
                    tl.join(_code16(b_w, 2, OFF), _code16(b_w, 6, OFF))),
            tl.join(tl.join(_code16(b_w, 1, OFF), _code16(b_w, 5, OFF)),
                    tl.join(_code16(b_w, 3, OFF), _code16(b_w, 7, OFF))))  # fmt: skip
    return codes


@triton.jit
def _decode_nibbles(b_w, s, mn, FMT: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr,
                    ASM: tl.constexpr):
    """``_decode_words`` for the plain 4-bit formats (Q4_K, Q4_0, Q4_1), whose groups of 32
    have one scale and min, in float16x2: words ``[BN, BS, 4]``, float16 scales and mins
    ``[BN, BS, 1]`` -> float16 ``[BN, BS * 32]`` in the same column order: s c (+ mn), one
    fused multiply-add a pair of codes after ``_nibble_codes``."""
    codes = _nibble_codes(b_w, FMT, ASM)
    s6 = s[:, :, :, None, None, None]
    if FMT == Q4_0:
        val = codes * s6
    else:
        val = _fma(codes, s6, mn[:, :, :, None, None, None], True, ASM)
    return tl.reshape(val, (BN, BS * 32))


@triton.jit
def decode_tile(b_w, b_h, sc_lo, sc_hi, mn_lo, mn_hi, FMT: tl.constexpr, BN: tl.constexpr,
                BS: tl.constexpr, ASM: tl.constexpr, HALF: tl.constexpr = True):
    """A loop step's words ``[BN, BS, W]`` and their groups' float32 scales ``[BN, BS]`` ->
    float16 ``[BN, BS * 32]`` in the words' column order (what tl.dot takes). The plain 4-bit
    formats: codes made by inline PTX (ASM; the interpreter: the same values in Triton) and
    scaled in float16x2 (``_decode_nibbles``); the others decoded by ``_decode_words``, in
    float16 (HALF: the scales rounded to float16 once a group) or float32 rounded once."""
    if HALF:
        sc_lo, sc_hi = sc_lo.to(tl.float16), sc_hi.to(tl.float16)
        mn_lo, mn_hi = mn_lo.to(tl.float16), mn_hi.to(tl.float16)
    if HALF and (FMT == Q4_K or FMT == Q4_0 or FMT == Q4_1):
        b_wt = _decode_nibbles(b_w, sc_lo[:, :, None], mn_lo[:, :, None], FMT, BN, BS, ASM)
    else:
        val = _decode_words(b_w, b_h, sc_lo[:, :, None], sc_hi[:, :, None], mn_lo[:, :, None],
                            mn_hi[:, :, None], FMT, BN, BS, HALF, ASM)
        b_wt = val.to(tl.float16)
    if HALF and ASM:
        # an identity move: Triton 3.6's dot-operand pass hoists the tile's layout conversion
        # for the Hopper MMA (block_m 64) up through the float16 decode and fails ("Illegal
        # shared layout"); it does not hoist through inline PTX
        b_wt = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [b_wt], dtype=tl.float16,
                                         is_pure=True, pack=2)
    return b_wt


# M and S_SPLIT only bound masks and the loop: not specialized on (M = 1, 16 | M), so one
# compiled kernel serves every batch size of a tile
@triton.jit(do_not_specialize=["M", "S_SPLIT", "R_S", "R_QH", "R_D"])
def _gemm_q_kernel(
    p_x, p_qw, p_qh, p_s, p_d, p_m, p_y,
    M, N, K, stride_xm, S_SPLIT,
    FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr,
    ATOMIC: tl.constexpr, EVEN: tl.constexpr, SCALE16: tl.constexpr = False,
    PDL: tl.constexpr = False, ASM: tl.constexpr = False, HALF: tl.constexpr = True,
    MMQ: tl.constexpr = False, R_QW=0, R_S=0, R_QH=0, R_D=0, X_ORDER: tl.constexpr = WORDS,
    SWAP: tl.constexpr = False, JOIN: tl.constexpr = False,
):  # fmt: skip
    """Program (i_n, i_k): weight rows i_n BLOCK_N .. + BLOCK_N, groups i_k S_SPLIT ..
    + S_SPLIT of each row (S_SPLIT a multiple of a step's BLOCK_J / W groups), all M rows of
    x. EVEN: every program's run is S_SPLIT groups (no masks in the loop but x's rows).
    ATOMIC: partial sums added into p_y (zeroed by the caller) instead of stored. MMQ (Q4_K,
    Q5_K, Q6_K; a step a block of 8 groups): the run through ``mmq``'s product (``R_*``: the
    arrays' row widths), x's columns in ``X_ORDER`` (mmq's WORDS or ELEMENTS; the register
    decode: WORDS); SWAP, JOIN: Q4_K's 64-row forms (``q4k_product``)."""
    pdl_start(PDL)
    W: tl.constexpr = 8 if FMT == Q8_0 else (2 if FMT == Q2_K else 4)
    BLOCK_S: tl.constexpr = BLOCK_J // W  # groups of 32 a step
    BLOCK_K: tl.constexpr = BLOCK_S * 32
    S_TOTAL = K // 32
    i_n = tl.program_id(0)  # row tiles on axis 0 (a 152k-row vocabulary: 9.5k tiles of 16)
    i_k = tl.program_id(1)
    o_y = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_n = tl.minimum(o_y, N - 1).to(tl.int64)  # rows that are loaded (the stored ones: o_y < N)
    m_n = o_n >= 0  # all true: the shape the loop's masks broadcast from
    o_m = tl.arange(0, BLOCK_M)
    m_m = o_m < M
    o_s = tl.arange(0, BLOCK_S)
    o_kk = tl.arange(0, BLOCK_K)
    s_lo = i_k * S_SPLIT
    s_hi = tl.minimum(s_lo + S_SPLIT, S_TOTAL)
    p_xt = p_x + o_m[:, None] * stride_xm + o_kk[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if MMQ:  # mmq's products over this program's blocks of 256
        p_xr = p_x + o_m[:, None] * stride_xm
        b_lo, b_hi = s_lo // 8, s_hi // 8
        if SWAP:  # the weights the dot's first operand: W x^T, transposed once at the end
            acc_t = mmq_product(tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), FMT, p_qw, p_qh, p_s, p_d, R_QW,
                                R_QH, R_S, R_D, o_n, p_xr, m_m, b_lo, b_hi, X_ORDER, HALF, ASM, SCALE16, True, JOIN)
            acc = tl.trans(acc_t)
        else:
            acc = mmq_product(acc, FMT, p_qw, p_qh, p_s, p_d, R_QW, R_QH, R_S, R_D, o_n, p_xr, m_m, b_lo, b_hi,
                              X_ORDER, HALF, ASM, SCALE16, False, JOIN)
    else:
        for s0 in range(s_lo, s_hi, BLOCK_S):
            u = s0 + o_s
            m_s = u < s_hi
            m_ns = m_n[:, None] & m_s[None, :]
            # words [BN, BS, W] (a thread holds a group's words); masked words and scales load as
            # 0, so their values are 0
            b_w, b_h, _ = group_words(p_qw, p_qh, o_n, m_n, u, m_s, S_TOTAL, FMT, not EVEN)
            if FMT == Q2_K:
                sc_lo, sc_hi, mn_lo, mn_hi = q2k_scales(p_s, p_d, p_m, o_n, u, m_ns, S_TOTAL, not EVEN)
            else:
                sc_lo, sc_hi, mn_lo = group_scales(p_s, p_d, p_m, o_n, u, m_ns, S_TOTAL, FMT, not EVEN,
                                                   SCALE16)
                mn_hi = mn_lo
            # [BLOCK_N, BLOCK_K], x's permuted column order
            b_wt = decode_tile(b_w, b_h, sc_lo, sc_hi, mn_lo, mn_hi, FMT, BLOCK_N, BLOCK_S, ASM, HALF)
            if EVEN:
                b_x = tl.load(p_xt + s0 * 32, mask=m_m[:, None], other=0.0)
            else:
                m_k = s0 * 32 + o_kk < s_hi * 32
                b_x = tl.load(p_xt + s0 * 32, mask=m_m[:, None] & m_k[None, :], other=0.0)
            acc = tl.dot(b_x, tl.trans(b_wt), acc, out_dtype=tl.float32)
    p_out = p_y + o_m[:, None] * N + o_y[None, :]
    m_out = m_m[:, None] & (o_y < N)[None, :]
    if ATOMIC:
        tl.atomic_add(p_out, acc, mask=m_out, sem="relaxed")
    else:
        tl.store(p_out, acc, mask=m_out)


class GemmQConfig(NamedTuple):
    """A launch of ``gemm_q`` (module docstring)."""

    block_m: int  # activation rows a program (16, 32 or 64; >= M, M padded)
    block_n: int  # weight rows a program
    block_j: int  # code words of each weight row per loop step (BLOCK_K = block_j * 32 / W)
    num_warps: int
    num_stages: int
    split_k: int = 1  # > 1: K split over programs, partial sums atomically added into a zeroed out
    half: bool = False  # the decode in float16 (``decode_tile``); False: float32 rounded once
    mmq: bool = False  # Q4_K / Q5_K / Q6_K through mmq's products (block_j 8 groups: a block of 256)
    swap: bool = False  # mmq, Q4_K: the decoded weights the dot's first operand (q4k_product's SWAP)
    join: bool = False  # mmq, Q4_K: a group one K = 32 dot (q4k_product's JOIN)


# Triton's interpreter (CPU tensors) runs the programs one after another: there the fewest
# programs and steps win (tests' matrices: 70-200 rows, K <= 1024)
INTERPRETER_TILE = GemmQConfig(64, 128, 128, 4, 1)

# The rule's model of the H200 (to be refined by bench/sweep_gemm_batch.py): weight bytes come
# from HBM at the roof only with about two programs an SM (132 SMs); x comes from L2, which
# we take to deliver ~2x HBM's rate; a split-K partial sum is an L2 read-modify-write (~2
# bytes' cost a byte) and a split launch also pays the output's memset (~1 us of stream time,
# ~4 MB at the roof).
PROGRAMS = 264
L2_SPEEDUP = 2.0
ATOMIC_COST = 2.0
SPLIT_FIXED_BYTES = 4.0e6
TILE_ELEMENTS = 8192  # decoded weights a step: 64 float32 registers a thread on 4 warps
X_STAGE_BYTES = 16384  # an x tile a pipeline stage (block_m * block_k * 2)


def _bits_per_weight(t: GGMLType) -> float:
    block, size = GGML_BLOCK[t]
    return 8.0 * size / block


def _block_k(block_m: int, block_n: int) -> int:
    # at most 256: with 16-32 rows of x the tensor-core product (mma.sync, warps along n)
    # holds the whole x tile in every warp's registers (BLOCK_K 512: ~190 registers a thread)
    return max(64, min(TILE_ELEMENTS // block_n, X_STAGE_BYTES // (2 * block_m), 256))


def _cost(n: int, k: int, m: int, bpw: float, block_n: int, split: int) -> float:
    """Bytes-at-the-roof equivalent of a launch: (weight + x from L2 + split-K partial sums)
    over the share of the machine the programs keep busy."""
    tiles = math.ceil(n / block_n)
    w_bytes = n * k * bpw / 8
    x_bytes = tiles * m * k * 2 / L2_SPEEDUP  # every row tile reads all of x (its K run)
    extra = split * m * n * 4 * ATOMIC_COST + SPLIT_FIXED_BYTES if split > 1 else 0.0
    return (w_bytes + x_bytes + extra) / min(1.0, tiles * split / PROGRAMS)


def gemm_q_config(ggml_type: GGMLType, n: int, k: int, m: int) -> GemmQConfig:
    """The launch rule, from the byte counts of a memory-bound stream (no H200 sweep yet; the
    constants above): among 16-128 weight rows a program and splits of K into 1-16 runs of at
    least two steps, the tile that moves the fewest bytes for the share of the SMs it keeps
    busy (``_cost``). Few rows of x: 16-row tiles, many programs (x is a small share of the
    bytes); more rows: wider tiles (every row tile rereads x: x bytes / weight bytes =
    16 M / (block_n * bits a weight)), then split-K where n / block_n gives under ~264
    programs (not for small matrices, where the split's memset costs more than it gains).
    A step decodes ``TILE_ELEMENTS`` weights (block_k = 8192 / block_n columns, 64 to 256,
    its x tile within ``X_STAGE_BYTES``), widened to 16 words (64 bytes) of each row where
    the tile stays within twice that (on 8 warps); 4 warps, 3-stage pipelined loads (4 for
    the small tiles, whose stages are cheap). ``ggml_type``: the weight's kernel format (a
    format packed in another's layout, e.g. IQ4_XS, gets that layout's rule). Q4_K up to
    ``MMQ_ROWS`` rows: ``mmq_config``."""
    if uses_mmq(ggml_type, m):
        return mmq_config(n, k, m)
    t = KERNEL_TYPE.get(GGMLType(ggml_type), GGMLType(ggml_type))
    nk = 32 // words_per_group(t)
    bpw = _bits_per_weight(t)
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    best = None
    for block_n in (16, 32, 64, 128):
        block_k = _block_k(block_m, block_n)
        split = 1
        while True:
            c = _cost(n, k, m, bpw, block_n, split)
            if best is None or c < best[0] * 0.97:  # a clearly better tile only: prefer small
                best = (c, block_n, block_k, split)
            if split >= 16 or k // (2 * split) < 2 * block_k:  # a run of >= 2 steps each
                break
            split *= 2
    _, block_n, block_k, split = best
    # a step reads 64 bytes (16 words) of each row where the decoded tile stays within 64
    # registers a thread on 8 warps and the x tile within its stage's bytes
    block_j = block_k // nk
    while (block_j < 16 and block_n * 2 * block_j * nk <= 2 * TILE_ELEMENTS
           and block_m * 2 * block_j * nk * 2 <= X_STAGE_BYTES):  # fmt: skip
        block_j *= 2
    warps = 8 if block_n * block_j * nk > TILE_ELEMENTS else 4
    stages = 4 if block_n * block_m <= 1024 else 3
    return GemmQConfig(block_m, block_n, block_j, warps, stages, split, HALF_DECODE)


def uses_mmq(ggml_type: GGMLType, m: int) -> bool:
    """Whether the rule (``gemm_q_config``) multiplies ``m`` rows of a ``ggml_type`` weight
    through mmq: Q4_K (up to MMQ_ROWS rows it also beats an fp16 copy; past them, to 64 rows,
    it beats gemm_q's register decode: ``mmq_config``)."""
    return GGMLType(ggml_type) == GGMLType.Q4_K and m <= MAX_ROWS


def takes_elements(w: PackedWeight, m: int) -> bool:
    """Whether ``gemm_q``'s rule takes ``m`` rows of x for ``w`` in the elements' order
    (``x_permuted=False``): its tile is mmq's (``uses_mmq``; the interpreter's tile is not)."""
    return w.device.type != "cpu" and uses_mmq(w.ggml_type, m)


def mmq_config(n: int, k: int, m: int, ggml_type: GGMLType = GGMLType.Q4_K) -> GemmQConfig:
    """The tile of a Q4_K product through mmq (``GemmQConfig.mmq``): 128 weight rows a program
    at 16 rows (64 where that alone keeps too few programs), 64 at 32 (bench/exp_gemm_mmq.py,
    H100, session 49: the best of six tiles at both), 4 warps, 3 stages, a step a block of
    256. Past 32 rows 64-row tiles of 128 weight rows with SWAP and JOIN (session 51, H100,
    [28672, 4096] at 64 rows: 107.1 us against the plain form's 143.1 and gemm_q's register
    decode's 167.2; an fp16 copy's product 105.1, which the linears keep where they have one).
    K split as ``gemm_q_config`` splits it (``_cost``: the fewest bytes for the SMs kept busy)
    into runs of whole blocks."""
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    bpw = _bits_per_weight(GGMLType(ggml_type))
    best = None
    blocks = k // 256
    for block_n in (128, 64) if m <= 16 else ((64,) if m <= 32 else (128,)):
        split = 1
        while True:
            runs = -(-blocks // -(-blocks // split))  # the runs of whole blocks k_runs makes
            c = _cost(n, k, m, bpw, block_n, runs)
            if best is None or c < best[0] * 0.97:
                best = (c, block_n, split)
            if split >= 16 or blocks < 2 * split:
                break
            split *= 2
    wide = block_m == 64 and GGMLType(ggml_type) == GGMLType.Q4_K
    return GemmQConfig(block_m, best[1], 8 * words_per_group(GGMLType(ggml_type)), 4, 3, best[2], HALF_DECODE,
                       True, wide, wide)


def _check_config(cfg: GemmQConfig, m: int, wpg: int) -> None:
    nk = 32 // wpg
    ok = (cfg.block_m in (16, 32, 64) and pow2_at_most(cfg.block_n, 256) and cfg.block_n >= 16
          and pow2_at_most(cfg.block_j, 1024) and cfg.block_j >= wpg and cfg.block_j * nk <= 4096
          and cfg.num_warps in (1, 2, 4, 8) and 1 <= cfg.num_stages <= 6
          and isinstance(cfg.split_k, int) and 1 <= cfg.split_k <= 256
          and isinstance(cfg.half, bool) and isinstance(cfg.mmq, bool)
          and isinstance(cfg.swap, bool) and isinstance(cfg.join, bool))  # fmt: skip
    if not ok:
        raise ValueError(f"gemm_q: bad tile {cfg} (block_m 16, 32 or 64; block_n a power of two in "
                         f"16..256; block_j one from {wpg} (a group's words) with block_j * {nk} "
                         "columns <= 4096; num_warps 1, 2, 4 or 8; 1..6 stages; split_k 1..256; half a bool)")
    if cfg.block_m < m:
        raise ValueError(f"gemm_q: tile {cfg} has block_m {cfg.block_m} < M = {m}")
    if cfg.mmq and cfg.block_j != 8 * wpg:
        raise ValueError(f"gemm_q: mmq tile {cfg} needs block_j {8 * wpg} (a step a block of 256)")


def k_runs(k: int, wpg: int, cfg: GemmQConfig) -> tuple[int, int, bool]:
    """How a launch cuts a row's ``k / 32`` groups (``wpg`` words each) over the grid's second
    axis: (groups a program, programs, EVEN). Each run is whole steps of ``block_j / wpg``
    groups; only the last may be short (EVEN: none is), and splits left with no groups are
    dropped."""
    s_total = k // 32
    step = cfg.block_j // wpg
    s_split = triton.cdiv(triton.cdiv(s_total, cfg.split_k), step) * step
    return s_split, triton.cdiv(s_total, s_split), s_total % s_split == 0


def gemm_q(w: PackedWeight, x: torch.Tensor, out: torch.Tensor | None = None,
           cfg: GemmQConfig | None = None, x_permuted: bool = True) -> torch.Tensor:
    """y = x @ W^T: x fp16 [M, k] (1 <= M <= 64) with its COLUMNS ALREADY PERMUTED to the weight's
    word order (x[:, permuted_columns(w)], contiguous), W packed [n, k] -> float32 [M, n].

    ``x``: float16 ``[M, k]`` with unit column stride (rows may be strided), on w's device.
    ``out``: optional contiguous float32 ``[M, n]``, written in full (zeroed first when the
    tile splits K). ``cfg``: the tile (default ``gemm_q_config``, or ``INTERPRETER_TILE`` for
    a weight on the CPU, block_m lowered to fit M). ``x_permuted=False``: x in the elements'
    order, reordered in registers by mmq's loop (an mmq tile only: ``takes_elements``)."""
    if w.ggml_type not in FMT_ID:
        raise ValueError(f"gemm_q: no kernel for {w.ggml_type.name}")
    if x.dim() != 2 or x.shape[1] != w.k:
        raise ValueError(f"gemm_q: x must be [M, {w.k}] (the {w.ggml_type.name} weight's k, "
                         f"columns permuted), got {tuple(x.shape)}")  # fmt: skip
    if x.dtype != torch.float16:
        raise ValueError(f"gemm_q: x must be float16, got {x.dtype}")
    m = x.shape[0]
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"gemm_q: M = {m} rows not in 1..{MAX_ROWS}")
    if x.device != w.device:
        raise ValueError(f"gemm_q: x is on {x.device}, the weight on {w.device}")
    if x.stride(1) != 1:
        raise ValueError("gemm_q: x needs unit column stride")
    out = gemv_out(out, m, w.n, x.device, "gemm_q")
    if w.n == 0:
        return out
    wpg = words_per_group(w.ggml_type)
    if cfg is None:
        if w.device.type == "cpu":
            cfg = INTERPRETER_TILE._replace(block_m=16 if m <= 16 else (32 if m <= 32 else 64),
                                            half=HALF_DECODE)
        else:
            cfg = gemm_q_config(w.ggml_type, w.n, w.k, m)
    if (cfg.swap or cfg.join) and not (cfg.mmq and w.ggml_type == GGMLType.Q4_K):
        raise ValueError(f"gemm_q: swap and join are Q4_K's mmq forms, got {cfg} for {w.ggml_type.name}")
    if cfg.mmq and (w.ggml_type not in MMQ_TYPES or w.k % 256):
        raise ValueError(f"gemm_q: mmq tiles are for {', '.join(t.name for t in MMQ_TYPES)} with K a "
                         f"multiple of 256, the weight is {w.ggml_type.name} with K {w.k}")
    _check_config(cfg, m, wpg)
    if not x_permuted and not cfg.mmq:
        raise ValueError(f"gemm_q: x in the elements' order needs an mmq tile, got {cfg}")
    s_split, splits, even = k_runs(w.k, wpg, cfg)
    tiles = triton.cdiv(w.n, cfg.block_n)
    if splits > 65535:
        raise ValueError(f"gemm_q: {splits} K splits do not fit a CUDA grid")
    if splits > 1:
        out.zero_()
    arrays = weight_arrays(w)
    _gemm_q_kernel[(tiles, splits)](
        x, *arrays, out, m, w.n, w.k, x.stride(0), s_split,
        FMT=FMT_ID[w.ggml_type], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_J=cfg.block_j,
        ATOMIC=splits > 1, EVEN=even or cfg.mmq, SCALE16=scale16(w), ASM=not _INTERPRETED, HALF=cfg.half,
        MMQ=cfg.mmq, R_QW=arrays[0].stride(0), R_S=arrays[2].stride(0), R_QH=arrays[1].stride(0),
        R_D=arrays[3].stride(0), X_ORDER=WORDS if x_permuted else ELEMENTS, SWAP=cfg.swap, JOIN=cfg.join,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **launch_options(pdl_on(out.device)),
    )  # fmt: skip
    return out


def gemm_q_reference(w: PackedWeight, x: torch.Tensor) -> torch.Tensor:
    """torch oracle: x (element order, any float) @ dequantized(w)^T in float32.

    x ``[M, k]`` in the elements' column order (not permuted); the packed layout decoded by
    ``naive.dequantize_packed`` (bit-exact against deimos.quant), the product taken in float64
    on the CPU and returned as float32 ``[M, n]`` (CPU)."""
    from deimos.quant.triton.naive import dequantize_packed

    if x.dim() != 2 or x.shape[1] != w.k:
        raise ValueError(f"gemm_q_reference: x must be [M, {w.k}], got {tuple(x.shape)}")
    wd = dequantize_packed(w).double()
    return (x.detach().cpu().double() @ wd.T).float()
