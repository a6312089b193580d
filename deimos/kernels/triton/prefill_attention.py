"""Causal flash attention for prefill with GQA and an optional sliding window (Triton).
Oracle: deimos.kernels.attention.causal_attention with q_pos = start + arange(T),
k_pos = arange(S).

q ``[T, Hq, D]`` holds a chunk at positions start .. start+T-1; k, v ``[S, Hkv, D]`` the cache
with the chunk's own keys already written (S >= start + T; S may be the whole capacity). Query
t sees key s when s <= start + t and, with a window W > 0, start + t - s < W.

Tiles: a program owns BLOCK_M rows of one kv head, where the rows are (token, group head)
pairs ``r = t * G + g`` (G = Hq / Hkv): the G query heads that share a K/V tile sit in the same
M tile, so each K/V byte is loaded once per group instead of once per head. It loops over
BLOCK_N-key tiles from the window's first key to the tile's last query position, with an
online softmax in base 2 (scale * log2 e folded into the scores) and fp32 accumulators;
``tl.dot`` runs on the cache's dtype (fp16) with ``out_dtype=float32``.
Every key tile is masked (causal and window); splitting off the unmasked interior is a
possible speed-up not done yet.

Shared memory (sm_90: 232,448 B per block): Q [M, D] plus num_stages copies of the K and V
tiles [N, D] in fp16. D = 256: M = 64, N = 32, 2 stages -> 32 KB + 2 x 32 KB; D <= 128:
M = 128, N = 64 -> 32 KB + 2 x 32 KB at D = 128. tools/compile_kernels.py checks the real
numbers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from deimos.kernels.triton._attention_io import check_attention_io
from deimos.kernels.triton._softmax import online_softmax_step

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _prefill_kernel(
    p_q, p_k, p_v, p_o,
    sq_t, sq_h, sk_s, sk_h, sv_s, sv_h, so_t, so_h,
    T, D, start, scale, window, p_start,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    START_ON_DEVICE: tl.constexpr,
):  # fmt: skip
    if START_ON_DEVICE:  # the chunk's first position, read on the device (a CUDA graph replays it)
        start = tl.load(p_start).to(tl.int32)
    i_m = tl.program_id(0)
    i_kv = tl.program_id(1)
    o_r = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_t = o_r // G
    o_h = i_kv * G + o_r % G
    m_r = o_t < T
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    q_pos = start + o_t
    m_qd = m_r[:, None] & m_d[None, :]
    p_qb = p_q + o_t[:, None].to(tl.int64) * sq_t + o_h[:, None] * sq_h + o_d[None, :]
    b_q = tl.load(p_qb, mask=m_qd, other=0.0).to(p_k.dtype.element_ty)

    # keys of the tile: [lo, hi) with hi past the last row's position
    t_first = (i_m * BLOCK_M) // G
    t_last = tl.minimum((i_m * BLOCK_M + BLOCK_M - 1) // G, T - 1)
    hi = start + t_last + 1
    lo = 0
    if window > 0:
        lo = tl.maximum(0, start + t_first - window + 1)
        lo = lo - lo % BLOCK_N

    qk_scale = scale * LOG2E
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    o_n = tl.arange(0, BLOCK_N)
    for s0 in range(lo, hi, BLOCK_N):
        o_s = s0 + o_n
        m_s = o_s < hi
        m_kd = m_s[:, None] & m_d[None, :]
        o_s64 = o_s.to(tl.int64)
        p_kb = p_k + o_s64[:, None] * sk_s + i_kv * sk_h + o_d[None, :]
        p_vb = p_v + o_s64[:, None] * sv_s + i_kv * sv_h + o_d[None, :]
        b_k = tl.load(p_kb, mask=m_kd, other=0.0)
        b_v = tl.load(p_vb, mask=m_kd, other=0.0)
        qk = tl.dot(b_q, tl.trans(b_k), out_dtype=tl.float32) * qk_scale  # [M, N]
        delta = q_pos[:, None] - o_s[None, :]
        ok = (delta >= 0) & m_s[None, :]
        if window > 0:
            ok = ok & (delta < window)
        qk = tl.where(ok, qk, float("-inf"))
        m_i, l_i, acc = online_softmax_step(qk, b_v, m_i, l_i, acc)
    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # padding rows only
    out = acc / l_i[:, None]
    p_ob = p_o + o_t[:, None].to(tl.int64) * so_t + o_h[:, None] * so_h + o_d[None, :]
    tl.store(p_ob, out.to(p_o.dtype.element_ty), mask=m_qd)


class PrefillConfig(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def prefill_config(d: int) -> PrefillConfig:
    """Tiles by head size (see the module docstring for the shared-memory budget): D <= 64:
    128 x 64, 4 warps; D <= 128: 128 x 64, 8 warps (FA2's choice for D = 128); D <= 256:
    64 x 32, 4 warps (the Q tile and the fp32 accumulator [64, 256] fill 4 warps' registers)."""
    if d <= 64:
        return PrefillConfig(128, 64, 4, 2)
    if d <= 128:
        return PrefillConfig(128, 64, 8, 2)
    return PrefillConfig(64, 32, 4, 2)


MAX_HEAD_DIM = 256


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int | torch.Tensor,
    scale: float,
    window: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a prompt chunk over the cache.

    q: ``[T, Hq, D]`` at positions start .. start+T-1; k, v: ``[S, Hkv, D]`` with S >= start + T
    and keys 0..start+T-1 written (same dtype; fp16/bf16 on the GPU; last dims contiguous);
    D <= 256; window: sliding window W (0 = none). ``start``: a host int, or an int tensor on
    the device whose first element is it (the chunk's positions: nothing is read back, so a
    CUDA graph can replay the call for any start; S >= start + T is then the caller's
    promise). Returns ``[T, Hq, D]`` in q's dtype.
    """
    out = check_attention_io("prefill_attention", q, k, v, window, out, q.device, "T")
    n_t, hq, d = q.shape
    s, hkv, _ = k.shape
    if d > MAX_HEAD_DIM:
        raise ValueError(f"prefill_attention: head size {d} > {MAX_HEAD_DIM}")
    on_device = isinstance(start, torch.Tensor)
    if on_device:
        if start.device != q.device or start.dtype.is_floating_point or start.numel() < 1:
            raise ValueError("prefill_attention: a device start must be an int tensor on q's device")
    elif start < 0 or start + n_t > s:
        raise ValueError(
            f"prefill_attention: positions {start}..{start + n_t - 1} need a cache of at least "
            f"{start + n_t} keys, k has {s}"
        )
    if n_t == 0:
        return out
    g = hq // hkv
    cfg = prefill_config(d)
    _prefill_kernel[(triton.cdiv(n_t * g, cfg.block_m), hkv)](
        q, k, v, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        n_t, d, 0 if on_device else start, scale, window, start if on_device else q,
        G=g, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, START_ON_DEVICE=on_device,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out
