"""Experiment (session 48): a Q4_K GEMM on integer tensor cores, the way llama.cpp's MMQ works,
against gemm_q (weights decoded to float16 in registers, then float16 MMA). A measurement, not
part of the engine.

Why: every float16-decode formulation of the quantized GEMM tried (sessions 27-28, 43) tops out
at ~0.4-0.55 TB/s of Q4_K bytes, ~1e12 weights a second, which bounds MoE prefill (qwen3moe
pp512 ~0.5x llama.cpp's, whose MMQ kernels multiply int8). In gemm_q's sm_90 SASS a 64-weight
step a thread is ~719 instructions, 64 of them 16-bit shared-memory stores of the decoded tile.

Here the weights stay in GGUF's own Q4_K blocks (144 bytes a 256-weight super-block). A
super-block's codes are four 32-byte runs; run p holds group 2p in its low nibbles and group
2p + 1 in its high ones, so a ``[BN, 32]`` byte tile gives two whole groups of 32 by one AND
and one shift, with no reordering: each group is one K = 32 int8 ``tl.dot`` with x quantized
to int8 per group of 32 (scale xd = amax / 127; one plane, as llama.cpp's q8_1, or two planes,
x = (254 q1 + q2) xd / 254, as gemv_q8's), then the int32 product is scaled into the float32
accumulator: ``acc += dot * xd[m] * d sc[n] - xs[m] * dmin m[n]`` (xs: the group's float sum
of x; the Q4_K value is d sc q - dmin m).

Predicted per group and thread (BN = 64 weight rows, 4 warps): 16 codes (two byte ops a
4-byte register), 16 accumulator elements x ~4 float ops at BM = 32 tokens: ~5 instructions a
weight against gemm_q's ~11, and shared memory only through the raw bytes' pipelined copies.
If the decode is what bounds gemm_q, ~2x its rate at 32-64 rows.

    python bench/exp_gemm_mmq.py [NxK ...] [--rows 16,32,64]
    TRITON_INTERPRET=1 python bench/exp_gemm_mmq.py 256x512 --rows 16   # correctness here
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch
import triton
import triton.language as tl

from deimos.gguf.constants import GGMLType
from deimos.quant import get_format

DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") == "0" else "cpu"
PLANE = 254


@triton.jit
def _high_nibbles(b, ASM: tl.constexpr):
    """b >> 4 of uint8 b as int8: on a GPU one shift and one AND a 4-byte register (Triton
    lowers the uint8 shift byte by byte, unpacking and repacking with PRMT)."""
    if ASM:
        q = tl.inline_asm_elementwise("{.reg .b32 t; shr.b32 t, $1, 4; and.b32 $0, t, 0x0F0F0F0F;}",
                                      "=r,r", [b], dtype=tl.int8, is_pure=True, pack=4)
    else:
        q = (b >> 4).to(tl.int8)
    return q


# four bytes (packed in $2) -> their low (or high) nibbles as four float16 in $0, $1: bytes 0, 1
# (2, 3) copied to bytes 0 and 2 (prmt), the nibble masked into a float16 whose unit is its
# lowest bit: 1024 + n (low nibble), 64 + n (high one, bits 4-7 of 64's mantissa count ones)
_LO16 = tl.constexpr("{.reg .b32 a, b, m; prmt.b32 a, $2, $2, 0x1100; prmt.b32 b, $2, $2, 0x3322;"
         "lop3.b32 a, a, 0x000F000F, 0x64006400, 0xEA; lop3.b32 b, b, 0x000F000F, 0x64006400, 0xEA;"
         "mov.b32 m, 0x64006400; sub.rn.f16x2 $0, a, m; sub.rn.f16x2 $1, b, m;}")
_HI16 = tl.constexpr("{.reg .b32 a, b, m; prmt.b32 a, $2, $2, 0x1100; prmt.b32 b, $2, $2, 0x3322;"
         "lop3.b32 a, a, 0x00F000F0, 0x54005400, 0xEA; lop3.b32 b, b, 0x00F000F0, 0x54005400, 0xEA;"
         "mov.b32 m, 0x54005400; sub.rn.f16x2 $0, a, m; sub.rn.f16x2 $1, b, m;}")


@triton.jit
def _codes16(b, HIGH: tl.constexpr, ASM: tl.constexpr):
    """The low (or high) nibbles of uint8 b as float16, exact."""
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


@triton.jit
def _scale_min(p_sc, j: tl.constexpr):
    """Group j's 6-bit scale and min of each row's super-block (GGUF's get_scale_min_k4):
    ``p_sc`` points at the 12 scale bytes of each row's block."""
    if j < 4:
        sc = tl.load(p_sc + j) & 63
        mn = tl.load(p_sc + j + 4) & 63
    else:
        b = tl.load(p_sc + j + 4)
        sc = (b & 0xF) | ((tl.load(p_sc + j - 4) >> 6) << 4)
        mn = (b >> 4) | ((tl.load(p_sc + j) >> 6) << 4)
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def mmq_q4k_kernel(p_xq, p_xq2, p_xd, p_xs, p_w, p_y, M, N, K, ROW_BYTES,
                   BM: tl.constexpr, BN: tl.constexpr, PLANES: tl.constexpr):
    """y [M, N] = x [M, K] W^T, W GGUF Q4_K blocks ``[N, K / 256 * 144]`` bytes; x as int8
    ``p_xq`` (and the residual plane ``p_xq2``), ``p_xd`` / ``p_xs`` [M, K / 32] float32."""
    i_n = tl.program_id(0)
    i_m = tl.program_id(1)
    o_n = i_n * BN + tl.arange(0, BN)
    o_m = i_m * BM + tl.arange(0, BM)
    m_m = o_m < M
    o_b = tl.arange(0, 32)
    G = K // 32
    p_row = p_w + o_n.to(tl.int64) * ROW_BYTES  # [BN] each row's first block
    p_h = p_w.to(tl.pointer_type(tl.float16))
    acc = tl.zeros([BM, BN], tl.float32)
    for sb in range(0, K // 256):
        p_blk = p_row + sb * 144
        d = tl.load(p_h + (o_n.to(tl.int64) * ROW_BYTES + sb * 144) // 2).to(tl.float32)
        dmin = tl.load(p_h + (o_n.to(tl.int64) * ROW_BYTES + sb * 144) // 2 + 1).to(tl.float32)
        for p in tl.static_range(4):
            b = tl.load(p_blk[:, None] + 16 + 32 * p + o_b[None, :])  # [BN, 32] uint8
            for h in tl.static_range(2):
                g = sb * 8 + 2 * p + h
                if h == 0:
                    q = (b & 0xF).to(tl.int8)
                else:
                    q = (b >> 4).to(tl.int8)
                p_x = o_m[:, None] * K + g * 32 + o_b[None, :]
                xq = tl.load(p_xq + p_x, mask=m_m[:, None], other=0)
                dot = tl.dot(xq, tl.trans(q), out_dtype=tl.int32)
                if PLANES == 2:
                    xq2 = tl.load(p_xq2 + p_x, mask=m_m[:, None], other=0)
                    dot = dot * 254 + tl.dot(xq2, tl.trans(q), out_dtype=tl.int32)
                sc, mn = _scale_min(p_blk + 4, 2 * p + h)
                xd = tl.load(p_xd + o_m * G + g, mask=m_m, other=0.0)
                xs = tl.load(p_xs + o_m * G + g, mask=m_m, other=0.0)
                acc += dot.to(tl.float32) * (xd[:, None] * (d * sc)[None, :])
                acc -= xs[:, None] * (dmin * mn)[None, :]
    p_o = p_y + o_m[:, None] * N + o_n[None, :]
    tl.store(p_o, acc, mask=m_m[:, None])


@triton.jit
def mmq2_q4k_kernel(p_xq, p_xq2, p_xd, p_xs, p_qs, p_sm, p_dd, p_y, M, N, K,
                    BM: tl.constexpr, BN: tl.constexpr, PLANES: tl.constexpr, ASM: tl.constexpr):
    """mmq_q4k_kernel on Q4_K repacked for this kernel: the codes ``p_qs`` [N, K / 2] (GGUF's
    32-byte runs in order), each group's 6-bit scale and min as a uint16 ``p_sm`` [N, K / 32]
    (scale | min << 8), each super-block's d and dmin as one int32 ``p_dd`` [N, K / 256] (two
    float16): 20 bytes of scales a super-block instead of 16, no bit unpacking in the loop."""
    i_n = tl.program_id(0)
    i_m = tl.program_id(1)
    o_n = i_n * BN + tl.arange(0, BN)
    o_m = i_m * BM + tl.arange(0, BM)
    m_m = o_m < M
    o_b = tl.arange(0, 32)
    G = K // 32
    o_n64 = o_n.to(tl.int64)
    p_q = p_qs + o_n64[:, None] * (K // 2) + o_b[None, :]
    acc = tl.zeros([BM, BN], tl.float32)
    for sb in range(0, K // 256):
        dd = tl.load(p_dd + o_n64 * (K // 256) + sb)
        d = (dd & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        dmin = (dd >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        for p in tl.static_range(4):
            b = tl.load(p_q + sb * 128 + 32 * p)  # [BN, 32] uint8
            for h in tl.static_range(2):
                g = sb * 8 + 2 * p + h
                if h == 0:
                    q = (b & 0xF).to(tl.int8)
                else:
                    q = _high_nibbles(b, ASM)
                p_x = o_m[:, None] * K + g * 32 + o_b[None, :]
                xq = tl.load(p_xq + p_x, mask=m_m[:, None], other=0)
                dot = tl.dot(xq, tl.trans(q), out_dtype=tl.int32)
                if PLANES == 2:
                    xq2 = tl.load(p_xq2 + p_x, mask=m_m[:, None], other=0)
                    dot = dot * 254 + tl.dot(xq2, tl.trans(q), out_dtype=tl.int32)
                sm = tl.load(p_sm + o_n64 * G + g).to(tl.int32)
                sc = (sm & 0xFF).to(tl.float32) * d
                mn = (sm >> 8).to(tl.float32) * dmin
                xd = tl.load(p_xd + o_m * G + g, mask=m_m, other=0.0)
                xs = tl.load(p_xs + o_m * G + g, mask=m_m, other=0.0)
                acc += (dot.to(tl.float32) * xd[:, None]) * sc[None, :]
                acc -= xs[:, None] * mn[None, :]
    p_o = p_y + o_m[:, None] * N + o_n[None, :]
    tl.store(p_o, acc, mask=m_m[:, None])


def repack2(raw: torch.Tensor, n: int, k: int):
    """GGUF Q4_K rows ``[n, k / 256 * 144]`` -> (qs, sm, dd) of mmq2_q4k_kernel (numpy, once)."""
    b = raw.view(n, k // 256, 144).numpy()
    qs = np.ascontiguousarray(b[:, :, 16:]).reshape(n, k // 2)
    sc = b[:, :, 4:16].astype(np.int32)
    s_, m_ = np.zeros((n, k // 256, 8), np.int32), np.zeros((n, k // 256, 8), np.int32)
    s_[..., :4] = sc[..., 0:4] & 63
    m_[..., :4] = sc[..., 4:8] & 63
    s_[..., 4:] = (sc[..., 8:12] & 0xF) | ((sc[..., 0:4] >> 6) << 4)
    m_[..., 4:] = (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)
    sm = (s_ | (m_ << 8)).astype(np.uint16).reshape(n, k // 32)
    dd = np.ascontiguousarray(b[:, :, 0:4]).view(np.int32).reshape(n, k // 256)
    return (torch.from_numpy(qs.copy()), torch.from_numpy(sm.view(np.int16).copy()),
            torch.from_numpy(dd.copy()))


def mmq2_q4k(rp, n: int, k: int, qx, out: torch.Tensor, bm: int, bn: int, warps: int,
             stages: int) -> None:
    q1, q2, xd, xs = qx
    m = q1.shape[0]
    grid = (n // bn, triton.cdiv(m, bm))
    mmq2_q4k_kernel[grid](q1, q1 if q2 is None else q2, xd, xs, *rp, out, m, n, k, BM=bm, BN=bn,
                          PLANES=1 if q2 is None else 2, ASM=DEV == "cuda", num_warps=warps,
                          num_stages=stages)


@triton.jit
def mmq3_q4k_kernel(p_x, p_qs, p_sm, p_dd, p_y, M, N, K,
                    BM: tl.constexpr, BN: tl.constexpr, ASM: tl.constexpr):
    """mmq2's raw code bytes, decoded to float16 after the copy to shared memory (in the dot's
    operand layout, if Triton hoists the layout conversion above the decode) and multiplied
    with float16 x (the group's scale and min applied to the codes: sc q - mn, one float16
    fused multiply-add a weight), one K = 32 float16 dot a group: gemm_q's arithmetic with
    mmq's data path."""
    i_n = tl.program_id(0)
    i_m = tl.program_id(1)
    o_n = i_n * BN + tl.arange(0, BN)
    o_m = i_m * BM + tl.arange(0, BM)
    m_m = o_m < M
    o_b = tl.arange(0, 32)
    G = K // 32
    o_n64 = o_n.to(tl.int64)
    p_q = p_qs + o_n64[:, None] * (K // 2) + o_b[None, :]
    acc = tl.zeros([BM, BN], tl.float32)
    for sb in range(0, K // 256):
        dd = tl.load(p_dd + o_n64 * (K // 256) + sb)
        d = (dd & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        dmin = (dd >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        for p in tl.static_range(4):
            b = tl.load(p_q + sb * 128 + 32 * p)  # [BN, 32] uint8
            for h in tl.static_range(2):
                g = sb * 8 + 2 * p + h
                q = _codes16(b, h == 1, ASM)
                sm = tl.load(p_sm + o_n64 * G + g).to(tl.int32)
                sc = ((sm & 0xFF).to(tl.float32) * d).to(tl.float16)
                mn = ((sm >> 8).to(tl.float32) * dmin).to(tl.float16)
                w = q * sc[:, None] - mn[:, None]
                x = tl.load(p_x + o_m[:, None] * K + g * 32 + o_b[None, :], mask=m_m[:, None], other=0.0)
                acc = tl.dot(x, tl.trans(w), acc)
    p_o = p_y + o_m[:, None] * N + o_n[None, :]
    tl.store(p_o, acc, mask=m_m[:, None])


def mmq3_q4k(rp, n: int, k: int, x, out: torch.Tensor, bm: int, bn: int, warps: int,
             stages: int) -> None:
    m = x.shape[0]
    grid = (n // bn, triton.cdiv(m, bm))
    mmq3_q4k_kernel[grid](x, *rp, out, m, n, k, BM=bm, BN=bn, ASM=DEV == "cuda", num_warps=warps,
                          num_stages=stages)


@triton.jit
def _k4_group(w0, w1, w2, w3, j: tl.constexpr):
    """Group j's d sc and dmin m (float32) from a super-block's four meta words (layout._k4_meta)."""
    if j < 4:
        byte = (w1 >> (8 * j)) & 0xFF
    else:
        byte = (w2 >> (8 * (j - 4))) & 0xFF
    sc = (byte & 63).to(tl.float32)
    mn = ((byte >> 6) | (((w3 >> (4 * j)) & 0xF) << 2)).to(tl.float32)
    d = (w0 & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    dmin = ((w0 >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return d * sc, dmin * mn


@triton.jit
def mmq4_q4k_kernel(p_x, p_qb, p_meta, p_y, M, N, K,
                    BM: tl.constexpr, BN: tl.constexpr, HALF: tl.constexpr, ASM: tl.constexpr,
                    XG: tl.constexpr = False):
    """mmq3 on the engine's own Q4_K layout (layout.py: ``qw`` read as bytes ``p_qb`` [N, K / 2],
    ``meta``): a group's 16 bytes give its low-nibble half and its high-nibble half (byte i =
    4 w + b of the group holds elements 8 b + w and 8 b + w + 4), two K = 16 float16 dots; x
    comes permuted to match (``mmq4_columns``), or (XG) in element order, gathered here. HALF: the group's scale and min rounded to
    float16 and applied by float16 FMAs; else each weight made in float32 and rounded once
    (the copies' weights)."""
    i_n = tl.program_id(0)
    i_m = tl.program_id(1)
    o_n = i_n * BN + tl.arange(0, BN)
    o_m = i_m * BM + tl.arange(0, BM)
    m_m = o_m < M
    o_i = tl.arange(0, 16)
    o_n64 = o_n.to(tl.int64)
    p_q = p_qb + o_n64[:, None] * (K // 2) + o_i[None, :]
    p_mt = p_meta + o_n64 * (K // 64)
    acc = tl.zeros([BM, BN], tl.float32)
    for sb in range(0, K // 256):
        w0 = tl.load(p_mt + sb * 4)
        w1 = tl.load(p_mt + sb * 4 + 1)
        w2 = tl.load(p_mt + sb * 4 + 2)
        w3 = tl.load(p_mt + sb * 4 + 3)
        for j in tl.static_range(8):
            u = sb * 8 + j
            b = tl.load(p_q + u * 16)  # [BN, 16] uint8
            sc, mn = _k4_group(w0, w1, w2, w3, j)
            for h in tl.static_range(2):
                q = _codes16(b, h == 1, ASM)
                if HALF:
                    w = q * sc.to(tl.float16)[:, None] - mn.to(tl.float16)[:, None]
                else:
                    w = (q.to(tl.float32) * sc[:, None] - mn[:, None]).to(tl.float16)
                if XG:
                    o_c = 8 * (o_i % 4) + o_i // 4 + 4 * h
                else:
                    o_c = h * 16 + o_i
                x = tl.load(p_x + o_m[:, None] * K + u * 32 + o_c[None, :], mask=m_m[:, None], other=0.0)
                acc = tl.dot(x, tl.trans(w), acc)
    p_o = p_y + o_m[:, None] * N + o_n[None, :]
    tl.store(p_o, acc, mask=m_m[:, None])


def mmq4_columns(k: int) -> torch.Tensor:
    """x's column order for mmq4: position 32 u + 16 h + i holds element 32 u + 8 (i % 4) + i // 4 + 4 h."""
    i = torch.arange(16)
    within = torch.cat([8 * (i % 4) + i // 4, 8 * (i % 4) + i // 4 + 4])
    return (torch.arange(k // 32)[:, None] * 32 + within[None, :]).reshape(-1)


def mmq4_q4k(pw, x4, out: torch.Tensor, bm: int, bn: int, warps: int, stages: int, half: bool,
             xg: bool = False) -> None:
    m = x4.shape[0]
    grid = (pw.n // bn, triton.cdiv(m, bm))
    mmq4_q4k_kernel[grid](x4, pw.tensors["qw"].view(torch.uint8), pw.tensors["meta"], out, m, pw.n, pw.k,
                          BM=bm, BN=bn, HALF=half, ASM=DEV == "cuda", XG=xg, num_warps=warps,
                          num_stages=stages)


@triton.jit
def mmq6_q6k_kernel(p_x, p_qb, p_hb, p_sc, p_d, p_y, M, N, K, BM: tl.constexpr, BN: tl.constexpr):
    """Q6_K on the engine's layout (layout._pack_q6_k), x in element order (gathered): a
    group's 16 low-nibble bytes and, aligned with them, the high-bit bytes (qh entry w's byte
    b % 2 for byte i = 4 w + b: each read twice), the scale per element (bytes with b < 2 hold
    elements < 16); float32 weights rounded once."""
    i_n = tl.program_id(0)
    i_m = tl.program_id(1)
    o_n = i_n * BN + tl.arange(0, BN)
    o_m = i_m * BM + tl.arange(0, BM)
    m_m = o_m < M
    o_i = tl.arange(0, 16)
    o_n64 = o_n.to(tl.int64)
    p_q = p_qb + o_n64[:, None] * (K // 2) + o_i[None, :]
    p_h = p_hb + o_n64[:, None] * (K // 4) + (2 * (o_i // 4) + o_i % 2)[None, :]
    first = (o_i % 4 < 2)[None, :]
    sh = tl.where(first, 4, 0).to(tl.uint8)
    acc = tl.zeros([BM, BN], tl.float32)
    for blk in range(0, K // 256):
        d = tl.load(p_d + o_n64 * (K // 256) + blk).to(tl.float32)
        for j in tl.static_range(8):
            u = blk * 8 + j
            b = tl.load(p_q + u * 16)
            hb = tl.load(p_h + u * 8)
            s_a = tl.load(p_sc + o_n64 * (K // 16) + 2 * u).to(tl.float32) * d
            s_b = tl.load(p_sc + o_n64 * (K // 16) + 2 * u + 1).to(tl.float32) * d
            s = tl.where(first, s_a[:, None], s_b[:, None])
            for h in tl.static_range(2):
                if h == 0:
                    c = (b & 0xF) | (((hb >> sh) & 3) << 4)
                else:
                    c = (b >> 4) | (((hb >> (sh + 2)) & 3) << 4)
                w = ((c.to(tl.int32) - 32).to(tl.float32) * s).to(tl.float16)
                o_c = 8 * (o_i % 4) + o_i // 4 + 4 * h
                x = tl.load(p_x + o_m[:, None] * K + u * 32 + o_c[None, :], mask=m_m[:, None], other=0.0)
                acc = tl.dot(x, tl.trans(w), acc)
    p_o = p_y + o_m[:, None] * N + o_n[None, :]
    tl.store(p_o, acc, mask=m_m[:, None])


def mmq6_q6k(pw, x, out: torch.Tensor, bm: int, bn: int, warps: int, stages: int) -> None:
    m = x.shape[0]
    t = pw.tensors
    grid = (pw.n // bn, triton.cdiv(m, bm))
    mmq6_q6k_kernel[grid](x, t["qw"].view(torch.uint8), t["qh"].view(torch.uint8), t["sc"], t["d"], out, m,
                          pw.n, pw.k, BM=bm, BN=bn, num_warps=warps, num_stages=stages)


# Q6_K: code bytes $2 (low nibbles: codes 2b; high: 2b + 1), their high-bit bytes $3 (two
# crumbs a nibble: bits 0-1 for code 2b, 2-3 for 2b + 1) whose nibble is the high one where
# mask byte $4 is 0x0F (the low one where it is 0), four at a time -> four float16 (code - 32)
_Q6_SEL = ("shr.b32 t, $3, 4; lop3.b32 s, t, $3, $4, 0xE4;")  # s = (t & m) | ($3 & ~m)
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
def _codes6(b, hb, m, HIGH: tl.constexpr, ASM: tl.constexpr):
    """Q6_K's codes less 32 as float16 (exact) from the low-nibble bytes b, the high-bit bytes
    hb and the nibble select m (0x0F: hb's high nibble; 0: its low one)."""
    if ASM:
        if HIGH:
            q = tl.inline_asm_elementwise(_Q6HI, "=r,=r,r,r,r", [b, hb, m], dtype=tl.float16, is_pure=True,
                                          pack=4)
        else:
            q = tl.inline_asm_elementwise(_Q6LO, "=r,=r,r,r,r", [b, hb, m], dtype=tl.float16, is_pure=True,
                                          pack=4)
    else:
        sel = tl.where(m != 0, hb >> 4, hb & 0xF)
        if HIGH:
            c = (b >> 4) | (((sel >> 2) & 3) << 4)
        else:
            c = (b & 0xF) | ((sel & 3) << 4)
        q = (c.to(tl.int32) - 32).to(tl.float16)
    return q


@triton.jit
def mmq7_q6k_kernel(p_x, p_qb, p_hb, p_sc, p_d, p_y, M, N, K, BM: tl.constexpr, BN: tl.constexpr,
                    HALF: tl.constexpr, ASM: tl.constexpr):
    """mmq6 with the codes made by ``_codes6`` (inline PTX, four codes at a time)."""
    i_n = tl.program_id(0)
    i_m = tl.program_id(1)
    o_n = i_n * BN + tl.arange(0, BN)
    o_m = i_m * BM + tl.arange(0, BM)
    m_m = o_m < M
    o_i = tl.arange(0, 16)
    o_n64 = o_n.to(tl.int64)
    p_q = p_qb + o_n64[:, None] * (K // 2) + o_i[None, :]
    p_h = p_hb + o_n64[:, None] * (K // 4) + (2 * (o_i // 4) + o_i % 2)[None, :]
    first = (o_i % 4 < 2)[None, :]
    sel = tl.where(first, 0x0F, 0).to(tl.uint8) + tl.zeros([BN, 16], tl.uint8)
    acc = tl.zeros([BM, BN], tl.float32)
    for blk in range(0, K // 256):
        d = tl.load(p_d + o_n64 * (K // 256) + blk).to(tl.float32)
        for j in tl.static_range(8):
            u = blk * 8 + j
            b = tl.load(p_q + u * 16)
            hb = tl.load(p_h + u * 8)
            s_a = tl.load(p_sc + o_n64 * (K // 16) + 2 * u).to(tl.float32) * d
            s_b = tl.load(p_sc + o_n64 * (K // 16) + 2 * u + 1).to(tl.float32) * d
            for h in tl.static_range(2):
                q = _codes6(b, hb, sel, h == 1, ASM)
                if HALF:
                    w = q * tl.where(first, s_a.to(tl.float16)[:, None], s_b.to(tl.float16)[:, None])
                else:
                    w = (q.to(tl.float32) * tl.where(first, s_a[:, None], s_b[:, None])).to(tl.float16)
                o_c = 8 * (o_i % 4) + o_i // 4 + 4 * h
                x = tl.load(p_x + o_m[:, None] * K + u * 32 + o_c[None, :], mask=m_m[:, None], other=0.0)
                acc = tl.dot(x, tl.trans(w), acc)
    p_o = p_y + o_m[:, None] * N + o_n[None, :]
    tl.store(p_o, acc, mask=m_m[:, None])


def mmq7_q6k(pw, x, out: torch.Tensor, bm: int, bn: int, warps: int, stages: int, half: bool) -> None:
    m = x.shape[0]
    t = pw.tensors
    grid = (pw.n // bn, triton.cdiv(m, bm))
    mmq7_q6k_kernel[grid](x, t["qw"].view(torch.uint8), t["qh"].view(torch.uint8), t["sc"], t["d"], out, m,
                          pw.n, pw.k, BM=bm, BN=bn, HALF=half, ASM=DEV == "cuda", num_warps=warps,
                          num_stages=stages)


def quantize_x8(x: torch.Tensor, planes: int):
    """x [M, K] float -> (q1 int8, q2 int8 or None, xd [M, K/32] float32 (a plane's unit:
    amax / 127, divided by 254 for two planes), xs [M, K/32] float32 sums)."""
    m, k = x.shape
    g = x.float().view(m, k // 32, 32)
    amax = g.abs().amax(dim=2, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    v = g * inv
    q1 = torch.round(v)
    xs = g.sum(dim=2)
    if planes == 1:
        return q1.to(torch.int8).view(m, k), None, (amax / 127.0).view(m, -1), xs
    q2 = torch.round((v - q1) * PLANE)
    return (q1.to(torch.int8).view(m, k), q2.to(torch.int8).view(m, k),
            (amax / (127.0 * PLANE)).view(m, -1), xs)


def mmq_q4k(w: torch.Tensor, n: int, k: int, qx, out: torch.Tensor, bm: int, bn: int,
            warps: int, stages: int) -> None:
    q1, q2, xd, xs = qx
    m = q1.shape[0]
    grid = (n // bn, triton.cdiv(m, bm))
    mmq_q4k_kernel[grid](q1, q1 if q2 is None else q2, xd, xs, w, out, m, n, k, k // 256 * 144,
                         BM=bm, BN=bn, PLANES=1 if q2 is None else 2, num_warps=warps,
                         num_stages=stages)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="*", default=["28672x4096", "196608x2048", "262144x768"])
    ap.add_argument("--rows", default="16,32,64")
    ap.add_argument("--v1", action="store_true", help="also the kernel on GGUF's own blocks")
    ap.add_argument("--q6k", action="store_true", help="also Q6_K (mmq6) against gemm_q")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    fmt = get_format(GGMLType.Q4_K)
    for shape in a.shapes:
        n, k = (int(v) for v in shape.split("x"))
        rows = min(1024, n)
        blocks = fmt.random_blocks(rows * k // 256, rng)
        wf = torch.from_numpy(fmt.decode_blocks(blocks).reshape(rows, k))
        raw = torch.from_numpy(blocks.reshape(rows, -1).copy())
        w = raw.repeat(n // rows, 1).contiguous().to(DEV)
        rp = tuple(v.repeat(n // rows, 1).contiguous().to(DEV) for v in repack2(raw, rows, k))
        wf = wf.repeat(n // rows, 1).to(DEV)
        nbytes = w.numel()
        print(f"Q4_K {n}x{k}: {nbytes / 1e6:.1f} MB; roof {nbytes / 4.3e6:.1f} us at 4.3 TB/s")
        for m in (int(v) for v in a.rows.split(",")):
            x = torch.randn(m, k, device=DEV).half()
            ref = x.float() @ wf.T
            out = torch.zeros(m, n, device=DEV)

            def check(label, fn):
                try:
                    out.zero_()
                    fn()
                    err = ((out - ref).norm() / ref.norm()).item()
                    if DEV == "cpu":
                        print(f"  M={m:2d} {label:30s} err {err:.1e}")
                        return
                    us = triton.testing.do_bench(fn, warmup=20, rep=100) * 1e3
                    print(f"  M={m:2d} {label:30s} {us:8.1f} us {nbytes / us / 1e3:7.0f} GB/s  err {err:.1e}")
                except Exception as e:  # noqa: BLE001
                    print(f"  M={m:2d} {label:30s} FAILED {type(e).__name__}: {str(e)[:200]}")

            for planes in (1, 2):
                qx = quantize_x8(x, planes)
                tiles = ((16, 64, 4, 3), (32, 64, 4, 3), (64, 64, 4, 3))
                if DEV == "cpu":
                    tiles = ((16, 32, 4, 1),)
                for bm, bn, warps, st in tiles:
                    if bm > max(16, m) or n % bn:
                        continue
                    if a.v1:
                        check(f"mmq p{planes} m{bm} n{bn} w{warps} s{st}",
                              lambda: mmq_q4k(w, n, k, qx, out, bm, bn, warps, st))
                    check(f"mmq2 p{planes} m{bm} n{bn} w{warps} s{st}",
                          lambda: mmq2_q4k(rp, n, k, qx, out, bm, bn, warps, st))
            tiles = ((16, 64, 4, 3), (16, 128, 4, 3), (16, 64, 2, 4), (32, 64, 4, 3), (64, 64, 4, 3),
                     (64, 128, 8, 3))
            for bm, bn, warps, st in tiles if DEV != "cpu" else ((16, 32, 4, 1),):
                if bm <= max(16, m) and n % bn == 0:
                    check(f"mmq3 f16 m{bm} n{bn} w{warps} s{st}",
                          lambda: mmq3_q4k(rp, n, k, x, out, bm, bn, warps, st))
            from deimos.quant.triton.layout import PackedWeight, pack
            small = pack(blocks.reshape(rows, -1), GGMLType.Q4_K)
            t = {name: v.repeat(n // rows, 1).contiguous().to(DEV) for name, v in small.tensors.items()}
            pw = PackedWeight(GGMLType.Q4_K, n, k, t)
            x4 = x[:, mmq4_columns(k).to(DEV)].contiguous()
            for bm, bn, warps, st in tiles if DEV != "cpu" else ((16, 32, 4, 1),):
                if bm <= max(16, m) and n % bn == 0:
                    for half in (False, True):
                        check(f"mmq4 half={int(half)} m{bm} n{bn} w{warps} s{st}",
                              lambda: mmq4_q4k(pw, x4, out, bm, bn, warps, st, half))
                    check(f"mmq4 x gathered m{bm} n{bn} w{warps} s{st}",
                          lambda: mmq4_q4k(pw, x, out, bm, bn, warps, st, False, True))
            if a.q6k:
                b6 = get_format(GGMLType.Q6_K).random_blocks(rows * k // 256, rng)
                w6f = torch.from_numpy(get_format(GGMLType.Q6_K).decode_blocks(b6).reshape(rows, k))
                w6f = w6f.repeat(n // rows, 1).to(DEV)
                p6 = pack(b6.reshape(rows, -1), GGMLType.Q6_K)
                t6 = {name: v.repeat(n // rows, 1).contiguous().to(DEV) for name, v in p6.tensors.items()}
                pw6 = PackedWeight(GGMLType.Q6_K, n, k, t6)
                ref6 = x.float() @ w6f.T

                def check6(label, fn):
                    out.zero_()
                    fn()
                    err = ((out - ref6).norm() / ref6.norm()).item()
                    if DEV == "cpu":
                        print(f"  M={m:2d} {label:30s} err {err:.1e}")
                        return
                    us = triton.testing.do_bench(fn, warmup=20, rep=100) * 1e3
                    print(f"  M={m:2d} {label:30s} {us:8.1f} us {pw6.nbytes / us / 1e3:7.0f} GB/s  err {err:.1e}")

                for bm, bn, warps, st in tiles if DEV != "cpu" else ((16, 32, 4, 1),):
                    if bm <= max(16, m) and n % bn == 0:
                        check6(f"Q6_K mmq6 m{bm} n{bn} w{warps} s{st}",
                               lambda: mmq6_q6k(pw6, x, out, bm, bn, warps, st))
                        for half in (False, True):
                            check6(f"Q6_K mmq7 half={int(half)} m{bm} n{bn} w{warps} s{st}",
                                   lambda: mmq7_q6k(pw6, x, out, bm, bn, warps, st, half))
                if DEV != "cpu":
                    from deimos.models.gpu.dequant import permuted_columns
                    from deimos.quant.triton.gemm_q import gemm_q
                    x6 = x[:, permuted_columns(pw6)].contiguous()
                    check6("Q6_K gemm_q rule", lambda: gemm_q(pw6, x6, out=out))
            if DEV != "cpu":
                from deimos.models.gpu.dequant import permuted_columns
                from deimos.quant.triton.gemm_q import gemm_q
                xp = x[:, permuted_columns(pw)].contiguous()
                check("gemm_q rule (float16 decode)", lambda: gemm_q(pw, xp, out=out))
                wh = wf.half()
                check("torch fp16 matmul (a copy)", lambda: out.copy_(x @ wh.T))


if __name__ == "__main__":
    main()
