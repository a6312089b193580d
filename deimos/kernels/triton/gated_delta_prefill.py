"""The gated delta rule's chunked prefill (Triton): several sequences packed along T (cu_seqlens),
each starting from its slot of the state pool ``[n_slots, Hv, Dk, Dv]`` float32 and leaving its
final state there. Oracles: deimos.kernels.gated_delta (``naive_reference``; the WY form this
kernel computes is ``chunked_reference``, whose docstring has the formulas).

One program per (BLOCK_V columns of the state, sequence, value head) walks its sequence in
chunks of 64 tokens with the [Dk, BLOCK_V] state block in registers. Inside a chunk everything
is chunk-parallel matrix work on the tensor cores: A = beta K K^T (decayed, strictly lower),
T = (I + A)^-1 by a 64-row forward substitution on the [64, 64] block, V' = T (beta (V -
exp(G) K S)), the output exp(G) Q S + (Q K^T decayed, lower) V' and the state update. Columns
of the state are independent, so a head's Dv/BLOCK_V programs share nothing; each recomputes
the chunk's T (the price of needing no second kernel and no scratch).

What fla does beyond this (not here): T, W and U of every chunk computed first by a
chunk-parallel kernel (all chunks of all sequences at once), leaving only the state pass
sequential, and T by 16x16 diagonal blocks merged with dots instead of 64 substitution steps.
At Hv = 32, Dv = 128 this kernel has N * 128 programs, each sequential over its chunks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deimos.kernels.gated_delta import HEAD_MAPS

CHUNK = 64


@triton.jit
def _prefill_kernel(p_q, p_k, p_v, p_g, p_beta, p_o, p_pool, p_slot, p_cu, scale,
                    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                    BT: tl.constexpr, BLOCK_V: tl.constexpr, TILED: tl.constexpr,
                    PRECISION: tl.constexpr):
    """Columns i_v BLOCK_V .. of sequence i_n's value head i_h, chunk after chunk."""
    i_v, i_n, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if TILED:
        i_hk = i_h % HK
    else:
        i_hk = i_h // (HV // HK)
    bos = tl.load(p_cu + i_n).to(tl.int64)
    seqlen = tl.load(p_cu + i_n + 1).to(tl.int64) - bos
    slot = tl.load(p_slot + i_n).to(tl.int64)
    o_k = tl.arange(0, DK)
    o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    m_v = o_v < DV
    o_i = tl.arange(0, BT)
    m_lower = o_i[:, None] > o_i[None, :]
    m_causal = o_i[:, None] >= o_i[None, :]
    m_eye = o_i[:, None] == o_i[None, :]
    p_s = p_pool + (slot * HV + i_h) * DK * DV + o_k[:, None] * DV + o_v[None, :]
    m_s = (o_k[:, None] < DK) & m_v[None, :]
    b_s = tl.load(p_s, mask=m_s, other=0.0)
    for c0 in range(0, seqlen, BT):
        o_t = c0 + o_i
        m_t = o_t < seqlen
        rows = bos + o_t
        # tokens past the sequence load as k = v = beta = g = 0: they add nothing to the chunk
        b_k = tl.load(p_k + (rows[:, None] * HK + i_hk) * DK + o_k[None, :], mask=m_t[:, None],
                      other=0.0).to(tl.float32)
        b_g = tl.load(p_g + rows * HV + i_h, mask=m_t, other=0.0).to(tl.float32)
        b_beta = tl.load(p_beta + rows * HV + i_h, mask=m_t, other=0.0).to(tl.float32)
        b_G = tl.sum(tl.where(m_causal, b_g[None, :], 0.0), axis=1)  # cumulative log decay
        b_dec = tl.where(m_causal, tl.exp(tl.where(m_causal, b_G[:, None] - b_G[None, :], 0.0)), 0.0)
        b_kk = tl.dot(b_k, tl.trans(b_k), out_dtype=tl.float32, input_precision=PRECISION)
        b_a = tl.where(m_lower, b_kk * b_dec * b_beta[:, None], 0.0)
        # (I + A)^-1 = I + L, row by row: L_i = -A_i - A_i L (rows of L at and below i still 0)
        b_l = tl.zeros([BT, BT], dtype=tl.float32)
        for i in range(1, BT):
            b_ai = tl.sum(tl.where(o_i[:, None] == i, b_a, 0.0), axis=0)
            b_li = -b_ai - tl.sum(b_ai[:, None] * b_l, axis=0)
            b_l = tl.where(o_i[:, None] == i, b_li[None, :], b_l)
        b_t = b_l + tl.where(m_eye, 1.0, 0.0)
        b_v = tl.load(p_v + (rows[:, None] * HV + i_h) * DV + o_v[None, :],
                      mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32)
        b_eg = tl.exp(b_G)
        b_ks = tl.dot(b_k, b_s, out_dtype=tl.float32, input_precision=PRECISION)
        b_r = b_beta[:, None] * (b_v - b_eg[:, None] * b_ks)
        b_x = tl.dot(b_t, b_r, out_dtype=tl.float32, input_precision=PRECISION)  # the deltas V'
        b_q = tl.load(p_q + (rows[:, None] * HK + i_hk) * DK + o_k[None, :], mask=m_t[:, None],
                      other=0.0).to(tl.float32)
        b_qk = tl.dot(b_q, tl.trans(b_k), out_dtype=tl.float32, input_precision=PRECISION) * b_dec
        b_o = b_eg[:, None] * tl.dot(b_q, b_s, out_dtype=tl.float32, input_precision=PRECISION)
        b_o += tl.dot(b_qk, b_x, out_dtype=tl.float32, input_precision=PRECISION)
        tl.store(p_o + (rows[:, None] * HV + i_h) * DV + o_v[None, :],
                 (b_o * scale).to(p_o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])
        b_glast = tl.sum(tl.where(o_i == BT - 1, b_G, 0.0), axis=0)  # padding keeps G flat
        b_kd = b_k * tl.exp(b_glast - b_G)[:, None]
        b_s = b_s * tl.exp(b_glast) + tl.dot(tl.trans(b_kd), b_x, out_dtype=tl.float32,
                                             input_precision=PRECISION)
    tl.store(p_s, b_s, mask=m_s)


def prefill_config(dk: int, dv: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps): 32 state columns at Dk = 128 (the [128, 32] state block, the
    [64, 128] k and q tiles and two [64, 64] blocks live together), 8 warps."""
    block_v = min(triton.next_power_of_2(dv), 32 if dk >= 128 else 64)
    return max(16, block_v), 8 if dk >= 128 else 4


def gated_delta_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, cu_seqlens: torch.Tensor, pool: torch.Tensor,
                        slots: torch.Tensor, scale: float, head_map: str = "grouped",
                        out: torch.Tensor | None = None, precision: str = "ieee") -> torch.Tensor:
    """The gated delta rule over N sequences packed along T; ``pool[slots[n]]`` is sequence n's
    initial state (zero it for a new sequence) and receives its final state.

    q, k: ``[T, Hk, Dk]``; v: ``[T, Hv, Dv]`` (float32, fp16 or bf16, contiguous); g (log
    decay), beta: ``[T, Hv]``; cu_seqlens: int32 ``[N + 1]``, 0 = c_0 <= c_1 <= ... = T
    (sequence n is rows c_n .. c_{n+1}; empty ones leave their slot as it was); pool: float32
    ``[n_slots, Hv, Dk, Dv]`` contiguous; slots: int32 ``[N]``, distinct; scale: the output's
    factor (1/sqrt(Dk)); head_map: "grouped" (value head h reads key head h // (Hv / Hk)) or
    "tiled" (h % Hk); out: ``[T, Hv, Dv]`` contiguous (default: new, v's dtype), every row
    written; precision: the fp32 dots' ``input_precision`` ("ieee", or "tf32" on the GPU).
    Dk: a power of two >= 16. Returns out. cu_seqlens and slots are read on the device."""
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"gated_delta_prefill: q {tuple(q.shape)} k {tuple(k.shape)} v "
                         f"{tuple(v.shape)}: want [T, Hk, Dk], [T, Hk, Dk], [T, Hv, Dv]")  # fmt: skip
    t, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if head_map not in HEAD_MAPS:
        raise ValueError(f"gated_delta_prefill: head_map {head_map!r} not one of {HEAD_MAPS}")
    if hv % hk:
        raise ValueError(f"gated_delta_prefill: {hk} key heads do not divide {hv} value heads")
    if dk < 16 or dk & (dk - 1):
        raise ValueError(f"gated_delta_prefill: Dk = {dk} is not a power of two >= 16")
    if g.shape != (t, hv) or beta.shape != (t, hv):
        raise ValueError(f"gated_delta_prefill: g {tuple(g.shape)} beta {tuple(beta.shape)} "
                         f"are not [{t}, {hv}]")  # fmt: skip
    if pool.dim() != 4 or pool.shape[1:] != (hv, dk, dv) or pool.dtype != torch.float32:
        raise ValueError(f"gated_delta_prefill: pool {pool.dtype} {tuple(pool.shape)} is not "
                         f"float32 [n_slots, {hv}, {dk}, {dv}]")  # fmt: skip
    n = slots.shape[0] if slots.dim() == 1 else -1
    if slots.dtype != torch.int32 or cu_seqlens.dtype != torch.int32 or cu_seqlens.shape != (n + 1,):
        raise ValueError(f"gated_delta_prefill: slots {slots.dtype} {tuple(slots.shape)} and "
                         f"cu_seqlens {cu_seqlens.dtype} {tuple(cu_seqlens.shape)} must be int32 "
                         "[N] and [N + 1]")  # fmt: skip
    if precision not in ("ieee", "tf32"):
        raise ValueError(f"gated_delta_prefill: precision {precision!r} not 'ieee' or 'tf32'")
    if out is None:
        out = torch.empty_like(v)
    elif out.shape != v.shape or not out.is_contiguous():
        raise ValueError(f"gated_delta_prefill: out {tuple(out.shape)} is not a contiguous "
                         f"{tuple(v.shape)}")  # fmt: skip
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("pool", pool),
                    ("slots", slots), ("cu_seqlens", cu_seqlens)):
        if not x.is_contiguous() or x.device != q.device:
            raise ValueError(f"gated_delta_prefill: {name} must be contiguous on {q.device}")
    if n and t:
        block_v, warps = prefill_config(dk, dv)
        _prefill_kernel[(triton.cdiv(dv, block_v), n, hv)](
            q, k, v, g, beta, out, pool, slots, cu_seqlens, float(scale), HK=hk, HV=hv, DK=dk,
            DV=dv, BT=CHUNK, BLOCK_V=block_v, TILED=head_map == "tiled", PRECISION=precision,
            num_warps=warps,
        )  # fmt: skip
    return out
