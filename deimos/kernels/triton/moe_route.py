"""The two ends of a mixture-of-experts layer on the device (Triton): the router (softmax over
the experts, top-k, renormalization) and the combine (the k expert outputs of each token summed
with their weights). Oracles: deimos.kernels.moe (``moe_route_reference``,
``moe_combine_reference``).

``moe_route``: one program a token, the row's E <= 512 logits in registers; k <= 16 rounds of
(max, lowest id holding it, masked out), so equal logits go lowest id first, as a stable sort.
The selection compares logits, not probabilities (the same order, without the rounding of
exp). Nothing goes back to the host: ids and weights stay on the device for the expert kernels
(a decode step stays one CUDA graph).

``moe_combine``: out[t] = sum_j w[t, j] y[t k + j] (+ add[t]) in a fixed order (j = 0..k-1,
deterministic), stored as float32 or fp16. The weights are applied here rather than in the
down projection's kernels: those store each pair's row as gemv_q8 / the grouped GEMM compute
it (one program a pair: a fused sum would need atomics into a zeroed output, an extra launch
and a run-to-run varying order), and this pass also takes the rows the CPU computed for
experts not on the device (``add``). It moves T k D floats once: 64 KB a token at D = 2048,
k = 8. With ``gate=(x, g)`` the added row is first scaled by sigmoid(x[t] . g): qwen35moe's
and qwen3next's gated shared expert summed in the same launch (kernels.triton.shared_gate's
work, one launch a layer fewer); each program recomputes the token's dot over x's row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deimos.quant.triton.pdl import launch_options, pdl_on, pdl_start

MAX_EXPERTS = 512
MAX_TOP_K = 16
_BIG_ID = tl.constexpr(2147483647)


@triton.jit
def _topk_store(b_l, o_e, m_e, p_w, p_ids, i_t, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                RENORM: tl.constexpr):
    """Token i_t's logits ``b_l`` (``m_e``: the experts that exist): softmax, the TOP_K
    largest (ties: lowest id), weights renormalized over them when RENORM; stored."""
    mx = tl.max(b_l, axis=0)
    total = tl.sum(tl.where(m_e, tl.exp(b_l - mx), 0.0), axis=0)
    o_k = tl.arange(0, K_PAD)
    b_w = tl.zeros([K_PAD], dtype=tl.float32)
    b_i = tl.zeros([K_PAD], dtype=tl.int32)
    m_left = m_e  # experts not chosen yet
    for j in tl.static_range(TOP_K):
        v = tl.max(tl.where(m_left, b_l, float("-inf")), axis=0)
        idx = tl.min(tl.where(m_left & (b_l == v), o_e, _BIG_ID), axis=0)
        b_w = tl.where(o_k == j, tl.exp(v - mx), b_w)
        b_i = tl.where(o_k == j, idx, b_i)
        m_left = m_left & (o_e != idx)
    if RENORM:
        b_w = b_w / tl.sum(b_w, axis=0)
    else:
        b_w = b_w / total
    m_k = o_k < TOP_K
    tl.store(p_w + i_t * TOP_K + o_k, b_w, mask=m_k)
    tl.store(p_ids + i_t * TOP_K + o_k, b_i, mask=m_k)


@triton.jit
def _route_kernel(p_logits, p_w, p_ids, E, stride_t, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                  BLOCK_E: tl.constexpr, RENORM: tl.constexpr, PDL: tl.constexpr = False):
    """Token i_t: ``_topk_store`` of its E logits."""
    pdl_start(PDL)
    i_t = tl.program_id(0).to(tl.int64)
    o_e = tl.arange(0, BLOCK_E)
    m_e = o_e < E
    b_l = tl.load(p_logits + i_t * stride_t + o_e, mask=m_e, other=float("-inf")).to(tl.float32)
    _topk_store(b_l, o_e, m_e, p_w, p_ids, i_t, TOP_K, K_PAD, RENORM)


def moe_route(logits: torch.Tensor, k: int, renorm: bool,
              out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The router: logits float32 ``[T, E]`` (rows may be strided, unit column stride; E <=
    512) -> (weights float32 ``[T, k]``, ids int32 ``[T, k]``), in descending order of logit
    (equal logits: lower expert id first). weights = softmax(logits) of the k chosen,
    divided by their sum when ``renorm`` (qwen3moe's norm_topk_prob). ``out``: optional
    (weights, ids) buffers of those shapes and dtypes, contiguous, written in full."""
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"moe_route: logits must be float32 [T, E], got {logits.dtype} "
                         f"{tuple(logits.shape)}")  # fmt: skip
    t, e = logits.shape
    if not 1 <= e <= MAX_EXPERTS:
        raise ValueError(f"moe_route: E = {e} experts not in 1..{MAX_EXPERTS}")
    if not (isinstance(k, int) and 1 <= k <= min(e, MAX_TOP_K)):
        raise ValueError(f"moe_route: k = {k} not in 1..min(E = {e}, {MAX_TOP_K})")
    if logits.stride(1) != 1 and e > 1:
        raise ValueError("moe_route: logits need unit column stride")
    if out is None:
        out = (torch.empty((t, k), dtype=torch.float32, device=logits.device),
               torch.empty((t, k), dtype=torch.int32, device=logits.device))  # fmt: skip
    weights, ids = out
    for name, buf, dt in (("weights", weights, torch.float32), ("ids", ids, torch.int32)):
        if buf.shape != (t, k) or buf.dtype != dt or not buf.is_contiguous() or buf.device != logits.device:
            raise ValueError(f"moe_route: out {name} must be contiguous {dt} [{t}, {k}] on "
                             f"{logits.device}, got {buf.dtype} {tuple(buf.shape)}")  # fmt: skip
    if t:
        _route_kernel[(t,)](
            logits, weights, ids, e, logits.stride(0), TOP_K=k, K_PAD=triton.next_power_of_2(k),
            BLOCK_E=max(16, triton.next_power_of_2(e)), RENORM=bool(renorm),
            num_warps=1 if e <= 128 else 4, **launch_options(pdl_on(logits.device)),
        )  # fmt: skip
    return weights, ids


@triton.jit
def _combine_kernel(p_y, p_w, p_add, p_out, D, TOP_K: tl.constexpr, BLOCK_D: tl.constexpr,
                    HAS_ADD: tl.constexpr = False, PDL: tl.constexpr = False, HAS_GATE: tl.constexpr = False,
                    p_gx=None, p_gw=None, stride_gx=0, DX=0, BLOCK_X: tl.constexpr = 16):
    """Token i_t, columns i_d BLOCK_D ..: sum_j w[t, j] y[t TOP_K + j] (+ add[t], times
    sigmoid(gx[t] . gw) with HAS_GATE)."""
    pdl_start(PDL)
    i_t = tl.program_id(0).to(tl.int64)
    o_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        w = tl.load(p_w + i_t * TOP_K + j)
        acc += w * tl.load(p_y + (i_t * TOP_K + j) * D + o_d, mask=m_d, other=0.0)
    if HAS_ADD:
        g = row_gate(i_t, HAS_GATE, p_gx, p_gw, stride_gx, DX, BLOCK_X)
        acc += added_row(p_add, i_t, D, o_d, m_d, HAS_GATE, g)
    tl.store(p_out + i_t * D + o_d, acc.to(p_out.dtype.element_ty), mask=m_d)


@triton.jit
def row_gate(i_t, HAS_GATE: tl.constexpr, p_gx, p_gw, stride_gx, DX, BLOCK_X: tl.constexpr):
    """Token i_t's gate sigmoid(gx[t] . gw), the dot in float32, BLOCK_X columns a step (0.0
    without HAS_GATE: unused then). What the combine scales its added row by; the
    add_rms_norm that takes the sum computes it the same way, once a program."""
    if HAS_GATE:
        dot = tl.zeros([BLOCK_X], dtype=tl.float32)
        for c0 in range(0, DX, BLOCK_X):
            o_x = c0 + tl.arange(0, BLOCK_X)
            m_x = o_x < DX
            b_x = tl.load(p_gx + i_t * stride_gx + o_x, mask=m_x, other=0.0).to(tl.float32)
            dot += b_x * tl.load(p_gw + o_x, mask=m_x, other=0.0)
        g = tl.sigmoid(tl.sum(dot, axis=0))
    else:
        g = 0.0
    return g


@triton.jit
def added_row(p_add, i_t, D, o_d, m_d, HAS_GATE: tl.constexpr, g):
    """Token i_t's added row add[t] at columns o_d, times its gate ``g`` (``row_gate``) with
    HAS_GATE: what the combine adds to the experts' sum."""
    b_add = tl.load(p_add + i_t * D + o_d, mask=m_d, other=0.0)
    if HAS_GATE:
        b_add = b_add * g
    return b_add


COMBINE_BLOCK = 1024
# moe_combine's warps; a kernel that also gates an added row (``row_gate``) launches with
# these, so the gate's dot is summed over the same layout, in the same order, to the same bits
COMBINE_WARPS = 4


def added_args(who: str, t: int, d: int, device: torch.device, add: torch.Tensor | None,
               gate: tuple[torch.Tensor, torch.Tensor] | None) -> dict:
    """The checks of an added row (``add`` float32 contiguous ``[T, D]``) and its gate (x float
    ``[T, Dx]`` with unit column stride, g float32 contiguous ``[Dx]``; needs ``add``), and the
    kernel arguments ``row_gate`` and ``added_row`` take (with HAS_ADD)."""
    if add is None:
        if gate is not None:
            raise ValueError(f"{who}: a gate scales the added rows: it needs add")
        return {}
    if add.shape != (t, d) or add.dtype != torch.float32 or not add.is_contiguous():
        raise ValueError(f"{who}: add must be contiguous float32 [{t}, {d}], got {add.dtype} "
                         f"{tuple(add.shape)}")  # fmt: skip
    kw = dict(HAS_ADD=True, p_add=add)
    if gate is not None:
        gx, gw = gate
        if gx.dim() != 2 or gx.shape[0] != t or not gx.dtype.is_floating_point or gx.stride(1) != 1:
            raise ValueError(f"{who}: gate x must be float [{t}, Dx] with unit column stride, "
                             f"got {gx.dtype} {tuple(gx.shape)}")  # fmt: skip
        if gw.shape != (gx.shape[1],) or gw.dtype != torch.float32 or not gw.is_contiguous():
            raise ValueError(f"{who}: gate weight must be contiguous float32 [{gx.shape[1]}], "
                             f"got {gw.dtype} {tuple(gw.shape)}")  # fmt: skip
        kw.update(HAS_GATE=True, p_gx=gx, p_gw=gw, stride_gx=gx.stride(0), DX=gx.shape[1],
                  BLOCK_X=min(COMBINE_BLOCK, max(16, triton.next_power_of_2(gx.shape[1]))))
    for name, a in (("add", add), ("gate x", gate[0] if gate else None), ("gate weight", gate[1] if gate else None)):
        if a is not None and a.device != device:
            raise ValueError(f"{who}: {name} is on {a.device}, the rows on {device}")
    return kw


def moe_combine(y: torch.Tensor, weights: torch.Tensor, add: torch.Tensor | None = None,
                out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
                gate: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The experts' outputs summed per token with the router's weights.

    y: float32 ``[T * k, D]`` (pair p = t k + j: token t's choice j; rows of experts not on the
    device are 0), weights: float32 ``[T, k]``, add: optional float32 ``[T, D]`` added (the
    pairs the CPU computed, already weighted; or a residual; or a shared expert's output).
    ``gate``: optional (x float ``[T, Dx]`` with unit column stride, g float32 ``[Dx]``):
    add[t] is scaled by sigmoid(x[t] . g) first (deimos.models.moe.shared_gate_add's sum; needs
    ``add``). Returns ``out`` (``dtype``: float32 or float16, contiguous ``[T, D]``; new unless
    given), computed in float32."""
    if weights.dim() != 2 or weights.dtype != torch.float32 or not weights.is_contiguous():
        raise ValueError(f"moe_combine: weights must be contiguous float32 [T, k], got "
                         f"{weights.dtype} {tuple(weights.shape)}")  # fmt: skip
    t, k = weights.shape
    if y.dim() != 2 or y.shape[0] != t * k or y.dtype != torch.float32 or not y.is_contiguous():
        raise ValueError(f"moe_combine: y must be contiguous float32 [{t * k}, D] (T * k rows), "
                         f"got {y.dtype} {tuple(y.shape)}")  # fmt: skip
    if not 1 <= k <= MAX_TOP_K:
        raise ValueError(f"moe_combine: k = {k} not in 1..{MAX_TOP_K}")
    d = y.shape[1]
    if out is None:
        if dtype not in (torch.float32, torch.float16):
            raise ValueError(f"moe_combine: dtype must be float32 or float16, got {dtype}")
        out = torch.empty((t, d), dtype=dtype, device=y.device)
    elif out.shape != (t, d) or out.dtype not in (torch.float32, torch.float16) or not out.is_contiguous():
        raise ValueError(f"moe_combine: out must be contiguous float32/float16 [{t}, {d}], got "
                         f"{out.dtype} {tuple(out.shape)}")  # fmt: skip
    gkw = added_args("moe_combine", t, d, y.device, add, gate)
    for name, a in (("weights", weights), ("out", out)):
        if a.device != y.device:
            raise ValueError(f"moe_combine: {name} is on {a.device}, y on {y.device}")
    if t and d:
        block = min(COMBINE_BLOCK, max(16, triton.next_power_of_2(d)))
        gkw.setdefault("p_add", y)
        _combine_kernel[(t, triton.cdiv(d, block))](
            y, weights, gkw.pop("p_add"), out, d, TOP_K=k, BLOCK_D=block, num_warps=COMBINE_WARPS,
            **launch_options(pdl_on(y.device)), **gkw,
        )  # fmt: skip
    return out
