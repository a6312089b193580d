"""Fused dequant-GEMV for decode: y[b, n] = sum_k W[n, k] * x[b, k], W quantized (layout.py).

Design (why not int8 dot products): a decode GEMV must read each weight byte once at ~4.3 TB/s.
On an H200 (132 SMs, ~1.75 GHz) that is ~18.5 bytes per SM-clock, i.e. ~33 Q4_K weights per
SM-clock to decode. An SM issues 128 thread-instructions a clock (64 of them integer), so the
budget is ~4 instructions per weight. Each weight here costs: shift + and/or (make the float
2^23 + q from the code: no int->float conversion, which runs at only 16 a clock), one fadd to
remove 2^23 (and the format's offset), one FMA with x. Scales are applied once per 32-element
group (the per-group dot product is summed inside one thread, so there are no shuffles), and a
min term is min * sum(x over the group), with the group sums of x computed once per activation
(``prepare_x``) and shared by every projection that reads it. An int8 path (x quantized to q8,
integer dot products) needs dp4a or tensor-core MMA to be cheaper; Triton exposes neither for a
GEMV without inline asm (which the interpreter cannot run) or M >= 16 padding, so fp32 FMA it is.

Tile: ``[BLOCK_N rows, BLOCK_S groups, W words]``; W words = one group = one thread's 16-byte
(Q8_0: 2 x 16-byte) load, so a warp reads 32 consecutive groups of a row, 512 contiguous bytes;
the 4 warps of a program hold BLOCK_N rows (see ``launch_config``). Batched x ([B, K], B <= 8)
runs one program per column and row tile (row tiles on grid axis 0: only that axis holds a
262144-row vocabulary's 65536 tiles). Decode work is repeated per column,
so B = 4 costs ~3.5x B = 1 (measured): a stopgap, batched decode wants its own kernel.

Prediction vs measurement (H200, CUDA-graph replay, bench.py, 2026-11-29). Q4_K 4096x14336:
33.0 MB of weights -> 7.7 us at 4.3 TB/s. Measured 25.3 us (1.30 TB/s, 30%); Q6_K 35-39%,
Q8_0 58-59% (2.5 TB/s). So Q4_K is bound by instructions, not bytes: the per-group scale
decode (4 scalar loads, ~25 integer ops and a shared-memory layout conversion per 32 weights)
and one x load per code are the next things to cut.
"""

from __future__ import annotations

from typing import NamedTuple

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
         GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1]
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
MAX_BATCH = 8
NUM_WARPS = 4
# 2^23 as float: for 0 <= q < 2^23 the bits (q | 0x4B000000) are the float 2^23 + q exactly.
MAGIC_BITS = tl.constexpr(0x4B000000)
MAGIC = tl.constexpr(8388608.0)


@triton.jit
def _code_float(q, OFFSET: tl.constexpr):
    """int32 codes 0 <= q < 2^23 -> float32 q - OFFSET, exactly, without an int->float convert."""
    return (q | MAGIC_BITS).to(tl.float32, bitcast=True) - (MAGIC + OFFSET)


@triton.jit
def _codes(b_w, b_h, k, FMT: tl.constexpr):
    """Code number k of every word, as float32 with the format's zero point removed."""
    if FMT == Q8_0:
        # byte k, signed; ^ 0x80 maps -128..127 to 0..255
        return _code_float(((b_w >> (8 * k)) & 0xFF) ^ 0x80, 128.0)
    q = (b_w >> (4 * k)) & 0xF
    if FMT == Q6_K:  # code k = 2j + p at bits (4, 12, 0, 8)[j] + 2p (layout.Q6_HIGH_SHIFT)
        j = k // 2
        shift = 4 + 8 * (j % 2) - 4 * (j // 2) + 2 * (k % 2)
        return _code_float(q | (((b_h >> shift) & 3) << 4), 32.0)
    if FMT == Q5_K or FMT == Q5_1:
        return _code_float(q | (((b_h >> k) & 1) << 4), 0.0)
    if FMT == Q5_0:
        return _code_float(q | (((b_h >> k) & 1) << 4), 16.0)
    if FMT == Q4_0:
        return _code_float(q, 8.0)
    return _code_float(q, 0.0)  # Q4_K, Q4_1


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
    byte = wa >> ((j % 4) * 8)
    sc = byte & 63
    mn = ((byte >> 6) & 3) | (((w3 >> (4 * j)) & 0xF) << 2)
    d = _f16_bits(w0)
    dmin = _f16_bits(w0 >> 16)
    return d * sc.to(tl.float32), dmin * mn.to(tl.float32)


@triton.jit
def group_scales(p_s, p_d, p_m, o_n, u, m, S_TOTAL, FMT: tl.constexpr, MASKED: tl.constexpr = True):
    """Scales of groups ``u`` of rows ``o_n``, float32 [BLOCK_N, BLOCK_S] each:
    (scale of the group's first 16 elements, of its last 16, and the min term: what
    multiplies the group sum of x; for formats without a min its value is unused).
    ``MASKED=False``: every (row, group) exists, loads without a mask."""
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
def group_words(p_qw, p_qh, o_n, m_n, u, m_s, S_TOTAL, FMT: tl.constexpr, MASKED: tl.constexpr = True):
    """The packed words of groups ``u`` of rows ``o_n`` (int64), each ``[BLOCK_N, BLOCK_S, W]``
    (W = 8 words a group for Q8_0, 4 for the nibble formats; code k of word w of group u is
    element 32u + W k + w): (qw, the high bits' entries of the same words for the formats
    that have them (Q6_K, Q5_K, Q5_0, Q5_1; qw again for the others), the load mask)."""
    W: tl.constexpr = 8 if FMT == Q8_0 else 4
    o_w = tl.arange(0, W)
    m_w = (m_n[:, None] & m_s[None, :])[:, :, None] & (o_w < W)[None, None, :]
    o_q = o_n[:, None, None] * (S_TOTAL * W) + u[None, :, None] * W + o_w[None, None, :]
    b_w = masked_load(p_qw + o_q, m_w, MASKED)
    if FMT == Q6_K or FMT == Q5_K or FMT == Q5_0 or FMT == Q5_1:
        b_h = masked_load(p_qh + o_q, m_w, MASKED).to(tl.int32)
    else:
        b_h = b_w
    return b_w, b_h, m_w


@triton.jit
def _gemv_kernel(
    p_qw, p_qh, p_s, p_d, p_m,  # weight arrays (unused ones get any pointer)
    p_x, p_xs, p_y,  # x [B, K] f32, group sums of x [B, K/32] f32, y [B, N] f32
    N, K,
    FMT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    W: tl.constexpr = 8 if FMT == Q8_0 else 4  # int32 words per group of 32 elements
    NK: tl.constexpr = 32 // W  # codes per word
    HALF: tl.constexpr = NK // 2  # codes k < HALF are the group's first 16 elements
    HAS_MIN: tl.constexpr = FMT == Q4_K or FMT == Q5_K or FMT == Q4_1 or FMT == Q5_1
    i_n = tl.program_id(0)  # row tiles on axis 0: a 262144-row vocabulary is 65536 tiles,
    i_b = tl.program_id(1)  # past CUDA's 65535 limit of the other axes
    S_TOTAL = K // 32
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    o_n = o_n.to(tl.int64)
    o_s = tl.arange(0, BLOCK_S)
    o_w = tl.arange(0, W)
    p_x += i_b * K
    acc = tl.zeros([BLOCK_N, BLOCK_S], dtype=tl.float32)
    for s0 in range(0, S_TOTAL, BLOCK_S):
        u = s0 + o_s
        m_s = u < S_TOTAL
        m_ns = m_n[:, None] & m_s[None, :]
        b_w, b_h, m_w = group_words(p_qw, p_qh, o_n, m_n, u, m_s, S_TOTAL, FMT)
        # x pointers of the weights' full [BLOCK_N, BLOCK_S, W] shape (rows broadcast), so that
        # x gets the weights' register layout (no layout conversion through shared memory)
        o_x = (u[None, :, None] * 32 + o_w[None, None, :]) + (o_n * 0)[:, None, None]
        part_lo = tl.zeros([BLOCK_N, BLOCK_S, W], dtype=tl.float32)
        part_hi = tl.zeros([BLOCK_N, BLOCK_S, W], dtype=tl.float32)
        for k in tl.static_range(NK):
            q = _codes(b_w, b_h, k, FMT)
            b_x = tl.load(p_x + o_x + k * W, mask=m_w, other=0.0)
            if k < HALF:
                part_lo += b_x * q
            else:
                part_hi += b_x * q
        s_lo, s_hi, mn = group_scales(p_s, p_d, p_m, o_n, u, m_ns, S_TOTAL, FMT)
        acc += s_lo * tl.sum(part_lo, axis=2) + s_hi * tl.sum(part_hi, axis=2)
        if HAS_MIN:
            acc += mn * tl.load(p_xs + i_b * S_TOTAL + u, mask=m_s, other=0.0)[None, :]
    tl.store(p_y + i_b * N + o_n, tl.sum(acc, axis=1), mask=m_n)


class PreparedX(NamedTuple):
    """An activation made ready once for every projection that reads it.

    x: float32 ``[B, K]`` contiguous; xsum: float32 ``[B, K/32]``, the sums of x over each group
    of 32 (the min terms of Q4_K/Q5_K/Q4_1/Q5_1).
    """

    x: torch.Tensor
    xsum: torch.Tensor


def prepare_x(x: torch.Tensor) -> PreparedX:
    """x ``[K]`` or ``[B, K]`` (fp16/bf16/fp32), K a multiple of 32, B <= 8 -> ``PreparedX``."""
    x2 = activation_rows(x, "prepare_x")
    b, k = x2.shape
    xf = x2.to(torch.float32).contiguous()
    return PreparedX(xf, xf.view(b, k // 32, 32).sum(dim=2))


MAX_GRID_X = 2**31 - 1  # CUDA: grid axis 0; axes 1 and 2 stop at 65535


def gemv_grid(n: int, b: int, block_n: int) -> tuple[int, int]:
    """(row tiles, batch columns): the row tiles on axis 0, the only one that holds a large
    vocabulary's output matrix."""
    tiles = triton.cdiv(n, block_n)
    if tiles > MAX_GRID_X or b > 65535:
        raise ValueError(f"gemv: {n} rows x {b} columns do not fit a CUDA grid")
    return tiles, b


class LaunchConfig(NamedTuple):
    block_n: int
    block_s: int
    num_warps: int


def launch_config(ggml_type: GGMLType, n: int, k: int, b: int) -> LaunchConfig:
    """The shape rule, fixed on purpose: 4 rows x 32 groups (Q8_0: 16) per program and step,
    4 warps, so each thread holds one row's group (16 bytes, Q8_0 32) and a warp reads 512
    contiguous bytes of a row. Measured on the H200 (bench.py --sweep, CUDA-graph replay,
    2026-11-29): 4 rows / 4 warps was the fastest of rows {4, 8, 16, 32} x warps {2, 4, 8} on
    all of 4096x4096, 14336x4096, 4096x14336, 1024x4096 for Q4_K, Q6_K and Q8_0 (or within
    a few percent); more rows per thread cost more than the x loads they save.
    One config per format keeps the sm_90 compile check small; n, k, b do not change it yet
    (small N under-fills the GPU: split-K is future work)."""
    del n, k, b
    block_s = 16 if ggml_type == GGMLType.Q8_0 else 32
    return LaunchConfig(4, block_s, NUM_WARPS)


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


def _kernel_args(w: PackedWeight, xp: PreparedX, y: torch.Tensor) -> tuple:
    return (*weight_arrays(w), xp.x, xp.xsum, y)


def _launch(
    w: PackedWeight, xp: PreparedX, out: torch.Tensor | None, cfg: LaunchConfig | None = None
) -> torch.Tensor:
    b, k = xp.x.shape
    out = gemv_out(out, b, w.n, xp.x.device, "gemv")
    cfg = cfg or launch_config(w.ggml_type, w.n, k, b)
    _gemv_kernel[gemv_grid(w.n, b, cfg.block_n)](
        *_kernel_args(w, xp, out), w.n, k,
        FMT=FMT_ID[w.ggml_type], BLOCK_N=cfg.block_n, BLOCK_S=cfg.block_s,
        num_warps=cfg.num_warps,
    )  # fmt: skip
    return out


def gemv(
    w: PackedWeight, x: torch.Tensor | PreparedX, out: torch.Tensor | None = None
) -> torch.Tensor:
    """y = W x for a packed quantized W ``[n, k]``.

    x: ``[k]`` or ``[B, k]`` (B <= 8) fp16/bf16/fp32, or a ``PreparedX`` from ``prepare_x``
    (reuse it across the projections that read the same activation).
    Returns float32 ``[n]`` for 1-D x, ``[B, n]`` otherwise. ``out``, if given, is a float32
    ``[B, n]`` tensor written in full (used by tests to poison the output).
    """
    if w.ggml_type not in FMT_ID:
        raise ValueError(f"gemv: no kernel for {w.ggml_type.name}")
    one_d = isinstance(x, torch.Tensor) and x.dim() == 1
    xp = x if isinstance(x, PreparedX) else prepare_x(x)
    b, k = xp.x.shape
    if k != w.k:
        raise ValueError(f"gemv: x has K = {k}, the {w.ggml_type.name} weight has K = {w.k}")
    if xp.x.device != w.device:
        raise ValueError(f"gemv: x is on {xp.x.device}, the weight on {w.device}")
    y = _launch(w, xp, out)
    return y[0] if one_d else y

