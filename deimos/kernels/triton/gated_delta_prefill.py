"""The gated delta rule's chunked prefill (Triton): several sequences packed along T (cu_seqlens),
each starting from its slot of the state pool ``[n_slots, Hv, Dk, Dv]`` float32 and leaving its
final state there. Oracles: deimos.kernels.gated_delta (``naive_reference``; the WY form these
kernels compute is ``chunked_reference``, whose docstring has the formulas).

Two launches, the split fla makes:
1. ``_chunk_kernel``, one program per (chunk of 64 tokens, sequence, value head), every chunk
   at once: G (the cumulative log decay), A = beta K K^T (decayed, strictly lower), T = (I +
   A)^-1 by a 64-row forward substitution, W = T (beta exp(G) K), U = T (beta V) and the
   decayed causal Q K^T, into scratch rows beside the tokens' (no chunk map: a chunk's rows
   are its tokens' rows);
2. ``_state_kernel``, one program per (BLOCK_V columns of the state, sequence, value head),
   the only sequential part: chunk after chunk with the [Dk, BLOCK_V] state block in
   registers, the deltas V' = U - W S, the output exp(G) Q S + (Q K^T decayed) V' and the
   state S exp(g_last) + (K exp(g_last - G))^T V'.

The single-kernel form this replaced computed T inside the sequential walk, once per state
block (4 programs a head), and spent most of its time there (qwen35 4B, a 512-token prompt:
571 us a layer on the H200). What fla does beyond this (not here): T by 16x16 diagonal blocks
merged with dots instead of 64 substitution steps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deimos.kernels.gated_delta import HEAD_MAPS

CHUNK = 64


@triton.jit
def _head_and_rows(i_h, i_n, p_cu, HK: tl.constexpr, HV: tl.constexpr, TILED: tl.constexpr):
    """(value head i_h's key head, sequence i_n's first row and its rows)."""
    if TILED:
        i_hk = i_h % HK
    else:
        i_hk = i_h // (HV // HK)
    bos = tl.load(p_cu + i_n).to(tl.int64)
    return i_hk, bos, tl.load(p_cu + i_n + 1).to(tl.int64) - bos


@triton.jit
def _snapshot_at(p_snap, i_n, BT: tl.constexpr, SNAP: tl.constexpr):
    """(sequence i_n's snapshot row, 0 for none; the shift of its chunk grid): chunk c is rows
    max(c BT - shift, 0) .. (c + 1) BT - shift, so that one of them ends on the snapshot row."""
    snap = 0
    if SNAP:
        snap = tl.load(p_snap + 2 * i_n)
    return snap, (BT - snap % BT) % BT


@triton.jit
def _chunk_kernel(p_q, p_k, p_v, p_g, p_beta, p_cu, p_snap, p_w, p_u, p_aqk, p_gc,
                  HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                  BT: tl.constexpr, BLOCK_DV: tl.constexpr, TILED: tl.constexpr,
                  PRECISION: tl.constexpr, SNAP: tl.constexpr):
    """Chunk i_c of sequence i_n's value head i_h: its G, W, U and decayed Q K^T."""
    i_c, i_n, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hk, bos, seqlen = _head_and_rows(i_h, i_n, p_cu, HK, HV, TILED)
    _, shift = _snapshot_at(p_snap, i_n, BT, SNAP)
    c0 = tl.maximum(i_c * BT - shift, 0)
    c1 = tl.minimum(i_c * BT + BT - shift, seqlen)
    if c0 < c1:
        o_i = tl.arange(0, BT)
        o_k = tl.arange(0, DK)
        o_v = tl.arange(0, BLOCK_DV)
        m_t = (c0 + o_i) < c1
        m_tv = m_t[:, None] & (o_v < DV)[None, :]
        rows = bos + c0 + o_i
        m_lower = o_i[:, None] > o_i[None, :]
        m_causal = o_i[:, None] >= o_i[None, :]
        b_k = tl.load(p_k + (rows[:, None] * HK + i_hk) * DK + o_k[None, :], mask=m_t[:, None],
                      other=0.0).to(tl.float32)
        b_g = tl.load(p_g + rows * HV + i_h, mask=m_t, other=0.0).to(tl.float32)
        b_beta = tl.load(p_beta + rows * HV + i_h, mask=m_t, other=0.0).to(tl.float32)
        b_G = tl.sum(tl.where(m_causal, b_g[None, :], 0.0), axis=1)  # cumulative log decay
        b_dec = tl.where(m_causal, tl.exp(tl.where(m_causal, b_G[:, None] - b_G[None, :], 0.0)), 0.0)
        b_kk = tl.dot(b_k, tl.trans(b_k), out_dtype=tl.float32, input_precision=PRECISION)
        b_a = tl.where(m_lower, b_kk * b_dec * b_beta[:, None], 0.0)
        b_l = tl.zeros([BT, BT], dtype=tl.float32)
        for i in range(1, BT):
            b_ai = tl.sum(tl.where(o_i[:, None] == i, b_a, 0.0), axis=0)
            b_li = -b_ai - tl.sum(b_ai[:, None] * b_l, axis=0)
            b_l = tl.where(o_i[:, None] == i, b_li[None, :], b_l)
        b_t = b_l + tl.where(o_i[:, None] == o_i[None, :], 1.0, 0.0)
        b_kb = b_k * (b_beta * tl.exp(b_G))[:, None]
        b_w = tl.dot(b_t, b_kb, out_dtype=tl.float32, input_precision=PRECISION)
        tl.store(p_w + (rows[:, None] * HV + i_h) * DK + o_k[None, :], b_w, mask=m_t[:, None])
        b_v = tl.load(p_v + (rows[:, None] * HV + i_h) * DV + o_v[None, :], mask=m_tv,
                      other=0.0).to(tl.float32)
        b_u = tl.dot(b_t, b_v * b_beta[:, None], out_dtype=tl.float32, input_precision=PRECISION)
        tl.store(p_u + (rows[:, None] * HV + i_h) * DV + o_v[None, :], b_u, mask=m_tv)
        b_q = tl.load(p_q + (rows[:, None] * HK + i_hk) * DK + o_k[None, :], mask=m_t[:, None],
                      other=0.0).to(tl.float32)
        b_qk = tl.dot(b_q, tl.trans(b_k), out_dtype=tl.float32, input_precision=PRECISION) * b_dec
        tl.store(p_aqk + (rows[:, None] * HV + i_h) * BT + o_i[None, :], b_qk, mask=m_t[:, None])
        tl.store(p_gc + rows * HV + i_h, b_G, mask=m_t)


@triton.jit
def _state_kernel(p_q, p_k, p_o, p_pool, p_slot, p_cu, p_snap, p_w, p_u, p_aqk, p_gc, scale,
                  HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                  BT: tl.constexpr, BLOCK_V: tl.constexpr, TILED: tl.constexpr,
                  PRECISION: tl.constexpr, SNAP: tl.constexpr):
    """Columns i_v BLOCK_V .. of sequence i_n's value head i_h, chunk after chunk (the state
    after its snapshot row also stored into its snapshot slot)."""
    i_v, i_n, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hk, bos, seqlen = _head_and_rows(i_h, i_n, p_cu, HK, HV, TILED)
    snap, shift = _snapshot_at(p_snap, i_n, BT, SNAP)
    slot = tl.load(p_slot + i_n).to(tl.int64)
    o_k = tl.arange(0, DK)
    o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    m_v = o_v < DV
    o_i = tl.arange(0, BT)
    p_s = p_pool + (slot * HV + i_h) * DK * DV + o_k[:, None] * DV + o_v[None, :]
    m_s = (o_k[:, None] < DK) & m_v[None, :]
    b_s = tl.load(p_s, mask=m_s, other=0.0)
    for i_c in range(0, tl.cdiv(seqlen + shift, BT)):
        c0 = tl.maximum(i_c * BT - shift, 0)
        c1 = tl.minimum(i_c * BT + BT - shift, seqlen)
        m_t = (c0 + o_i) < c1
        rows = bos + c0 + o_i
        m_tv = m_t[:, None] & m_v[None, :]
        b_G = tl.load(p_gc + rows * HV + i_h, mask=m_t, other=0.0)
        b_wt = tl.load(p_w + (rows[:, None] * HV + i_h) * DK + o_k[None, :], mask=m_t[:, None],
                       other=0.0)
        b_x = tl.load(p_u + (rows[:, None] * HV + i_h) * DV + o_v[None, :], mask=m_tv, other=0.0)
        b_x -= tl.dot(b_wt, b_s, out_dtype=tl.float32, input_precision=PRECISION)  # the deltas V'
        b_q = tl.load(p_q + (rows[:, None] * HK + i_hk) * DK + o_k[None, :], mask=m_t[:, None],
                      other=0.0).to(tl.float32)
        b_qk = tl.load(p_aqk + (rows[:, None] * HV + i_h) * BT + o_i[None, :], mask=m_t[:, None],
                       other=0.0)
        b_o = tl.exp(b_G)[:, None] * tl.dot(b_q, b_s, out_dtype=tl.float32, input_precision=PRECISION)
        b_o += tl.dot(b_qk, b_x, out_dtype=tl.float32, input_precision=PRECISION)
        tl.store(p_o + (rows[:, None] * HV + i_h) * DV + o_v[None, :],
                 (b_o * scale).to(p_o.dtype.element_ty), mask=m_tv)
        last = c1 - c0 - 1
        b_glast = tl.sum(tl.where(o_i == last, b_G, 0.0), axis=0)
        b_k = tl.load(p_k + (rows[:, None] * HK + i_hk) * DK + o_k[None, :], mask=m_t[:, None],
                      other=0.0).to(tl.float32)
        b_kd = b_k * tl.where(m_t, tl.exp(b_glast - b_G), 0.0)[:, None]
        b_s = b_s * tl.exp(b_glast) + tl.dot(tl.trans(b_kd), b_x, out_dtype=tl.float32,
                                             input_precision=PRECISION)
        if SNAP:
            if c1 == snap:  # the state after the snapshot row: a copy into the snapshot slot
                to = tl.load(p_snap + 2 * i_n + 1).to(tl.int64)
                tl.store(p_pool + (to * HV + i_h) * DK * DV + o_k[:, None] * DV + o_v[None, :],
                         b_s, mask=m_s)
    tl.store(p_s, b_s, mask=m_s)


def prefill_config(dk: int, dv: int) -> tuple[int, int]:
    """The state pass's (BLOCK_V, num_warps): 32 state columns at Dk = 128 (the [128, 32]
    state block beside [64, 128] tiles of W, Q and K), 8 warps."""
    block_v = min(triton.next_power_of_2(dv), 32 if dk >= 128 else 64)
    return max(16, block_v), 8


# the state pass's loads unpipelined: 2 stages of its fp32 W, Q and K tiles need 246 KB of
# shared memory at Dk = 128 in tf32 (the H200 gives a block 227 KB), 1 stage 74 KB
STATE_STAGES = 1
CHUNK_WARPS = 8  # the chunk pass: [64, 128] K, V, Q, W and U tiles and four [64, 64] blocks


def gated_delta_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, cu_seqlens: torch.Tensor, pool: torch.Tensor,
                        slots: torch.Tensor, scale: float, head_map: str = "grouped",
                        out: torch.Tensor | None = None, precision: str = "ieee",
                        max_len: int | None = None, snapshot: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """The gated delta rule over N sequences packed along T; ``pool[slots[n]]`` is sequence n's
    initial state (zero it for a new sequence) and receives its final state.

    q, k: ``[T, Hk, Dk]``; v: ``[T, Hv, Dv]`` (float32, fp16 or bf16, contiguous); g (log
    decay), beta: ``[T, Hv]``; cu_seqlens: int32 ``[N + 1]``, 0 = c_0 <= c_1 <= ... <= c_N <= T
    (sequence n is rows c_n .. c_{n+1}; empty ones leave their slot as it was; rows past c_N,
    a padded graph's, belong to none: not read, their out rows not written); pool: float32
    ``[n_slots, Hv, Dk, Dv]`` contiguous; slots: int32 ``[N]``, distinct; scale: the output's
    factor (1/sqrt(Dk)); head_map: "grouped" (value head h reads key head h // (Hv / Hk)) or
    "tiled" (h % Hk); out: ``[T, Hv, Dv]`` contiguous (default: new, v's dtype), every row
    of a sequence written; precision: the fp32 dots' ``input_precision`` ("ieee", or "tf32" on the GPU).
    max_len: the longest sequence's rows (None: read from the device, a synchronization).
    snapshot: int32 ``[N, 2]`` or None: sequence n's state after its first ``snapshot[n, 0]``
    rows is also stored into slot ``snapshot[n, 1]`` of the pool (0 rows: none; a slot none of
    the sequences holds), taken inside the one pass: its chunks are laid so that one ends on
    that row. Dk: a power of two >= 16. Returns out. cu_seqlens, slots and snapshot are read on
    the device."""
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
    if snapshot is not None and (snapshot.dtype != torch.int32 or snapshot.shape != (n, 2)):
        raise ValueError(f"gated_delta_prefill: snapshot {snapshot.dtype} "
                         f"{tuple(snapshot.shape)} is not int32 [{n}, 2]")  # fmt: skip
    if out is None:
        out = torch.empty_like(v)
    elif out.shape != v.shape or not out.is_contiguous():
        raise ValueError(f"gated_delta_prefill: out {tuple(out.shape)} is not a contiguous "
                         f"{tuple(v.shape)}")  # fmt: skip
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("pool", pool),
                    ("slots", slots), ("cu_seqlens", cu_seqlens), ("snapshot", snapshot)):
        if x is not None and (not x.is_contiguous() or x.device != q.device):
            raise ValueError(f"gated_delta_prefill: {name} must be contiguous on {q.device}")
    if n and t:
        if max_len is None:
            max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        f32 = {"dtype": torch.float32, "device": q.device}
        w, u = torch.empty(t, hv, dk, **f32), torch.empty(t, hv, dv, **f32)
        aqk, gc = torch.empty(t, hv, CHUNK, **f32), torch.empty(t, hv, **f32)
        tiled = head_map == "tiled"
        snap = snapshot is not None
        p_snap = snapshot if snap else cu_seqlens
        if max_len > 0:  # a shifted grid has one chunk more (a short one first)
            _chunk_kernel[(triton.cdiv(max_len, CHUNK) + snap, n, hv)](
                q, k, v, g, beta, cu_seqlens, p_snap, w, u, aqk, gc, HK=hk, HV=hv, DK=dk, DV=dv,
                BT=CHUNK, BLOCK_DV=triton.next_power_of_2(dv), TILED=tiled, PRECISION=precision,
                SNAP=snap, num_warps=CHUNK_WARPS,
            )  # fmt: skip
        block_v, warps = prefill_config(dk, dv)
        _state_kernel[(triton.cdiv(dv, block_v), n, hv)](
            q, k, out, pool, slots, cu_seqlens, p_snap, w, u, aqk, gc, float(scale), HK=hk, HV=hv,
            DK=dk, DV=dv, BT=CHUNK, BLOCK_V=block_v, TILED=tiled, PRECISION=precision, SNAP=snap,
            num_warps=warps, num_stages=STATE_STAGES,
        )  # fmt: skip
    return out
