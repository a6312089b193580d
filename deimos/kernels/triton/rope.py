"""Rotary position embedding on q and k (Triton), in place or out of place.
Oracle: deimos.kernels.rope (rope_cos_sin + apply_rope).

Angles: theta_i = pos * inv_freq_i in float32, with inv_freq_i = scale * base^(-2i/R) /
freq_factor_i computed once on the host in float64 and rounded to float32 (``rope_inv_freq``;
keep it on the device with the model). The reference works in float64, so the angle differs
by ~pos * 2^-24 rad (1e-4 at pos 4096); tests use tolerances of that size.

One program per token does all heads of q and then of k: a ``[BLOCK_H, BLOCK_D]`` tile of
whole heads. Element d < R pairs with its partner (norm: d ^ 1; neox: d +- R/2), loaded a
second time from memory (an L1 hit) rather than shuffled in registers; dims >= R pass through
unchanged. Every load precedes every store of a program and programs own disjoint tokens, so
in place is safe.

Cost (bandwidth-bound): reads q and k (and v with ``cache``), T * (Hq + 2 Hk) * D elements
(4 bytes each from an fp32 projection), plus the partner elements again (L1 hits) and, with
``slots``, 4 or 8 bytes a token; writes q' (T * Hq * D, q's dtype) and k', v into the cache
rows (2 * T * Hk * D * 2 bytes for an fp16 cache). A paged cache's slots scatter whole rows
of Hk * D elements, so the stores stay coalesced.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deimos.quant.triton.pdl import launch_options, pdl_on, pdl_start

ROPE_TYPES = {"norm": 0, "neox": 1}


@triton.jit
def rope_tile(
    p_x, p_pos_freq, pos, h0, stride_xh, H, D, R, p_nw, eps,
    NEOX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, HAS_NORM: tl.constexpr,
):  # fmt: skip
    """Heads h0 .. h0+BLOCK_H-1 (those < H) of one token's row ``p_x``, rotated at ``pos``
    (float): float32 ``[BLOCK_H, BLOCK_D]`` (masked entries 0) and its mask. HAS_NORM: each
    head first RMS-normalized over its D dims with the weight at ``p_nw`` (qk-norm). Also
    the decode attention's prologue (decode_attention.py: RoPE fused there)."""
    o_h = h0 + tl.arange(0, BLOCK_H)
    o_d = tl.arange(0, BLOCK_D)
    half = R // 2
    rot = o_d < R
    if NEOX:
        partner = tl.where(o_d < half, o_d + half, o_d - half)
        i_f = o_d % half
        first = o_d < half
    else:
        partner = o_d ^ 1
        i_f = o_d // 2
        first = (o_d % 2) == 0
    m = (o_h < H)[:, None] & (o_d < D)[None, :]
    m_rot = m & rot[None, :]
    p_row = p_x + o_h[:, None] * stride_xh
    b_x = tl.load(p_row + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    b_p = tl.load(p_row + partner[None, :], mask=m_rot, other=0.0).to(tl.float32)
    if HAS_NORM:  # the partner is in the same head: the same rstd, its own weight
        rstd = 1.0 / tl.sqrt(tl.sum(b_x * b_x, axis=1) / D + eps)[:, None]
        b_x = b_x * rstd * tl.load(p_nw + o_d, mask=o_d < D, other=0.0).to(tl.float32)[None, :]
        b_p = b_p * rstd * tl.load(p_nw + partner, mask=rot, other=0.0).to(tl.float32)[None, :]
    theta = pos * tl.load(p_pos_freq + i_f, mask=rot, other=0.0)
    c = tl.cos(theta)[None, :]
    s = tl.sin(theta)[None, :]
    # first of a pair: a c - b s; second: b c + a s (a = first, b = second)
    y = tl.where(first[None, :], b_x * c - b_p * s, b_x * c + b_p * s)
    y = tl.where(rot[None, :], y, b_x)
    return y, m


@triton.jit
def _rope_heads(
    p_x, p_y, p_pos_freq, pos, h0, stride_xh, stride_yh, H, D, R, p_nw, eps,
    NEOX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, HAS_NORM: tl.constexpr,
):  # fmt: skip
    """``rope_tile`` of heads h0.. of one token stored at ``p_y`` (that token's row)."""
    y, m = rope_tile(p_x, p_pos_freq, pos, h0, stride_xh, H, D, R, p_nw, eps,
                     NEOX, BLOCK_H, BLOCK_D, HAS_NORM)  # fmt: skip
    o_h = h0 + tl.arange(0, BLOCK_H)
    o_d = tl.arange(0, BLOCK_D)
    p_out = p_y + o_h[:, None] * stride_yh + o_d[None, :]
    tl.store(p_out, y.to(p_y.dtype.element_ty), mask=m)


@triton.jit
def _copy_heads(p_x, p_y, h0, stride_xh, stride_yh, H, D, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    o_h = h0 + tl.arange(0, BLOCK_H)
    o_d = tl.arange(0, BLOCK_D)
    m = (o_h < H)[:, None] & (o_d < D)[None, :]
    b = tl.load(p_x + o_h[:, None] * stride_xh + o_d[None, :], mask=m, other=0.0)
    tl.store(p_y + o_h[:, None] * stride_yh + o_d[None, :], b.to(p_y.dtype.element_ty), mask=m)


@triton.jit
def _rope_kernel(
    p_q, p_k, p_qo, p_ko, p_v, p_vo, p_pos, p_inv_freq, p_qn, p_kn,
    sq_t, sq_h, sk_t, sk_h, sqo_t, sqo_h, sko_t, sko_h, sv_t, sv_h, svo_t, svo_h,
    HQ, HK, D, R, eps,
    NEOX: tl.constexpr, HAS_K: tl.constexpr, TO_CACHE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, HAS_NORM: tl.constexpr, PDL: tl.constexpr = False,
    SLOTS: tl.constexpr = False, p_slot=None,
):  # fmt: skip
    """Grid (T, head blocks of q then of k). TO_CACHE: k' and v go to the cache rows at the
    token's position (ko/vo are the layer's cache; SLOTS: at the row p_slot[t] instead, a
    paged cache's slot), else k' to row t of ko. HAS_NORM: q and k heads RMS-normalized first
    (weights p_qn, p_kn)."""
    pdl_start(PDL)
    i_t = tl.program_id(0).to(tl.int64)
    i_hb = tl.program_id(1)
    pos_i = tl.load(p_pos + i_t).to(tl.int64)
    pos = pos_i.to(tl.float32)
    n_qb = tl.cdiv(HQ, BLOCK_H)
    if i_hb < n_qb:
        _rope_heads(p_q + i_t * sq_t, p_qo + i_t * sqo_t, p_inv_freq, pos, i_hb * BLOCK_H,
                    sq_h, sqo_h, HQ, D, R, p_qn, eps, NEOX, BLOCK_H, BLOCK_D, HAS_NORM)  # fmt: skip
    elif HAS_K:
        h0 = (i_hb - n_qb) * BLOCK_H
        if SLOTS:
            row = tl.load(p_slot + i_t).to(tl.int64)
        elif TO_CACHE:
            row = pos_i
        else:
            row = i_t
        _rope_heads(p_k + i_t * sk_t, p_ko + row * sko_t, p_inv_freq, pos, h0,
                    sk_h, sko_h, HK, D, R, p_kn, eps, NEOX, BLOCK_H, BLOCK_D, HAS_NORM)  # fmt: skip
        if TO_CACHE:
            _copy_heads(p_v + i_t * sv_t, p_vo + row * svo_t, h0, sv_h, svo_h, HK, D,
                        BLOCK_H, BLOCK_D)  # fmt: skip


def rope_inv_freq(
    rope_dim: int,
    base: float,
    scale: float = 1.0,
    freq_factors: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """float32 ``[rope_dim / 2]``: scale * base^(-2i/rope_dim) / freq_factors[i], computed in
    float64 (as the reference) and rounded once. Compute it once per model."""
    if rope_dim <= 0 or rope_dim % 2:
        raise ValueError(f"rope_inv_freq: rope_dim must be a positive even number, got {rope_dim}")
    i = torch.arange(0, rope_dim, 2, dtype=torch.float64)
    inv = scale * base ** (-i / rope_dim)
    if freq_factors is not None:
        if freq_factors.shape != (rope_dim // 2,):
            raise ValueError(
                f"rope_inv_freq: freq_factors must be [{rope_dim // 2}], got "
                f"{tuple(freq_factors.shape)}"
            )
        inv = inv / freq_factors.detach().cpu().to(torch.float64)
    return inv.to(torch.float32).to(device)


def rope_params(who: str, d: int, device: torch.device, inv_freq: torch.Tensor, rope_type: str,
                head_norms: tuple[torch.Tensor, torch.Tensor, float] | None) -> tuple:
    """The rotation's arguments checked for heads of ``d`` dims on ``device``: (R, q head-norm
    weight, k head-norm weight, eps), inv_freq standing in for absent weights (never read).
    Shared by ``apply_rope`` and the decode attention that rotates its own q and key."""
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{who}: unknown rope type {rope_type!r}")
    r = 2 * inv_freq.shape[0]
    if inv_freq.dim() != 1 or inv_freq.dtype != torch.float32 or not 0 < r <= d:
        raise ValueError(f"{who}: inv_freq must be float32 [R/2] with R <= {d}, got "
                         f"{inv_freq.dtype} {tuple(inv_freq.shape)}")  # fmt: skip
    if inv_freq.device != device:
        raise ValueError(f"{who}: inv_freq is on {inv_freq.device}, q on {device}")
    if head_norms is None:
        return r, inv_freq, inv_freq, 0.0
    qn, kn, eps = head_norms
    for name, t in (("q", qn), ("k", kn)):
        if t.shape != (d,) or t.device != device:
            raise ValueError(f"{who}: the {name} head-norm weight must be [{d}] on {device}, "
                             f"got {tuple(t.shape)} on {t.device}")  # fmt: skip
    return r, qn, kn, eps


def _check_heads(name: str, t: torch.Tensor) -> None:
    if t.dim() != 3:
        raise ValueError(f"apply_rope: {name} must be [T, H, D], got shape {tuple(t.shape)}")
    if t.stride(2) != 1:
        raise ValueError(f"apply_rope: {name}'s last dimension must be contiguous")


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor | None,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    rope_type: str,
    inplace: bool = False,
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    head_norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    slots: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotate q ``[T, Hq, D]`` and k ``[T, Hk, D]`` (or None) at ``positions`` ``[T]`` (int).

    ``head_norms=(q_weight, k_weight, eps)``: every head of q and k RMS-normalized over its D
    dims first (qwen3's / gemma3's qk-norm, weights ``[D]``), in the same launch.

    ``cache=(v, k_cache, v_cache)``: the rotated k and v ``[T, Hk, D]`` are stored straight
    into the layer's cache ``[S, Hk, D]`` at rows ``positions`` (decode: one launch instead of
    rotate + two scatters); returns ``(q', k_cache)``. ``slots`` (int32/int64 ``[T]`` on the
    device, with ``cache`` only): the rows are ``slots[t]`` instead (a paged cache's pools
    ``[n_slots, Hk, D]``, deimos.kernels.attention.slots_of); positions still give the angles.

    inv_freq: float32 ``[R/2]`` from ``rope_inv_freq`` (R = rope dims <= D; dims >= R are left
    as they are). rope_type: "norm" (adjacent pairs) or "neox" (halves). q and k may be strided
    views (e.g. of a fused qkv output), last dim contiguous. Returns ``(q', k')``: q and k
    themselves when ``inplace``, new contiguous tensors otherwise.
    """
    _check_heads("q", q)
    n_t, hq, d = q.shape
    if k is not None:
        _check_heads("k", k)
        if k.shape[0] != n_t or k.shape[2] != d:
            raise ValueError(f"apply_rope: k {tuple(k.shape)} does not match q {tuple(q.shape)}")
    if positions.shape != (n_t,) or positions.dtype.is_floating_point:
        raise ValueError(f"apply_rope: positions must be integer [{n_t}], got "
                         f"{positions.dtype} {tuple(positions.shape)}")  # fmt: skip
    r, qn, kn, eps = rope_params("apply_rope", d, q.device, inv_freq, rope_type, head_norms)
    for name, t in (("k", k), ("positions", positions)):
        if t is not None and t.device != q.device:
            raise ValueError(f"apply_rope: {name} is on {t.device}, q on {q.device}")
    qo = q if inplace else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if cache is not None:
        v, ko, vo = cache
        if k is None or v.shape != k.shape or ko.shape[1:] != k.shape[1:] or vo.shape != ko.shape:
            raise ValueError("apply_rope: cache needs k, v [T, Hk, D] and caches [S, Hk, D]")
        for name, t in (("v", v), ("k_cache", ko), ("v_cache", vo)):
            if t.device != q.device or t.stride(2) != 1:
                raise ValueError(f"apply_rope: {name} must be on {q.device}, last dim contiguous")
        ints = (torch.int32, torch.int64)
        if slots is not None and (slots.shape != (n_t,) or slots.dtype not in ints
                                  or slots.device != q.device):  # fmt: skip
            raise ValueError(f"apply_rope: slots must be int32/int64 [{n_t}] on {q.device}, got "
                             f"{slots.dtype} {tuple(slots.shape)} on {slots.device}")  # fmt: skip
    else:
        if slots is not None:
            raise ValueError("apply_rope: slots need cache=(v, k_cache, v_cache)")
        ko = k if k is None or inplace else torch.empty(k.shape, dtype=k.dtype, device=k.device)
        v = vo = None
    if n_t == 0:
        return qo, ko
    kk, kko = (k, ko) if k is not None else (q, qo)
    vv, vvo = (v, vo) if v is not None else (kk, kko)
    hk = kk.shape[1] if k is not None else 0
    block_h = 4
    blocks = triton.cdiv(hq, block_h) + triton.cdiv(hk, block_h)
    _rope_kernel[(n_t, blocks)](
        q, kk, qo, kko, vv, vvo, positions, inv_freq, qn, kn,
        q.stride(0), q.stride(1), kk.stride(0), kk.stride(1),
        qo.stride(0), qo.stride(1), kko.stride(0), kko.stride(1),
        vv.stride(0), vv.stride(1), vvo.stride(0), vvo.stride(1),
        hq, max(hk, 1), d, r, eps,
        NEOX=rope_type == "neox", HAS_K=k is not None, TO_CACHE=cache is not None,
        BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(d), HAS_NORM=head_norms is not None,
        SLOTS=slots is not None, p_slot=slots, num_warps=4, **launch_options(pdl_on(q.device)),
    )  # fmt: skip
    return qo, ko


def rope(
    q: torch.Tensor,
    k: torch.Tensor | None,
    positions: torch.Tensor,
    rope_dim: int,
    base: float,
    rope_type: str,
    scale: float = 1.0,
    freq_factors: torch.Tensor | None = None,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``apply_rope`` with inv_freq computed here (a host computation and a copy per call:
    models should call ``rope_inv_freq`` once and ``apply_rope`` per step)."""
    inv = rope_inv_freq(rope_dim, base, scale, freq_factors, q.device)
    return apply_rope(q, k, positions, inv, rope_type, inplace)
