"""RMSNorm and the fused residual add + RMSNorm (Triton). Oracle: deimos.kernels.norm.

One program per row of ``[T, D]``; the whole row sits in registers (BLOCK_D = next power of two
of D, at most 16384), so x and the residual are read once and each output written once: the
fused step moves 2 reads + 2 writes per element, the minimum for ``residual += x; y = norm``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from deimos.quant.triton.pdl import launch_options, pdl_on, pdl_start
from deimos.kernels.triton.moe_route import COMBINE_WARPS, added_args, added_row, row_gate
from deimos.quant.triton.gemv_q8 import quantize_groups

MAX_D = 16384


@triton.jit
def _x_row(p_x, stride_x, p_mw, i_t, o_d, m_d, D, MIX: tl.constexpr, HAS_ADD: tl.constexpr, p_add,
           HAS_GATE: tl.constexpr, g):
    """Row i_t's x at columns o_d in float32: p_x's row, or with MIX = k the weighted sum of
    its k expert rows, plus with HAS_ADD the added row (times the gate ``g`` with HAS_GATE):
    moe_combine's sum, in its order (acc += w_j y_j from zero, j in order, then the added row)."""
    if MIX == 0:
        return tl.load(p_x + i_t * stride_x + o_d, mask=m_d, other=0.0).to(tl.float32)
    acc = tl.zeros(o_d.shape, dtype=tl.float32)
    for j in tl.static_range(MIX):
        w = tl.load(p_mw + i_t * MIX + j)
        acc += w * tl.load(p_x + (i_t * MIX + j) * stride_x + o_d, mask=m_d, other=0.0)
    if HAS_ADD:
        acc += added_row(p_add, i_t, D, o_d, m_d, HAS_GATE, g)
    return acc


@triton.jit
def _rms_norm_kernel(
    p_x, p_r, p_w, p_y, p_rout,
    stride_x, stride_r, stride_y, stride_rout,
    D, eps, p_xq, p_xd, p_xs,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr = False,
    p_h=None,
    HALF: tl.constexpr = False,
    MIX: tl.constexpr = 0,
    p_mw=None,
    HAS_ADD: tl.constexpr = False,
    p_add=None,
    HAS_GATE: tl.constexpr = False,
    p_gx=None,
    p_gw=None,
    stride_gx=0,
    DX=0,
    BLOCK_X: tl.constexpr = 16,
):  # fmt: skip
    """Program (row, chunk): the whole row's sum of squares, then its CHUNK elements normalized,
    stored (and the residual sum stored) and quantized. CHUNK == BLOCK_D: one program a row.
    HALF: the normalized rows also stored as float16 at p_h (contiguous ``[T, D]``). MIX = k:
    row t's x is the sum of p_x's rows t k .. t k + k - 1 weighted by p_mw[t, :], plus with
    HAS_ADD the added row (gated with HAS_GATE): moe_combine's sum, in its order."""
    pdl_start(PDL)
    i_t = tl.program_id(0).to(tl.int64)
    i_c = tl.program_id(1)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    g = row_gate(i_t, HAS_GATE, p_gx, p_gw, stride_gx, DX, BLOCK_X)  # once: both reads of the row use it
    b_x = _x_row(p_x, stride_x, p_mw, i_t, o_d, m_d, D, MIX, HAS_ADD, p_add, HAS_GATE, g)
    if HAS_RESIDUAL:
        b_r = tl.load(p_r + i_t * stride_r + o_d, mask=m_d, other=0.0).to(tl.float32)
        # round the sum to the residual's dtype first: the norm sees what is stored, as in the
        # reference (x + residual in the tensors' dtype)
        b_x = (b_x + b_r).to(p_rout.dtype.element_ty).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(b_x * b_x, axis=0) / D + eps)
    if CHUNK < BLOCK_D:  # this program's chunk again (L1/L2), the row's other chunks are others'
        o_d = i_c * CHUNK + tl.arange(0, CHUNK)
        m_d = o_d < D
        b_x = _x_row(p_x, stride_x, p_mw, i_t, o_d, m_d, D, MIX, HAS_ADD, p_add, HAS_GATE, g)
        if HAS_RESIDUAL:
            b_r = tl.load(p_r + i_t * stride_r + o_d, mask=m_d, other=0.0).to(tl.float32)
            b_x = (b_x + b_r).to(p_rout.dtype.element_ty).to(tl.float32)
    if HAS_RESIDUAL:
        tl.store(p_rout + i_t * stride_rout + o_d, b_x.to(p_rout.dtype.element_ty), mask=m_d)
    b_w = tl.load(p_w + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_y = (b_x * rstd * b_w).to(p_y.dtype.element_ty)
    tl.store(p_y + i_t * stride_y + o_d, b_y, mask=m_d)
    if HALF:
        tl.store(p_h + i_t * D + o_d, b_y.to(tl.float16), mask=m_d)
    if QUANT:  # the chunk also as the GEMV's integer activation (gemv_q8.quantize_groups)
        G: tl.constexpr = CHUNK // 32
        o_g = i_c * G + tl.arange(0, G)
        quantize_groups(tl.reshape(b_y.to(tl.float32), (G, 4, 8)), o_g, o_g < D // 32,
                        p_xq + i_t * (D // 2), p_xd + i_t * (D // 32), p_xs + i_t * (D // 16))


class NormConfig(NamedTuple):
    block_d: int
    num_warps: int
    chunk: int  # elements a program normalizes and stores (block_d: the whole row)


SPLIT_CHUNK = 256  # a decode row (T <= 8) split into programs of 256 elements (8 groups)


def norm_config(d: int, t: int = 1, split: bool = False) -> NormConfig:
    """A row per program; warps grow with the row so each thread holds 8..16 elements
    (D = 4096: 8 warps x 32 threads x 16), and never fewer than a gated sum's norm takes
    (COMBINE_WARPS): up to D = 2048 a row's sum of squares is then summed in one order with or
    without an experts' gated sum in the launch (the deferred and the combined MoE give the same
    bits; the H100 found 1-warp rows differing in the last bit, session 49). Memory bound: no
    tuning beyond that. ``split``
    (few rows, output not aliasing an input): each row over D / 256 programs of 4 warps that
    all read the row for its sum of squares and store a chunk each, instead of one program
    doing a decode step's whole row alone."""
    block = triton.next_power_of_2(d)
    if split and t <= 8 and block >= 2 * SPLIT_CHUNK:
        return NormConfig(block, 4, SPLIT_CHUNK)
    return NormConfig(block, max(COMBINE_WARPS, min(16, block // 512)), block)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' storage ranges meet (then a program could read a row another has
    already written)."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1 = a0 + a.untyped_storage().nbytes()
    b1 = b0 + b.untyped_storage().nbytes()
    return a0 < b1 and b0 < a1


def _check_rows(name: str, t: torch.Tensor, d: int) -> None:
    if t.dim() != 2 or t.shape[1] != d:
        raise ValueError(f"{name}: expected [T, {d}], got shape {tuple(t.shape)}")
    if t.stride(1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous (stride {t.stride()})")


def _launch(x, residual, w, eps, out, residual_out, quantized=None, half=None, mix=None,
            added: dict | None = None) -> None:
    t, d = out.shape
    r = residual if residual is not None else x
    ro = residual_out if residual_out is not None else out
    ins = [x] if residual is None else [x, residual]
    # the experts' sum also reads its added row and the gate's x in every program of a row
    ins += [added[k] for k in ("p_add", "p_gx") if added and k in added]
    outs = [out] if residual_out is None else [out, residual_out]
    split = not any(_overlap(a, b) for a in ins for b in outs)
    cfg = norm_config(d, t, split)
    if added and added.get("HAS_GATE"):
        # the gate's dot in moe_combine's layout: the combine's bits, and a split decode row's
        # the same as a prompt row's (compiled for sm_90 at D 2048 and 4096: no spills)
        cfg = cfg._replace(num_warps=COMBINE_WARPS)
    if quantized is not None and (d % 32 or tuple(quantized.shape) != (t, d)):
        raise ValueError(f"rms_norm: quantized output {tuple(quantized.shape)} does not fit [{t}, {d}] "
                         "(D a multiple of 32)")
    q = quantized if quantized is not None else (x, x, x)
    if half is not None and (half.dtype != torch.float16 or tuple(half.shape) != (t, d)
                             or not half.is_contiguous() or half.device != x.device):  # fmt: skip
        raise ValueError(f"rms_norm: half output must be contiguous float16 [{t}, {d}] on {x.device}, got "
                         f"{half.dtype} {tuple(half.shape)} on {half.device}")  # fmt: skip
    _rms_norm_kernel[(t, triton.cdiv(d, cfg.chunk))](
        x, r, w, out, ro,
        x.stride(0), r.stride(0), out.stride(0), ro.stride(0),
        d, eps, q[0], q[1], q[2],
        HAS_RESIDUAL=residual is not None, BLOCK_D=cfg.block_d, QUANT=quantized is not None,
        CHUNK=cfg.chunk, num_warps=cfg.num_warps, p_h=half if half is not None else out,
        HALF=half is not None, MIX=0 if mix is None else mix.shape[1], p_mw=mix, **(added or {}),
        **launch_options(pdl_on(x.device)),
    )  # fmt: skip


def _validate(x: torch.Tensor, w: torch.Tensor, who: str) -> int:
    if x.dim() != 2:
        raise ValueError(f"{who}: x must be [T, D], got shape {tuple(x.shape)}")
    d = x.shape[1]
    if w.shape != (d,):
        raise ValueError(f"{who}: weight must be [{d}], got shape {tuple(w.shape)}")
    if not 0 < d <= MAX_D:
        raise ValueError(f"{who}: D = {d} not in 1..{MAX_D}")
    if x.device != w.device:
        raise ValueError(f"{who}: x is on {x.device}, weight on {w.device}")
    _check_rows(f"{who}: x", x, d)
    return d


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None,
    quantized=None, half: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight, in float32, stored in x's dtype.

    x: ``[T, D]`` fp16/bf16/fp32 (rows may be strided, the last dim contiguous); weight: ``[D]``.
    out: optional ``[T, D]`` (written in full). Returns ``[T, D]``. ``quantized``, ``half``:
    as in ``add_rms_norm``.
    """
    d = _validate(x, weight, "rms_norm")
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _check_rows("rms_norm: out", out, d)
    if x.shape[0]:
        _launch(x, None, weight, eps, out, None, quantized, half)
    return out


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    quantized=None,
    half: torch.Tensor | None = None,
    mix: torch.Tensor | None = None,
    add: torch.Tensor | None = None,
    gate: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused residual step: r' = x + residual (or x when residual is None);
    returns ``(rms_norm(r'), r')``.

    x, residual: ``[T, D]``; weight: ``[D]``. ``residual_out`` may be ``residual`` itself (in
    place: each row is read before it is written). Without a residual this is ``rms_norm`` and
    ``r'`` is x itself (no copy). ``quantized``: a ``QuantizedX`` (gemv_q8.empty_quantized)
    that also receives the output rows as the GEMV's integer activation. ``half``: a
    contiguous float16 ``[T, D]`` that also receives them rounded to float16 (what the
    tensor-core matmuls of a batch read; the same values as ``out.half()``).
    ``mix``: contiguous float32 ``[T, k]`` routing weights; x is then the contiguous float32
    ``[T k, D]`` rows of each token's k experts, and x + residual becomes their weighted sum +
    residual (``moe_combine(x, mix)`` + residual, the same bits: the combine in this launch);
    r' is then a new tensor even without a residual. ``add``, ``gate`` (with ``mix``): a row
    added to the sum, scaled by its gate, as ``moe_combine``'s (a shared expert's output).
    """
    if mix is None:
        if add is not None or gate is not None:
            raise ValueError("add_rms_norm: add and gate go with mix (the experts' sum)")
        d = _validate(x, weight, "add_rms_norm")
        if residual is None:
            return rms_norm(x, weight, eps, out, quantized, half), x
        t, added, rows = x.shape[0], None, f"x {tuple(x.shape)}"
    else:
        t, d, added = _mix_args(x, mix, weight, add, gate)
        rows = f"the {t} tokens of mix"
        if residual is None:  # the kernel's residual path adds zeros: the sum itself is stored as r'
            residual = torch.zeros((t, d), dtype=x.dtype, device=x.device)
    _check_rows("add_rms_norm: residual", residual, d)
    if residual.shape[0] != t or residual.device != x.device:
        raise ValueError(f"add_rms_norm: residual {tuple(residual.shape)} on {residual.device} does not match "
                         f"{rows} on {x.device}")  # fmt: skip
    if out is None:
        out = torch.empty((t, d), dtype=(x if mix is None else residual).dtype, device=x.device)
    if residual_out is None:
        residual_out = torch.empty((t, d), dtype=residual.dtype, device=x.device)
    _check_rows("add_rms_norm: out", out, d)
    _check_rows("add_rms_norm: residual_out", residual_out, d)
    if out.shape[0] != t or residual_out.shape[0] != t:
        raise ValueError(f"add_rms_norm: out {tuple(out.shape)} / residual_out {tuple(residual_out.shape)} "
                         f"are not the {t} {'rows of x' if mix is None else 'tokens of mix'}")  # fmt: skip
    if t:
        _launch(x, residual, weight, eps, out, residual_out, quantized, half, mix=mix, added=added)
    return out, residual_out


def _mix_args(y, mix, weight, add, gate) -> tuple[int, int, dict]:
    """add_rms_norm's checks of the experts' rows ``y``, their weights ``mix`` and an added
    row and its gate -> (T, D, the added row's kernel arguments)."""
    if mix.dim() != 2 or mix.dtype != torch.float32 or not mix.is_contiguous():
        raise ValueError(f"add_rms_norm: mix must be contiguous float32 [T, k], got {mix.dtype} "
                         f"{tuple(mix.shape)}")  # fmt: skip
    t, k = mix.shape
    if not 1 <= k <= 64:
        raise ValueError(f"add_rms_norm: mix of k = {k} experts, not in 1..64")
    if y.dim() != 2 or y.shape[0] != t * k or y.dtype != torch.float32 or not y.is_contiguous():
        raise ValueError(f"add_rms_norm: with mix, x must be contiguous float32 [{t * k}, D] (T * k rows), "
                         f"got {y.dtype} {tuple(y.shape)}")  # fmt: skip
    d = _validate(y, weight, "add_rms_norm")
    if mix.device != y.device:
        raise ValueError(f"add_rms_norm: mix is on {mix.device}, x on {y.device}")
    return t, d, added_args("add_rms_norm", t, d, y.device, add, gate)
