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
from deimos.quant.kquants import _scale_min_k4
from deimos.quant.triton.dequant_gemv import scale16
from deimos.quant.triton.layout import PackedWeight, pack
from deimos.quant.triton.mmq import (
    ELEMENTS,
    HALVES,
    WORDS,
    halves_columns,
    q4k_product,
    q5k_product,
    q6k_product,
    q8_product,
)

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
def _tile(M, BM: tl.constexpr, BN: tl.constexpr):
    """The program's weight rows, x rows and x rows' mask."""
    o_n = tl.program_id(0) * BN + tl.arange(0, BN)
    o_m = tl.program_id(1) * BM + tl.arange(0, BM)
    return o_n, o_m, o_m < M


@triton.jit
def _int8_group(acc, p_xq, p_xq2, p_xd, p_xs, q, sc, mn, o_m, m_m, o_b, K, g, PLANES: tl.constexpr):
    """acc + group g's product: int8 x (one or two planes) times the codes q (int8 [BN, 32]) on
    the integer tensor cores, scaled into float32 by x's scale and the group's d sc, less x's
    group sum times dmin m."""
    G = K // 32
    p_x = o_m[:, None] * K + g * 32 + o_b[None, :]
    xq = tl.load(p_xq + p_x, mask=m_m[:, None], other=0)
    dot = tl.dot(xq, tl.trans(q), out_dtype=tl.int32)
    if PLANES == 2:
        xq2 = tl.load(p_xq2 + p_x, mask=m_m[:, None], other=0)
        dot = dot * 254 + tl.dot(xq2, tl.trans(q), out_dtype=tl.int32)
    xd = tl.load(p_xd + o_m * G + g, mask=m_m, other=0.0)
    xs = tl.load(p_xs + o_m * G + g, mask=m_m, other=0.0)
    acc += (dot.to(tl.float32) * xd[:, None]) * sc[None, :]
    acc -= xs[:, None] * mn[None, :]
    return acc


@triton.jit
def mmq_q4k_kernel(p_xq, p_xq2, p_xd, p_xs, p_w, p_y, M, N, K, ROW_BYTES,
                   BM: tl.constexpr, BN: tl.constexpr, PLANES: tl.constexpr):
    """y [M, N] = x [M, K] W^T, W GGUF Q4_K blocks ``[N, K / 256 * 144]`` bytes; x as int8
    ``p_xq`` (and the residual plane ``p_xq2``), ``p_xd`` / ``p_xs`` [M, K / 32] float32."""
    o_n, o_m, m_m = _tile(M, BM, BN)
    o_b = tl.arange(0, 32)
    p_row = p_w + o_n.to(tl.int64) * ROW_BYTES  # [BN] each row's first block
    p_h = p_w.to(tl.pointer_type(tl.float16))
    acc = tl.zeros([BM, BN], tl.float32)
    for sb in range(K // 256):
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
                sc, mn = _scale_min(p_blk + 4, 2 * p + h)
                acc = _int8_group(acc, p_xq, p_xq2, p_xd, p_xs, q, d * sc, dmin * mn, o_m, m_m, o_b, K, g,
                                  PLANES)
    p_o = p_y + o_m[:, None] * N + o_n[None, :]
    tl.store(p_o, acc, mask=m_m[:, None])


@triton.jit
def mmq2_q4k_kernel(p_xq, p_xq2, p_xd, p_xs, p_qs, p_sm, p_dd, p_y, M, N, K,
                    BM: tl.constexpr, BN: tl.constexpr, PLANES: tl.constexpr, ASM: tl.constexpr):
    """mmq_q4k_kernel on Q4_K repacked for this kernel: the codes ``p_qs`` [N, K / 2] (GGUF's
    32-byte runs in order), each group's 6-bit scale and min as a uint16 ``p_sm`` [N, K / 32]
    (scale | min << 8), each super-block's d and dmin as one int32 ``p_dd`` [N, K / 256] (two
    float16): 20 bytes of scales a super-block instead of 16, no bit unpacking in the loop."""
    o_n, o_m, m_m = _tile(M, BM, BN)
    o_b = tl.arange(0, 32)
    G = K // 32
    o_n64 = o_n.to(tl.int64)
    p_q = p_qs + o_n64[:, None] * (K // 2) + o_b[None, :]
    acc = tl.zeros([BM, BN], tl.float32)
    for sb in range(K // 256):
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
                sm = tl.load(p_sm + o_n64 * G + g).to(tl.int32)
                acc = _int8_group(acc, p_xq, p_xq2, p_xd, p_xs, q, (sm & 0xFF).to(tl.float32) * d,
                                  (sm >> 8).to(tl.float32) * dmin, o_m, m_m, o_b, K, g, PLANES)
    p_o = p_y + o_m[:, None] * N + o_n[None, :]
    tl.store(p_o, acc, mask=m_m[:, None])


def repack2(raw: torch.Tensor, n: int, k: int):
    """GGUF Q4_K rows ``[n, k / 256 * 144]`` -> (qs, sm, dd) of mmq2_q4k_kernel (numpy, once)."""
    b = raw.view(n, k // 256, 144).numpy()
    qs = np.ascontiguousarray(b[:, :, 16:]).reshape(n, k // 2)
    s_, m_ = _scale_min_k4(b[:, :, 4:16].reshape(-1, 12))
    sm = (s_.astype(np.uint16) | (m_.astype(np.uint16) << 8)).reshape(n, k // 32)
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
def engine_kernel(p_x, p_qw, p_qh, p_s, p_d, p_y, M, N, K, r_qw, r_qh, r_s, r_d, BM: tl.constexpr,
                  BN: tl.constexpr, Q6: tl.constexpr, X_ORDER: tl.constexpr, HALF: tl.constexpr,
                  ASM: tl.constexpr, SWAP: tl.constexpr = False, JOIN: tl.constexpr = False,
                  Q5: tl.constexpr = False, Q8: tl.constexpr = False, SCALE16: tl.constexpr = False):
    """y = x W^T by the engine's ``mmq.q4k_product`` / ``q5k_product`` / ``q6k_product``
    (moe_gemm's loop), one program a [BM, BN] tile."""
    o_n, o_m, m_m = _tile(M, BM, BN)
    acc = tl.zeros([BM, BN], tl.float32)
    p_xr = p_x + o_m[:, None] * K
    if Q8:
        acc = q8_product(acc, p_qw, p_d, r_qw, r_d, o_n.to(tl.int64), p_xr, m_m, 0, K // 256, X_ORDER, HALF, ASM,
                         SCALE16)
    elif Q5:
        acc = q5k_product(acc, p_qw, p_qh, p_s, r_qw, r_qh, r_s, o_n.to(tl.int64), p_xr, m_m, 0, K // 256,
                          X_ORDER, HALF, ASM)
    elif Q6:
        acc = q6k_product(acc, p_qw, p_qh, p_s, p_d, r_qw, r_qh, r_s, r_d, o_n.to(tl.int64), p_xr, m_m, 0,
                          K // 256, X_ORDER, HALF, ASM)
    elif SWAP:  # the weights the dot's first operand: acc [BN, BM]
        acc_t = q4k_product(tl.zeros([BN, BM], tl.float32), p_qw, p_s, r_qw, r_s, o_n.to(tl.int64), p_xr,
                            m_m, 0, K // 256, X_ORDER, HALF, ASM, True, JOIN)
        acc = tl.trans(acc_t)
    else:
        acc = q4k_product(acc, p_qw, p_s, r_qw, r_s, o_n.to(tl.int64), p_xr, m_m, 0, K // 256, X_ORDER,
                          HALF, ASM, False, JOIN)
    tl.store(p_y + o_m[:, None] * N + o_n[None, :], acc, mask=m_m[:, None])


def engine_mmq(pw, x, out: torch.Tensor, bm: int, bn: int, warps: int, stages: int, half: bool,
               x_order: int, swap: bool = False, join: bool = False) -> None:
    """``engine_kernel`` on a PackedWeight (Q4_K, Q5_K or Q6_K), x in ``x_order``."""
    t = pw.tensors
    q6 = pw.ggml_type == GGMLType.Q6_K
    q5 = pw.ggml_type == GGMLType.Q5_K
    q8 = pw.ggml_type == GGMLType.Q8_0  # Q8_0's layout: Q8_0, IQ4_XS, ...
    qw, qh = t["qw"], t.get("qh", t["qw"])
    sc, d = (t["sc"], t["d"]) if q6 else (t["d"], t["d"]) if q8 else (t["meta"], t["meta"])
    grid = (pw.n // bn, triton.cdiv(x.shape[0], bm))
    engine_kernel[grid](x, qw, qh, sc, d, out, x.shape[0], pw.n, pw.k, qw.stride(0), qh.stride(0), sc.stride(0),
                        d.stride(0), BM=bm, BN=bn, Q6=q6, X_ORDER=x_order, HALF=half, ASM=DEV == "cuda", SWAP=swap,
                        JOIN=join, Q5=q5, Q8=q8, SCALE16=scale16(pw), num_warps=warps, num_stages=stages)


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


def _packed(t: GGMLType, rows: int, n: int, k: int, rng):
    """A random [n, k] matrix of format t (``rows`` distinct rows repeated): raw blocks, its
    PackedWeight on DEV and its float32 values on DEV."""
    fmt = get_format(t)
    blocks = fmt.random_blocks(rows * k // fmt.block_size, rng).reshape(rows, -1)
    small = pack(blocks, t)
    pw = PackedWeight(small.ggml_type, n, k, {name: v.repeat(n // rows, 1).contiguous().to(DEV)
                                              for name, v in small.tensors.items()})
    wf = torch.from_numpy(fmt.decode_blocks(blocks.reshape(-1, fmt.type_size)).reshape(rows, k))
    return blocks, pw, wf.repeat(n // rows, 1).to(DEV)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="*", default=["28672x4096", "196608x2048", "262144x768"])
    ap.add_argument("--rows", default="16,32,64")
    ap.add_argument("--v1", action="store_true", help="also the integer kernel on GGUF's own blocks")
    ap.add_argument("--q6k", action="store_true", help="also Q6_K against gemm_q")
    ap.add_argument("--q5k", action="store_true", help="also Q5_K against gemm_q")
    ap.add_argument("--q8", action="store_true", help="also Q8_0 and IQ4_XS (Q8_0's layout) against gemm_q")
    ap.add_argument("--only", default="", help="only the variants whose label holds one of these "
                    "comma-separated words (e.g. swap,gemm_q)")
    ap.add_argument("--tiles", default="", help="the tiles tried, as 'x rows,weight rows,warps,stages' "
                    "separated by ';' (e.g. '16,128,4,3;16,256,8,3'; default: eight on a GPU)")
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    gpu = DEV != "cpu"
    tiles = ((16, 64, 4, 3), (16, 128, 4, 3), (16, 64, 2, 4), (32, 64, 4, 3), (32, 128, 4, 3),
             (64, 64, 4, 3), (64, 128, 4, 3), (64, 128, 8, 3)) if gpu else ((16, 32, 4, 1),)
    if a.tiles:
        tiles = tuple(tuple(int(v) for v in t.split(",")) for t in a.tiles.split(";"))
        if any(len(t) != 4 for t in tiles):
            ap.error(f"--tiles: four numbers a tile, got {a.tiles!r}")
    for shape in a.shapes:
        n, k = (int(v) for v in shape.split("x"))
        rows = min(1024, n)
        types = ([GGMLType.Q4_K] + [GGMLType.Q5_K] * a.q5k + [GGMLType.Q6_K] * a.q6k
                 + [GGMLType.Q8_0, GGMLType.IQ4_XS] * a.q8)
        mats = {t: _packed(t, rows, n, k, rng) for t in types}
        blocks = mats[GGMLType.Q4_K][0]
        raw = torch.from_numpy(blocks.copy())
        w = raw.repeat(n // rows, 1).contiguous().to(DEV)
        rp = tuple(v.repeat(n // rows, 1).contiguous().to(DEV) for v in repack2(raw, rows, k))
        print(f"{n}x{k}: Q4_K {w.numel() / 1e6:.1f} MB (roof {w.numel() / 4.3e6:.1f} us at 4.3 TB/s)")
        for m in (int(v) for v in a.rows.split(",")):
            x = torch.randn(m, k, device=DEV).half()
            out = torch.zeros(m, n, device=DEV)
            for t, (_, pw, wf) in mats.items():
                ref = x.float() @ wf.T

                def check(label, fn):
                    if a.only and not any(w in label for w in a.only.split(",")):
                        return
                    try:
                        out.zero_()
                        fn()
                        err = ((out - ref).norm() / ref.norm()).item()
                        if not gpu:
                            print(f"  {t.name} M={m:2d} {label:32s} err {err:.1e}")
                            return
                        us = triton.testing.do_bench(fn, warmup=20, rep=100) * 1e3
                        print(f"  {t.name} M={m:2d} {label:32s} {us:8.1f} us {pw.nbytes / us / 1e3:7.0f} GB/s"
                              f"  err {err:.1e}")
                    except Exception as e:  # noqa: BLE001
                        print(f"  {t.name} M={m:2d} {label:32s} FAILED {type(e).__name__}: {str(e)[:200]}")

                if t == GGMLType.Q4_K:
                    for planes in (1, 2):
                        qx = quantize_x8(x, planes)
                        for bm, bn, warps, st in tiles[::2] if gpu else tiles:
                            if bm > max(16, m):
                                continue
                            if a.v1:
                                check(f"int8 gguf p{planes} m{bm} n{bn} w{warps} s{st}",
                                      lambda: mmq_q4k(w, n, k, qx, out, bm, bn, warps, st))
                            check(f"int8 mmq2 p{planes} m{bm} n{bn} w{warps} s{st}",
                                  lambda: mmq2_q4k(rp, n, k, qx, out, bm, bn, warps, st))
                xh = x[:, halves_columns(k).to(DEV)].contiguous()
                for bm, bn, warps, st in tiles:
                    if bm > max(16, m):
                        continue
                    for half in (False, True) if pw.ggml_type != GGMLType.Q8_0 else ():  # no halves there
                        check(f"mmq halves half={int(half)} m{bm} n{bn} w{warps} s{st}",
                              lambda: engine_mmq(pw, xh, out, bm, bn, warps, st, half, HALVES))
                    check(f"mmq elements m{bm} n{bn} w{warps} s{st}",
                          lambda: engine_mmq(pw, x, out, bm, bn, warps, st, False, ELEMENTS))
                    if t == GGMLType.Q4_K:
                        for swap, join in ((True, False), (False, True), (True, True)):
                            check(f"mmq elements{' swap' * swap}{' join' * join} m{bm} n{bn} w{warps} s{st}",
                                  lambda: engine_mmq(pw, x, out, bm, bn, warps, st, False, ELEMENTS, swap, join))
                if gpu:
                    from deimos.models.gpu.dequant import permuted_columns
                    from deimos.quant.triton.gemm_q import gemm_q
                    xp = x[:, permuted_columns(pw)].contiguous()
                    for bm, bn, warps, st in tiles[:1]:
                        check(f"mmq words m{bm} n{bn} w{warps} s{st}",
                              lambda: engine_mmq(pw, xp, out, bm, bn, warps, st, False, WORDS))
                    check("gemm_q rule (float16 decode)", lambda: gemm_q(pw, xp, out=out))
                    wh = wf.half()
                    check("torch fp16 matmul (a copy)", lambda: out.copy_(x @ wh.T))


if __name__ == "__main__":
    main()
