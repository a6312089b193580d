"""The Gated DeltaNet block's inputs in one launch (Triton): from the projections' raw outputs
to what the delta rule reads. Oracle: ``gdn_inputs_reference`` below (deimos.kernels.deltanet's
causal_conv1d, SiLU, l2_norm and delta_gates, as the CPU block computes them).

For N sequences packed along T (cu_seqlens, or one row each in a decode step), each with its
slot of the conv pool ``[n_slots, C, K - 1]`` float32 (the last K - 1 inputs, oldest first):
- q, k, v: SiLU of the short causal convolution of the conv input ``x [T, C]`` (C = (2 Hk +
  Hv) Dh, as [q | k | v]) with the carried inputs, then q and k l2-normed per head
  (x / sqrt(sum x^2 + eps)); the slot receives the sequence's last K - 1 inputs;
- beta = sigmoid(b) and g = softplus(alpha + dt_bias) * a, ``[T, Hv]``.

Program (group, sequence, block of BLOCK_T rows): group i < 2 Hk + Hv is one head's Dh
channels, group 2 Hk + Hv the gates. Only a sequence's first block reads its slot (BLOCK_T >=
K - 1), so that program alone also writes the slot's new carried inputs (the sequence's last
K - 1, from x or, for a sequence shorter than that, partly from the old slot). Replaces the 30-odd torch
ops a layer of the eager path (casts, the conv's shifted products, the norms' pow/sum/rsqrt,
contiguous copies, the gates) and the decode conv kernel.

b and alpha are read through [T, H1, R] views (head h = i R + j at ``p + t st + i sh + j``):
qwen35's separate [T, Hv] outputs (H1 = 1, R = Hv) and qwen3next's ssm_ba (per key head its
r betas, then its r alphas: H1 = Hk, R = Hv / Hk) alike, no copies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from deimos.kernels.deltanet import causal_conv1d, delta_gates, l2_norm
from deimos.quant.triton.pdl import launch_options, pdl_on, pdl_start

BLOCK_T = 16  # rows of a program (a decode step's one row: 1); at least K - 1


@triton.jit
def _inputs_kernel(p_x, stride_x, p_w, p_pool, p_slot, p_cu, p_snap,
                   p_b, sb_t, sb_h, p_a, sa_t, sa_h, p_dtb, p_decay,
                   p_qkv, n_rows, p_g, p_beta, eps,
                   HK: tl.constexpr, HV: tl.constexpr, DH: tl.constexpr, K: tl.constexpr,
                   R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
                   ONE_ROW: tl.constexpr, SNAP: tl.constexpr = False, PDL: tl.constexpr = False):
    """Rows i_t BLOCK_T .. of sequence i_n: head group i_c's channels (or the gates)."""
    pdl_start(PDL)
    i_c, i_n, i_t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if ONE_ROW:
        bos = i_n.to(tl.int64)
        seqlen = 1
    else:
        bos = tl.load(p_cu + i_n).to(tl.int64)
        seqlen = tl.load(p_cu + i_n + 1) - bos.to(tl.int32)
    t0 = i_t * BLOCK_T
    o_t = t0 + tl.arange(0, BLOCK_T)  # rows of the sequence
    m_t = o_t < seqlen
    rows = bos + o_t
    if t0 < seqlen:
        if i_c == 2 * HK + HV:  # the gates
            o_h = tl.arange(0, BLOCK_H)
            m_h = o_h < HV
            col_b = (o_h // R) * sb_h + o_h % R
            col_a = (o_h // R) * sa_h + o_h % R
            b_dtb = tl.load(p_dtb + o_h, mask=m_h, other=0.0).to(tl.float32)
            b_dec = tl.load(p_decay + o_h, mask=m_h, other=0.0).to(tl.float32)
            m = m_t[:, None] & m_h[None, :]
            b_b = tl.load(p_b + rows[:, None] * sb_t + col_b[None, :], mask=m, other=0.0)
            b_a = tl.load(p_a + rows[:, None] * sa_t + col_a[None, :], mask=m, other=0.0)
            b_a = b_a.to(tl.float32) + b_dtb[None, :]
            b_sp = tl.where(b_a > 20.0, b_a, tl.log(1.0 + tl.exp(tl.minimum(b_a, 20.0))))
            o = rows[:, None] * HV + o_h[None, :]
            tl.store(p_beta + o, tl.sigmoid(b_b.to(tl.float32)), mask=m)
            tl.store(p_g + o, b_sp * b_dec[None, :], mask=m)
        else:
            C: tl.constexpr = (2 * HK + HV) * DH
            slot = tl.load(p_slot + i_n).to(tl.int64)
            o_d = tl.arange(0, DH)
            o_c = i_c * DH + o_d  # this head's channels of x
            p_s = p_pool + slot * (C * (K - 1)) + o_c * (K - 1)  # tap 0 of the carried inputs
            # q, k and v: the three parts of one buffer, [T, Hk, Dh], [T, Hk, Dh], [T, Hv, Dh]
            part = (i_c >= HK).to(tl.int64) + (i_c >= 2 * HK).to(tl.int64)
            stride_o = tl.where(part == 2, HV * DH, HK * DH)
            p_o = p_qkv + part * n_rows * (HK * DH) + (i_c - part * HK) * DH
            b_y = tl.zeros([BLOCK_T, DH], dtype=tl.float32)
            for j in tl.static_range(K):  # tap j: input t - (K - 1) + j, from x or the slot
                pos = o_t - (K - 1) + j
                b_in = tl.load(p_x + (bos + pos)[:, None] * stride_x + o_c[None, :],
                               mask=(m_t & (pos >= 0))[:, None], other=0.0).to(tl.float32)
                if i_t == 0:  # only the first rows reach back into the slot
                    b_in += tl.load(p_s[None, :] + (pos + (K - 1))[:, None],
                                    mask=(m_t & (pos < 0))[:, None], other=0.0)
                b_w = tl.load(p_w + o_c * K + j).to(tl.float32)
                if j == 0:
                    b_y = b_in * b_w[None, :]
                else:
                    b_y = b_y + b_in * b_w[None, :]
            b_y = b_y * tl.sigmoid(b_y)
            if i_c < 2 * HK:
                b_y = b_y / tl.sqrt(tl.sum(b_y * b_y, axis=1) + eps)[:, None]
            tl.store(p_o + rows[:, None] * stride_o + o_d[None, :], b_y, mask=m_t[:, None])
            if i_t == 0:
                # the slot's new carried inputs, by the one program that reads the old ones:
                # inputs seqlen - (K - 1) + j of cat(slot, x), stored in order of j (input
                # j + seqlen of the old slot is read before it can be overwritten), every
                # thread past its reads of the old slot first
                tl.debug_barrier()
                if SNAP:  # the carried inputs after the snapshot row, into the snapshot slot
                    snap = tl.load(p_snap + 2 * i_n)
                    if snap > 0:
                        to = tl.load(p_snap + 2 * i_n + 1).to(tl.int64)
                        for j in tl.static_range(K - 1):
                            at = snap - (K - 1) + j
                            if at >= 0:
                                b_n = tl.load(p_x + (bos + at) * stride_x + o_c).to(tl.float32)
                            else:
                                b_n = tl.load(p_s + (at + (K - 1)))
                            tl.store(p_pool + to * (C * (K - 1)) + o_c * (K - 1) + j, b_n)
                    tl.debug_barrier()
                for j in tl.static_range(K - 1):
                    at = seqlen - (K - 1) + j
                    if at >= 0:
                        b_n = tl.load(p_x + (bos + at) * stride_x + o_c).to(tl.float32)
                    else:
                        b_n = tl.load(p_s + (at + (K - 1)))
                    tl.store(p_s + j, b_n)


def gdn_inputs(x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor,
               cu_seqlens: torch.Tensor | None, b: torch.Tensor, alpha: torch.Tensor,
               dt_bias: torch.Tensor, decay: torch.Tensor, hk: int, hv: int, dh: int, eps: float,
               max_len: int | None = None, snapshot: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [T, Hk, Dh], k [T, Hk, Dh], v [T, Hv, Dh], g [T, Hv], beta [T, Hv]), float32 and
    contiguous, for N sequences; ``pool[slots[n]]`` advanced past sequence n's inputs.

    x: ``[T, C]`` conv input (rows may be strided, channels contiguous; any float dtype),
    C = (2 Hk + Hv) Dh; weight: ``[C, K]`` contiguous, K >= 2; pool: float32 ``[n_slots, C,
    K - 1]`` contiguous; slots: int32 ``[N]`` on the device (distinct, except that padding rows
    of a decode graph may share the scratch slot); cu_seqlens: int32 ``[N + 1]`` on the device
    (0 = c_0 <= ... <= c_N <= T: rows past c_N, a padded graph's, belong to no sequence and
    their outputs are not written), or None when every sequence is one row (N = T); b, alpha:
    ``[T, H1, R]`` views with H1 R = Hv, the last dimension contiguous (see the module note);
    dt_bias, decay (ssm_a): ``[Hv]``; eps: the l2 norm's; max_len: the longest sequence's rows
    (with cu_seqlens; None: read from the device, a synchronization); snapshot: int32 ``[N,
    2]`` or None (with cu_seqlens): sequence n's carried inputs after its first ``snapshot[n,
    0]`` rows also go to slot ``snapshot[n, 1]`` (0 rows: none; a slot no sequence of the
    step holds), as gated_delta_prefill's. Dh: a power of two."""
    t = x.shape[0] if x.dim() == 2 else -1
    c = (2 * hk + hv) * dh
    if x.dim() != 2 or x.shape[1] != c or x.stride(1) != 1:
        raise ValueError(f"gdn_inputs: x {tuple(x.shape)} (strides {x.stride()}) is not [T, {c}] "
                         "with contiguous channels")  # fmt: skip
    if dh < 1 or dh & (dh - 1):
        raise ValueError(f"gdn_inputs: head dim {dh} is not a power of two")
    if weight.dim() != 2 or weight.shape[0] != c or weight.shape[1] < 2 or not weight.is_contiguous():
        raise ValueError(f"gdn_inputs: conv weight {tuple(weight.shape)} is not a contiguous "
                         f"[{c}, K] with K >= 2")  # fmt: skip
    kw = weight.shape[1]
    if kw - 1 > BLOCK_T:
        raise ValueError(f"gdn_inputs: a conv of {kw} taps reaches past one block of {BLOCK_T} rows")
    if pool.dim() != 3 or pool.shape[1:] != (c, kw - 1) or pool.dtype != torch.float32 \
            or not pool.is_contiguous():
        raise ValueError(f"gdn_inputs: conv pool {pool.dtype} {tuple(pool.shape)} is not a "
                         f"contiguous float32 [n_slots, {c}, {kw - 1}]")  # fmt: skip
    n = slots.shape[0] if slots.dim() == 1 else -1
    if slots.dtype != torch.int32 or n < 0:
        raise ValueError(f"gdn_inputs: slots {slots.dtype} {tuple(slots.shape)} is not int32 [N]")
    if cu_seqlens is None:
        if n != t:
            raise ValueError(f"gdn_inputs: {n} slots for {t} one-row sequences")
    elif cu_seqlens.dtype != torch.int32 or cu_seqlens.shape != (n + 1,):
        raise ValueError(f"gdn_inputs: cu_seqlens {cu_seqlens.dtype} {tuple(cu_seqlens.shape)} "
                         f"is not int32 [{n + 1}]")  # fmt: skip
    if snapshot is not None and (cu_seqlens is None or snapshot.dtype != torch.int32
                                 or snapshot.shape != (n, 2) or not snapshot.is_contiguous()
                                 or snapshot.device != x.device):  # fmt: skip
        raise ValueError(f"gdn_inputs: snapshot {snapshot.dtype} {tuple(snapshot.shape)} is not "
                         f"a contiguous int32 [{n}, 2] on {x.device} beside cu_seqlens")  # fmt: skip
    for name, ba in (("b", b), ("alpha", alpha)):
        if ba.dim() != 3 or ba.shape[0] != t or ba.shape[1] * ba.shape[2] != hv or ba.stride(2) != 1:
            raise ValueError(f"gdn_inputs: {name} {tuple(ba.shape)} (strides {ba.stride()}) is "
                             f"not a [{t}, H1, R] view with H1 R = {hv}, R contiguous")  # fmt: skip
    if b.shape[2] != alpha.shape[2]:
        raise ValueError(f"gdn_inputs: b {tuple(b.shape)} and alpha {tuple(alpha.shape)} group "
                         "the heads differently")  # fmt: skip
    if dt_bias.shape != (hv,) or decay.shape != (hv,):
        raise ValueError(f"gdn_inputs: dt_bias {tuple(dt_bias.shape)} and ssm_a "
                         f"{tuple(decay.shape)} are not [{hv}]")  # fmt: skip
    dev = x.device
    for name, u in (("weight", weight), ("pool", pool), ("slots", slots), ("b", b),
                    ("alpha", alpha), ("dt_bias", dt_bias), ("ssm_a", decay)):
        if u.device != dev:
            raise ValueError(f"gdn_inputs: {name} is on {u.device}, x on {dev}")
    if cu_seqlens is not None and cu_seqlens.device != dev:
        raise ValueError(f"gdn_inputs: cu_seqlens is on {cu_seqlens.device}, x on {dev}")
    f32 = {"dtype": torch.float32, "device": dev}
    qkv = torch.empty(t * c, **f32)
    q, k = qkv[: t * hk * dh].view(t, hk, dh), qkv[t * hk * dh : 2 * t * hk * dh].view(t, hk, dh)
    v = qkv[2 * t * hk * dh :].view(t, hv, dh)
    g, beta = torch.empty(t, hv, **f32), torch.empty(t, hv, **f32)
    if cu_seqlens is None:
        max_len = 1
    elif max_len is None:
        max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if n else 0
    if n and t and max_len > 0:
        block_t = 1 if cu_seqlens is None else BLOCK_T
        _inputs_kernel[(2 * hk + hv + 1, n, triton.cdiv(max_len, block_t))](
            x, x.stride(0), weight, pool, slots, slots if cu_seqlens is None else cu_seqlens,
            slots if snapshot is None else snapshot,
            b, b.stride(0), b.stride(1), alpha, alpha.stride(0), alpha.stride(1), dt_bias, decay,
            qkv, t, g, beta, float(eps), HK=hk, HV=hv, DH=dh, K=kw, R=b.shape[2],
            BLOCK_H=triton.next_power_of_2(hv), BLOCK_T=block_t, ONE_ROW=cu_seqlens is None,
            SNAP=snapshot is not None, num_warps=8, **launch_options(pdl_on(dev)),
        )  # fmt: skip
    return q, k, v, g, beta


def gdn_inputs_reference(x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor,
                         slots: torch.Tensor, cu_seqlens: torch.Tensor | None, b: torch.Tensor,
                         alpha: torch.Tensor, dt_bias: torch.Tensor, decay: torch.Tensor,
                         hk: int, hv: int, dh: int, eps: float,
                         snapshot: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``gdn_inputs`` sequence by sequence in torch (same arguments, pool advanced in place)."""
    t = x.shape[0]
    cu = list(range(t + 1)) if cu_seqlens is None else cu_seqlens.tolist()
    snaps = [(0, 0)] * len(cu) if snapshot is None else snapshot.tolist()
    y = torch.empty(t, x.shape[1], dtype=torch.float32, device=x.device)
    for i, slot in enumerate(slots.tolist()):
        rows = slice(cu[i], cu[i + 1])
        at, to = snaps[i]
        if at > 0:  # the carried inputs after the first ``at`` rows, from the old slot and x
            _, state = causal_conv1d(x[cu[i] : cu[i] + at].float(), weight.float(), pool[slot].t())
            pool[to] = state.t()
        if cu[i + 1] > cu[i]:
            y[rows], state = causal_conv1d(x[rows].float(), weight.float(), pool[slot].t())
            pool[slot] = state.t()
    y = F.silu(y)

    q = l2_norm(y[:, : hk * dh].reshape(t, hk, dh), eps)
    k = l2_norm(y[:, hk * dh : 2 * hk * dh].reshape(t, hk, dh), eps)
    v = y[:, 2 * hk * dh :].reshape(t, hv, dh)
    beta, g = delta_gates(b.reshape(t, hv).float(), alpha.reshape(t, hv).float(), dt_bias.float(),
                          decay.float())  # fmt: skip
    return q.contiguous(), k.contiguous(), v.contiguous(), g, beta
