"""Experiment (sessions 27-28): Q4_K batched-decode GEMM variants on one llama 8B shape,
against gemm_q and the fp16 copies' matmul (torch). A measurement, not part of the engine.
V0 gemm_q as it is; V1 weight tile [BK, BN] by replicated word loads (each word read for its 8
codes) from the packed row-major words, per-element fp16 scales from precomputed arrays (a
bound: extra bytes); V2 V1 with the scales decoded per group and broadcast; V3 one dot per
group of 32 on the raw codes, scale and min applied to the group's partial product; V4
GemLite's layout (words [K/8, N] and fp16 scales [K/32, N], N contiguous: coalesced replicated
loads); V5 the row-major words as a [BN, BK] tile, the product transposed (acc^T += W x^T).

    python bench/exp_gemm_q4k.py [NxK] [--only45]   # --only45: V4, V5 and torch only
"""
import sys
import torch, triton, triton.language as tl
import numpy as np
from deimos.gguf.constants import GGMLType
from deimos.quant import get_format
from deimos.quant.triton.layout import pack, PackedWeight
from deimos.quant.triton.gemm_q import gemm_q
from deimos.quant.triton.dequant_gemv import _k4_scales
from deimos.models.gpu.dequant import dequantize_fp16, permuted_columns
from deimos.quant.triton.naive import _k4_scales as k4_ref


@triton.jit
def _magic(q):
    return (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def v1_kernel(p_x, p_qw, p_s16, p_m16, p_y, M, N, K, S_SPLIT,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    i_n = tl.program_id(0); i_k = tl.program_id(1)
    o_n = i_n * BN + tl.arange(0, BN)
    o_m = tl.arange(0, BM); m_m = o_m < M
    o_c = tl.arange(0, BK)
    WT = K // 8
    G = K // 32
    shift = (o_c % 8) * 4
    p_w = p_qw + o_n[None, :].to(tl.int64) * WT + (o_c // 8)[:, None]
    p_sc = p_s16 + o_n[None, :].to(tl.int64) * G + (o_c // 32)[:, None]
    p_mn = p_m16 + o_n[None, :].to(tl.int64) * G + (o_c // 32)[:, None]
    p_xt = p_x + o_m[:, None] * K + o_c[None, :]
    acc = tl.zeros([BM, BN], tl.float32)
    c_lo = i_k * S_SPLIT * 32
    c_hi = tl.minimum(c_lo + S_SPLIT * 32, K)
    for c0 in range(c_lo, c_hi, BK):
        x = tl.load(p_xt + c0, mask=m_m[:, None], other=0.0)
        b = tl.load(p_w + c0 // 8)
        s = tl.load(p_sc + c0 // 32)
        mn = tl.load(p_mn + c0 // 32)
        w = tl.fma(_magic((b >> shift[:, None]) & 0xF), s, mn)
        acc = tl.dot(x, w, acc)
    p_o = p_y + o_m[:, None] * N + o_n[None, :]
    tl.atomic_add(p_o, acc, mask=m_m[:, None], sem="relaxed")


@triton.jit
def v2_kernel(p_x, p_qw, p_meta, p_y, M, N, K, S_SPLIT,
              BM: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr):
    """V1 with the scales decoded from the meta words per group ([BN, BS]) and broadcast to
    the tile's columns (reshape of a broadcast)."""
    BK: tl.constexpr = BS * 32
    i_n = tl.program_id(0); i_k = tl.program_id(1)
    o_n = i_n * BN + tl.arange(0, BN)
    o_m = tl.arange(0, BM); m_m = o_m < M
    o_c = tl.arange(0, BK)
    o_g = tl.arange(0, BS)
    WT = K // 8
    S_TOTAL = K // 32
    shift = (o_c % 8) * 4
    p_w = p_qw + o_n[None, :].to(tl.int64) * WT + (o_c // 8)[:, None]
    p_xt = p_x + o_m[:, None] * K + o_c[None, :]
    acc = tl.zeros([BM, BN], tl.float32)
    g_lo = i_k * S_SPLIT
    g_hi = tl.minimum(g_lo + S_SPLIT, S_TOTAL)
    for g0 in range(g_lo, g_hi, BS):
        x = tl.load(p_xt + g0 * 32, mask=m_m[:, None], other=0.0)
        b = tl.load(p_w + g0 * 4)
        sc, mn = _k4_scales(p_meta, o_n.to(tl.int64), g0 + o_g, None, S_TOTAL, False)  # [BN, BS]
        s = tl.reshape(tl.broadcast_to(tl.trans(sc.to(tl.float16))[:, None, :], (BS, 32, BN)), (BK, BN))
        m = tl.reshape(tl.broadcast_to(tl.trans((-mn).to(tl.float16))[:, None, :], (BS, 32, BN)), (BK, BN))
        w = tl.fma(_magic((b >> shift[:, None]) & 0xF), s, m)
        acc = tl.dot(x, w, acc)
    p_o = p_y + o_m[:, None] * N + o_n[None, :]
    tl.atomic_add(p_o, acc, mask=m_m[:, None], sem="relaxed")


@triton.jit
def v3_kernel(p_x, p_qw, p_meta, p_y, M, N, K, S_SPLIT,
              BM: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr):
    """Steps of BS groups; one dot of K = 32 per group on the codes (fp16 exact), then
    acc += part * scale + sum(x of the group) * min."""
    i_n = tl.program_id(0); i_k = tl.program_id(1)
    o_n = i_n * BN + tl.arange(0, BN)
    o_m = tl.arange(0, BM); m_m = o_m < M
    o_c = tl.arange(0, 32)
    WT = K // 8
    S_TOTAL = K // 32
    shift = (o_c % 8) * 4
    p_w = p_qw + o_n[None, :].to(tl.int64) * WT + (o_c // 8)[:, None]
    p_xt = p_x + o_m[:, None] * K + o_c[None, :]
    acc = tl.zeros([BM, BN], tl.float32)
    g_lo = i_k * S_SPLIT
    g_hi = tl.minimum(g_lo + S_SPLIT, S_TOTAL)
    o_g = tl.arange(0, BS)
    for g0 in range(g_lo, g_hi, BS):
        sc, mn = _k4_scales(p_meta, o_n.to(tl.int64), g0 + o_g, None, S_TOTAL, False)  # [BN, BS]
        for g in tl.static_range(BS):
            x = tl.load(p_xt + (g0 + g) * 32, mask=m_m[:, None], other=0.0)
            b = tl.load(p_w + (g0 + g) * 4)
            q = _magic((b >> shift[:, None]) & 0xF)
            part = tl.dot(x, q)
            sel = (o_g == g)[None, :]
            s_g = tl.sum(tl.where(sel, sc, 0.0), axis=1)
            m_g = tl.sum(tl.where(sel, mn, 0.0), axis=1)
            xs = tl.sum(x.to(tl.float32), axis=1)
            acc += part * s_g[None, :] - xs[:, None] * m_g[None, :]
    p_o = p_y + o_m[:, None] * N + o_n[None, :]
    tl.atomic_add(p_o, acc, mask=m_m[:, None], sem="relaxed")


@triton.jit
def v4_kernel(p_x, p_qwt, p_s16t, p_m16t, p_y, M, N, K, S_SPLIT,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """GemLite's layout: words [K/8, N] and fp16 scale/min [K/32, N], N contiguous; the
    [BK, BN] tile is read by replicated row indices (each word for its 8 codes), coalesced
    along N."""
    i_n = tl.program_id(0); i_k = tl.program_id(1)
    o_n = i_n * BN + tl.arange(0, BN)
    o_m = tl.arange(0, BM); m_m = o_m < M
    o_c = tl.arange(0, BK)
    shift = (o_c % 8) * 4
    p_w = p_qwt + (o_c // 8)[:, None].to(tl.int64) * N + o_n[None, :]
    p_sc = p_s16t + (o_c // 32)[:, None].to(tl.int64) * N + o_n[None, :]
    p_mn = p_m16t + (o_c // 32)[:, None].to(tl.int64) * N + o_n[None, :]
    p_xt = p_x + o_m[:, None] * K + o_c[None, :]
    acc = tl.zeros([BM, BN], tl.float32)
    c_lo = i_k * S_SPLIT * 32
    c_hi = tl.minimum(c_lo + S_SPLIT * 32, K)
    for c0 in range(c_lo, c_hi, BK):
        x = tl.load(p_xt + c0, mask=m_m[:, None], other=0.0)
        b = tl.load(p_w + (c0 // 8) * N)
        s = tl.load(p_sc + (c0 // 32) * N)
        mn = tl.load(p_mn + (c0 // 32) * N)
        w = tl.fma(_magic((b >> shift[:, None]) & 0xF), s, mn)
        acc = tl.dot(x, w, acc)
    p_o = p_y + o_m[:, None] * N + o_n[None, :]
    tl.atomic_add(p_o, acc, mask=m_m[:, None], sem="relaxed")


@triton.jit
def v5_kernel(p_x, p_qw, p_s16, p_m16, p_y, M, N, K, S_SPLIT,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Row-major storage as packed, tile [BN, BK] (K fast) by replicated word loads, the
    product transposed: acc^T += W x^T."""
    i_n = tl.program_id(0); i_k = tl.program_id(1)
    o_n = i_n * BN + tl.arange(0, BN)
    o_m = tl.arange(0, BM); m_m = o_m < M
    o_c = tl.arange(0, BK)
    WT = K // 8
    G = K // 32
    shift = (o_c % 8) * 4
    p_w = p_qw + o_n[:, None].to(tl.int64) * WT + (o_c // 8)[None, :]
    p_sc = p_s16 + o_n[:, None].to(tl.int64) * G + (o_c // 32)[None, :]
    p_mn = p_m16 + o_n[:, None].to(tl.int64) * G + (o_c // 32)[None, :]
    p_xt = p_x + o_m[None, :] * K + o_c[:, None]
    acc = tl.zeros([BN, BM], tl.float32)
    c_lo = i_k * S_SPLIT * 32
    c_hi = tl.minimum(c_lo + S_SPLIT * 32, K)
    for c0 in range(c_lo, c_hi, BK):
        x = tl.load(p_xt + c0, mask=m_m[None, :], other=0.0)
        b = tl.load(p_w + c0 // 8)
        s = tl.load(p_sc + c0 // 32)
        mn = tl.load(p_mn + c0 // 32)
        w = tl.fma(_magic((b >> shift[None, :]) & 0xF), s, mn)
        acc = tl.dot(w, x, acc)
    p_o = p_y + o_m[None, :] * N + o_n[:, None]
    tl.atomic_add(p_o, acc, mask=m_m[None, :], sem="relaxed")


import os
DEV = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


def main():
    n, k = (int(v) for v in (sys.argv[1] if len(sys.argv) > 1 and "x" in sys.argv[1] else "28672x4096").split("x"))
    rows = min(1024, n)
    rng = np.random.default_rng(0)
    fmt = get_format(GGMLType.Q4_K)
    blocks = fmt.random_blocks(rows * k // 256, rng).reshape(rows, -1)
    small = pack(blocks, GGMLType.Q4_K)
    t = {name: v.repeat(n // rows, 1).to(DEV) for name, v in small.tensors.items()}
    w = PackedWeight(GGMLType.Q4_K, n, k, t)
    d, dmin, sc, mn = k4_ref(small.tensors["meta"])
    s16 = (d.repeat_interleave(8, 1) * sc).half().repeat(n // rows, 1).to(DEV)
    m16 = (-(dmin.repeat_interleave(8, 1) * mn)).half().repeat(n // rows, 1).to(DEV)
    cols = permuted_columns(w)
    w16 = dequantize_fp16(w, permuted=True).float()
    nbytes = w.nbytes
    print(f"Q4_K {n}x{k}: {nbytes / 1e6:.1f} MB; roof {nbytes / 4.3e6:.1f} us")
    for m in (16, 64):
        x = torch.randn(m, k, device=DEV).half()
        xp = x[:, cols].contiguous()
        ref = xp.float() @ w16.T
        out = torch.zeros(m, n, device=DEV)

        def check(label, fn, bytes_=nbytes):
            try:
                out.zero_(); fn()
                err = ((out - ref).norm() / ref.norm()).item()
                if DEV == "cpu":
                    print(f"  M={m:2d} {label:34s} err {err:.1e}"); return
                us = triton.testing.do_bench(lambda: (out.zero_(), fn()), warmup=20, rep=100) * 1e3
                print(f"  M={m:2d} {label:34s} {us:8.1f} us {bytes_ / us / 1e3:7.0f} GB/s  err {err:.1e}")
            except Exception as e:  # noqa: BLE001
                print(f"  M={m:2d} {label:34s} FAILED {type(e).__name__}: {str(e)[:160]}")

        qwt = t["qw"].T.contiguous(); s16t = s16.T.contiguous(); m16t = m16.T.contiguous()
        for bn, bk, warps, st, split in ((64, 64, 4, 4, 4), (64, 128, 4, 3, 4), (128, 64, 4, 4, 4),
                                         (128, 128, 4, 3, 2), (128, 128, 8, 3, 4), (256, 64, 8, 4, 2),
                                         (32, 128, 4, 4, 8), (64, 256, 4, 2, 4), (256, 128, 8, 2, 1)):
            ss = k // 32 // split
            grid = (n // bn, split)
            check(f"V4 n{bn} k{bk} w{warps} s{st} sp{split}",
                  lambda: v4_kernel[grid](xp, qwt, s16t, m16t, out, m, n, k, ss, BM=max(16, m), BN=bn,
                                          BK=bk, num_warps=warps, num_stages=st),
                  nbytes + s16.numel() * 4)
        for bn, bk, warps, st, split in ((64, 128, 4, 3, 4), (128, 128, 4, 3, 4), (128, 64, 4, 4, 4),
                                         (64, 256, 4, 3, 4)):
            ss = k // 32 // split
            grid = (n // bn, split)
            check(f"V5 n{bn} k{bk} w{warps} s{st} sp{split}",
                  lambda: v5_kernel[grid](xp, t["qw"], s16, m16, out, m, n, k, ss, BM=max(16, m), BN=bn,
                                          BK=bk, num_warps=warps, num_stages=st),
                  nbytes + s16.numel() * 4)
        w16h = w16.half()
        check("torch fp16 matmul (the copies)", lambda: out.copy_(xp @ w16h.T), n * k * 2)
        if "--only45" in sys.argv: continue
        check("V0 gemm_q rule", lambda: gemm_q(w, xp, out=out))
        for bn, bk, warps, st, split in ((64, 128, 4, 3, 4), (64, 256, 4, 3, 4), (128, 128, 4, 3, 4),
                                         (128, 256, 8, 3, 2), (32, 256, 4, 4, 8), (64, 512, 8, 2, 4)):
            ss = k // 32 // split
            grid = (n // bn, split)
            check(f"V1 n{bn} k{bk} w{warps} s{st} sp{split}",
                  lambda: v1_kernel[grid](xp, t["qw"], s16, m16, out, m, n, k, ss, BM=max(16, m), BN=bn,
                                          BK=bk, num_warps=warps, num_stages=st),
                  nbytes + s16.numel() * 4)
        for bn, bs, warps, st, split in ((64, 4, 4, 3, 4), (128, 4, 4, 3, 4), (128, 8, 8, 3, 2), (64, 8, 8, 3, 4)):
            ss = k // 32 // split
            grid = (n // bn, split)
            check(f"V2 n{bn} g{bs} w{warps} s{st} sp{split}",
                  lambda: v2_kernel[grid](xp, t["qw"], t["meta"], out, m, n, k, ss, BM=max(16, m), BN=bn,
                                          BS=bs, num_warps=warps, num_stages=st))
        for bn, bs, warps, st, split in ((64, 4, 4, 3, 4), (128, 4, 4, 3, 4), (128, 8, 8, 3, 2), (64, 8, 4, 3, 4)):
            ss = k // 32 // split
            grid = (n // bn, split)
            check(f"V3 n{bn} g{bs} w{warps} s{st} sp{split}",
                  lambda: v3_kernel[grid](xp, t["qw"], t["meta"], out, m, n, k, ss, BM=max(16, m), BN=bn,
                                          BS=bs, num_warps=warps, num_stages=st))


if __name__ == "__main__":
    main()
