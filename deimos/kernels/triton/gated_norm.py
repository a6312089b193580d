"""The Gated DeltaNet block's output norm (Triton): y = rms_norm(o) * weight * SiLU(z) per
value head, in one launch instead of a norm, a SiLU, a product and the casts around them.
Oracle: deimos.kernels.norm.gated_rms_norm (the CPU block's).

Program: BLOCK_R (token, head) rows of Dh elements; o's rows are contiguous, z's are read
through its strides (the gate projection's columns of a packed linear's output). With
``quantized`` the output is also written as the GEMV's integer activation (gemv_q8's
``quantize_groups``: a row's groups of 32 lie within one head's Dh), so the output
projection's decode GEMV reads it without a ``quantize_x`` launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deimos.kernels.triton._head_rows import head_rows, quantize_head_rows
from deimos.quant.triton.gemv_q8 import QuantizedX
from deimos.quant.triton.pdl import launch_options, pdl_on, pdl_start


@triton.jit
def _gated_norm_kernel(p_o, p_z, stride_zt, p_w, p_y, n_rows, eps, p_xq, p_xd, p_xs,
                       HV: tl.constexpr, DH: tl.constexpr, BLOCK_R: tl.constexpr,
                       QUANT: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    o_r, m_r, o_d = head_rows(n_rows, BLOCK_R, DH)
    b_o = tl.load(p_o + o_r[:, None] * DH + o_d[None, :], mask=m_r[:, None], other=0.0)
    b_o = b_o.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(b_o * b_o, axis=1) / DH + eps)
    b_w = tl.load(p_w + o_d).to(tl.float32)
    p_zr = p_z + (o_r // HV) * stride_zt + (o_r % HV) * DH
    b_z = tl.load(p_zr[:, None] + o_d[None, :], mask=m_r[:, None], other=0.0).to(tl.float32)
    b_y = b_o * rstd[:, None] * b_w[None, :] * (b_z * tl.sigmoid(b_z))
    tl.store(p_y + o_r[:, None] * DH + o_d[None, :], b_y, mask=m_r[:, None])
    if QUANT:
        quantize_head_rows(b_y, n_rows, p_xq, p_xd, p_xs, BLOCK_R, DH)


def rms_norm_gated(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                   quantized: QuantizedX | None = None) -> torch.Tensor:
    """``rms_norm(o) * weight * silu(z)`` over each head's Dh elements: o ``[T, Hv, Dh]``
    contiguous, z ``[T, Hv, Dh]`` with heads Dh apart and contiguous elements (any row
    stride), weight ``[Dh]``; Dh a power of two. Returns ``[T, Hv * Dh]`` float32.
    ``quantized``: a ``QuantizedX`` of ``[T, Hv * Dh]`` (gemv_q8.empty_quantized; Dh a
    multiple of 32) that also receives the output as the GEMV's integer activation."""
    if o.dim() != 3 or not o.is_contiguous():
        raise ValueError(f"rms_norm_gated: o {tuple(o.shape)} is not a contiguous [T, Hv, Dh]")
    t, hv, dh = o.shape
    if z.shape != o.shape or z.stride(2) != 1 or (hv > 1 and z.stride(1) != dh):
        raise ValueError(f"rms_norm_gated: z {tuple(z.shape)} (strides {z.stride()}) is not "
                         f"[{t}, {hv}, {dh}] with heads {dh} apart")  # fmt: skip
    if weight.shape != (dh,) or dh & (dh - 1):
        raise ValueError(f"rms_norm_gated: weight {tuple(weight.shape)} is not [{dh}] with "
                         "Dh a power of two")  # fmt: skip
    if z.device != o.device or weight.device != o.device:
        raise ValueError(f"rms_norm_gated: o on {o.device}, z on {z.device}, weight on "
                         f"{weight.device}")  # fmt: skip
    if quantized is not None and (dh % 32 or tuple(quantized.xd.shape) != (t, hv * dh // 32)):
        raise ValueError(f"rms_norm_gated: quantized output {tuple(quantized.xd.shape)} scales "
                         f"do not fit [{t}, {hv * dh}] (Dh a multiple of 32)")  # fmt: skip
    y = torch.empty(t, hv * dh, dtype=torch.float32, device=o.device)
    rows = t * hv
    if rows:
        block_r = max(1, min(32, 4096 // dh))
        q = quantized if quantized is not None else (y, y, y)
        _gated_norm_kernel[(triton.cdiv(rows, block_r),)](
            o, z, z.stride(0), weight, y, rows, float(eps), q[0], q[1], q[2], HV=hv, DH=dh,
            BLOCK_R=block_r, QUANT=quantized is not None, num_warps=4,
            **launch_options(pdl_on(o.device)),
        )  # fmt: skip
    return y
