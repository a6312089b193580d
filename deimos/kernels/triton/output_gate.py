"""Gated attention's output gate (Triton): y = attn * sigmoid(gate) per element, the gate read
in place from the q projection's output (qwen35's attn_q holds each head's query and then its
gate), optionally written as the output projection's integer activation too. Oracle:
deimos.kernels.activation.sigmoid_gate (the CPU block's).

Replaces a decode step's gate copy, sigmoid, product and ``quantize_x`` (four launches an
attention layer) with one. Program: BLOCK_R rows of one head's Dh elements (row r = token
r // H, head r % H).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deimos.kernels.triton._head_rows import head_rows, quantize_head_rows
from deimos.quant.triton.gemv_q8 import QuantizedX
from deimos.quant.triton.pdl import launch_options, pdl_on, pdl_start


@triton.jit
def _output_gate_kernel(p_a, p_g, stride_gt, stride_gh, p_y, n_rows, p_xq, p_xd, p_xs,
                        H: tl.constexpr, DH: tl.constexpr, BLOCK_R: tl.constexpr,
                        QUANT: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    o_r, m_r, o_d = head_rows(n_rows, BLOCK_R, DH)
    b_a = tl.load(p_a + o_r[:, None] * DH + o_d[None, :], mask=m_r[:, None], other=0.0).to(tl.float32)
    p_gr = p_g + (o_r // H) * stride_gt + (o_r % H) * stride_gh
    b_g = tl.load(p_gr[:, None] + o_d[None, :], mask=m_r[:, None], other=0.0).to(tl.float32)
    b_y = b_a * tl.sigmoid(b_g)
    tl.store(p_y + o_r[:, None] * DH + o_d[None, :], b_y.to(p_y.dtype.element_ty), mask=m_r[:, None])
    if QUANT:
        quantize_head_rows(b_y, n_rows, p_xq, p_xd, p_xs, BLOCK_R, DH)


def output_gate(attn: torch.Tensor, gate: torch.Tensor, quantized: QuantizedX | None = None
                ) -> torch.Tensor:
    """``attn * sigmoid(gate)``: attn ``[T, H * Dh]`` contiguous, gate ``[T, H, Dh]`` with
    contiguous elements (any token and head strides: a view of the q projection's output);
    Dh a power of two. Returns ``[T, H * Dh]`` in attn's dtype. ``quantized``: a
    ``QuantizedX`` of ``[T, H * Dh]`` (gemv_q8.empty_quantized; Dh a multiple of 32) that also
    receives the output as the GEMV's integer activation."""
    if gate.dim() != 3 or gate.stride(2) != 1:
        raise ValueError(f"output_gate: gate {tuple(gate.shape)} (strides {gate.stride()}) is "
                         "not [T, H, Dh] with contiguous elements")  # fmt: skip
    t, h, dh = gate.shape
    if attn.shape != (t, h * dh) or not attn.is_contiguous():
        raise ValueError(f"output_gate: attn {tuple(attn.shape)} is not a contiguous [{t}, {h * dh}]")
    if dh & (dh - 1):
        raise ValueError(f"output_gate: head dim {dh} is not a power of two")
    if gate.device != attn.device:
        raise ValueError(f"output_gate: attn on {attn.device}, gate on {gate.device}")
    if quantized is not None and (dh % 32 or tuple(quantized.xd.shape) != (t, h * dh // 32)):
        raise ValueError(f"output_gate: quantized output {tuple(quantized.xd.shape)} scales do not "
                         f"fit [{t}, {h * dh}] (Dh a multiple of 32)")  # fmt: skip
    y = torch.empty_like(attn)
    rows = t * h
    if rows:
        block_r = max(1, min(32, 4096 // dh))
        q = quantized if quantized is not None else (y, y, y)
        _output_gate_kernel[(triton.cdiv(rows, block_r),)](
            attn, gate, gate.stride(0), gate.stride(1), y, rows, q[0], q[1], q[2], H=h, DH=dh,
            BLOCK_R=block_r, QUANT=quantized is not None, num_warps=4,
            **launch_options(pdl_on(attn.device)),
        )  # fmt: skip
    return y
