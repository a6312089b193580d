"""The gated delta rule's decode step (Triton): one token for each of B sequences in one launch,
each sequence's state a slot of a pool ``[n_slots, Hv, Dk, Dv]`` float32, updated in place.
Oracle: deimos.kernels.gated_delta.naive_reference (the math and the conventions are there).

One program per (BLOCK_V columns of the state, sequence, value head): the [Dk, BLOCK_V] block is
read once, decayed, its prediction S^T k taken, the rank-one update added, the output read and
the block written back. Columns of S are independent, so the Dv/BLOCK_V programs of a head need
no exchange. The slot of each sequence is read on the device (an int32 tensor), so a decode
CUDA graph replays with new slots; a slot < 0 (a padded row of a graph bucket) leaves the pool
alone and writes zeros to its output row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deimos.kernels.gated_delta import HEAD_MAPS
from deimos.quant.triton.pdl import launch_options, pdl_on, pdl_start


@triton.jit
def _decode_kernel(p_q, p_k, p_v, p_g, p_beta, p_o, p_pool, p_slot, scale,
                   HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                   BLOCK_V: tl.constexpr, TILED: tl.constexpr, PDL: tl.constexpr = False):
    """Columns i_v BLOCK_V .. of sequence i_b's value head i_h."""
    pdl_start(PDL)
    i_v, i_b, i_h = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    if TILED:
        i_hk = i_h % HK
    else:
        i_hk = i_h // (HV // HK)
    o_k = tl.arange(0, DK)
    o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    m_v = o_v < DV
    p_out = p_o + (i_b * HV + i_h) * DV + o_v
    slot = tl.load(p_slot + i_b).to(tl.int64)
    if slot < 0:
        tl.store(p_out, tl.zeros([BLOCK_V], dtype=tl.float32).to(p_o.dtype.element_ty), mask=m_v)
    else:
        b_q = tl.load(p_q + (i_b * HK + i_hk) * DK + o_k).to(tl.float32)
        b_k = tl.load(p_k + (i_b * HK + i_hk) * DK + o_k).to(tl.float32)
        b_v = tl.load(p_v + (i_b * HV + i_h) * DV + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_g = tl.load(p_g + i_b * HV + i_h).to(tl.float32)
        b_beta = tl.load(p_beta + i_b * HV + i_h).to(tl.float32)
        p_s = p_pool + (slot * HV + i_h) * DK * DV + o_k[:, None] * DV + o_v[None, :]
        m_s = m_v[None, :] & (o_k[:, None] < DK)
        b_s = tl.load(p_s, mask=m_s, other=0.0) * tl.exp(b_g)
        b_d = b_beta * (b_v - tl.sum(b_s * b_k[:, None], axis=0))
        b_s += b_k[:, None] * b_d[None, :]
        b_o = tl.sum(b_s * b_q[:, None], axis=0) * scale
        tl.store(p_s, b_s, mask=m_s)
        tl.store(p_out, b_o.to(p_o.dtype.element_ty), mask=m_v)


def decode_block_v(dk: int, dv: int) -> int:
    """Columns per program: 32 at Dk = 128 (a 16 KB block, 32 registers a thread at 4 warps; Hv
    = 32 gives B * 128 programs), wider only for tiny heads."""
    return min(triton.next_power_of_2(dv), max(16, 4096 // dk))


def _launch(q, k, v, g, beta, out, pool, slots, scale, tiled):
    b, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    block_v = decode_block_v(dk, dv)
    _decode_kernel[(triton.cdiv(dv, block_v), b, hv)](
        q, k, v, g, beta, out, pool, slots, float(scale), HK=hk, HV=hv, DK=dk, DV=dv,
        BLOCK_V=block_v, TILED=tiled, num_warps=4, **launch_options(pdl_on(q.device)),
    )  # fmt: skip


def gated_delta_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, scale: float,
                       head_map: str = "grouped", out: torch.Tensor | None = None) -> torch.Tensor:
    """One gated-delta-rule step for B sequences; ``pool[slots[b]]`` updated in place.

    q, k: ``[B, Hk, Dk]``; v: ``[B, Hv, Dv]`` (float32, fp16 or bf16, contiguous); g (log
    decay), beta: ``[B, Hv]`` (any float dtype, contiguous); pool: float32 ``[n_slots, Hv, Dk,
    Dv]`` contiguous; slots: int32 ``[B]`` on the device (< 0: a padding row, output zeros, pool
    untouched; no two live rows may share a slot); scale: the output's factor (1/sqrt(Dk));
    head_map: "grouped" (value head h reads key head h // (Hv / Hk)) or "tiled" (h % Hk); out:
    ``[B, Hv, Dv]`` contiguous, written in full (default: a new tensor of v's dtype). Dk must be
    a power of two >= 16. Returns out."""
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"gated_delta_decode: q {tuple(q.shape)} k {tuple(k.shape)} v "
                         f"{tuple(v.shape)}: want [B, Hk, Dk], [B, Hk, Dk], [B, Hv, Dv]")  # fmt: skip
    b, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if head_map not in HEAD_MAPS:
        raise ValueError(f"gated_delta_decode: head_map {head_map!r} not one of {HEAD_MAPS}")
    if hv % hk:
        raise ValueError(f"gated_delta_decode: {hk} key heads do not divide {hv} value heads")
    if dk < 16 or dk & (dk - 1):
        raise ValueError(f"gated_delta_decode: Dk = {dk} is not a power of two >= 16")
    if g.shape != (b, hv) or beta.shape != (b, hv):
        raise ValueError(f"gated_delta_decode: g {tuple(g.shape)} beta {tuple(beta.shape)} "
                         f"are not [{b}, {hv}]")  # fmt: skip
    if pool.dim() != 4 or pool.shape[1:] != (hv, dk, dv) or pool.dtype != torch.float32:
        raise ValueError(f"gated_delta_decode: pool {pool.dtype} {tuple(pool.shape)} is not "
                         f"float32 [n_slots, {hv}, {dk}, {dv}]")  # fmt: skip
    if slots.shape != (b,) or slots.dtype != torch.int32:
        raise ValueError(f"gated_delta_decode: slots {slots.dtype} {tuple(slots.shape)} is not "
                         f"int32 [{b}]")  # fmt: skip
    if out is None:
        out = torch.empty_like(v)
    elif out.shape != v.shape or not out.is_contiguous():
        raise ValueError(f"gated_delta_decode: out {tuple(out.shape)} is not a contiguous "
                         f"{tuple(v.shape)}")  # fmt: skip
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("pool", pool),
                    ("slots", slots)):
        if not x.is_contiguous() or x.device != q.device:
            raise ValueError(f"gated_delta_decode: {name} must be contiguous on {q.device}")
    if b:
        _launch(q, k, v, g, beta, out, pool, slots, scale, head_map == "tiled")
    return out
