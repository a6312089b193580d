"""Gated MLP activations, fused (Triton): silu(g) * u and gelu_tanh(g) * u.
Oracle: deimos.kernels.activation.gated_act.

Elementwise and memory bound: 2 reads + 1 write per element. Grid (T, F / BLOCK); gate and up
may be strided views (e.g. the two halves of a fused gate_up projection [T, 2F]).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deimos.quant.triton.pdl import launch_options, pdl_on, pdl_start
from deimos.quant.triton.gemv_q8 import quantize_groups

ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
BLOCK = 1024
NUM_WARPS = 4
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)


@triton.jit
def gated_value(g, u, ACT: tl.constexpr):
    """act(g) * u in float32 (``ACT``: ``ACTIVATIONS``' code); the MoE decode kernels call it
    too."""
    if ACT == 0:
        # exp's argument capped at 80: past it a is ~0 either way, and nothing overflows
        a = g / (1.0 + tl.exp(tl.minimum(-g, 80.0)))
    else:
        # 0.5 * (1 + tanh(y)) == sigmoid(2y)
        z = 2.0 * _SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)
        a = g / (1.0 + tl.exp(tl.minimum(-z, 80.0)))
    return a * u


@triton.jit
def _gated_act_kernel(
    p_g, p_u, p_y, stride_g, stride_u, stride_y, F, p_xq, p_xd, p_xs,
    ACT: tl.constexpr, BLOCK_F: tl.constexpr, QUANT: tl.constexpr, PDL: tl.constexpr = False,
    p_h=None, HALF: tl.constexpr = False,
):  # fmt: skip
    """HALF: the output also stored as float16 at p_h (contiguous ``[T, F]``)."""
    pdl_start(PDL)
    i_t = tl.program_id(0).to(tl.int64)
    o_f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    m_f = o_f < F
    b_g = tl.load(p_g + i_t * stride_g + o_f, mask=m_f, other=0.0).to(tl.float32)
    b_u = tl.load(p_u + i_t * stride_u + o_f, mask=m_f, other=0.0).to(tl.float32)
    b_y = gated_value(b_g, b_u, ACT).to(p_y.dtype.element_ty)
    tl.store(p_y + i_t * stride_y + o_f, b_y, mask=m_f)
    if HALF:
        tl.store(p_h + i_t * F + o_f, b_y.to(tl.float16), mask=m_f)
    if QUANT:  # also as the GEMV's integer activation (gemv_q8.quantize_groups)
        G: tl.constexpr = BLOCK_F // 32
        o_g = tl.program_id(1) * G + tl.arange(0, G)
        quantize_groups(tl.reshape(b_y.to(tl.float32), (G, 4, 8)), o_g, o_g < F // 32,
                        p_xq + i_t * (F // 2), p_xd + i_t * (F // 32), p_xs + i_t * (F // 16))


def gated_act(
    gate: torch.Tensor, up: torch.Tensor, activation: str, out: torch.Tensor | None = None,
    quantized=None, half: torch.Tensor | None = None,
) -> torch.Tensor:
    """act(gate) * up, computed in float32, stored in gate's dtype.

    gate, up: ``[T, F]`` (rows may be strided, last dim contiguous); activation: "silu"
    (SwiGLU) or "gelu_tanh" (GeGLU). out: optional ``[T, F]``. Returns ``[T, F]``.
    ``quantized``: a ``QuantizedX`` ``[T, F]`` (F a multiple of 32) that also receives the
    output as the GEMV's integer activation. ``half``: a contiguous float16 ``[T, F]`` that
    also receives it rounded to float16 (what a batch's tensor-core matmul reads).
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"gated_act: unknown activation {activation!r}")
    if gate.dim() != 2 or gate.shape != up.shape:
        raise ValueError(
            f"gated_act: gate and up must be the same [T, F], got {tuple(gate.shape)} and "
            f"{tuple(up.shape)}"
        )
    if gate.device != up.device:
        raise ValueError(f"gated_act: gate on {gate.device}, up on {up.device}")
    if out is None:
        out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if out.shape != gate.shape:
        raise ValueError(f"gated_act: out must be {tuple(gate.shape)}, got {tuple(out.shape)}")
    for name, t in (("gate", gate), ("up", up), ("out", out)):
        if t.stride(1) != 1:
            raise ValueError(f"gated_act: {name}'s last dimension must be contiguous")
    n_t, n_f = gate.shape
    if quantized is not None and (n_f % 32 or tuple(quantized.shape) != (n_t, n_f)):
        raise ValueError(f"gated_act: quantized output {tuple(quantized.shape)} does not fit "
                         f"[{n_t}, {n_f}] (F a multiple of 32)")
    q = quantized if quantized is not None else (out, out, out)
    if half is not None and (half.dtype != torch.float16 or tuple(half.shape) != (n_t, n_f)
                             or not half.is_contiguous() or half.device != gate.device):  # fmt: skip
        raise ValueError(f"gated_act: half output must be contiguous float16 [{n_t}, {n_f}] on "
                         f"{gate.device}, got {half.dtype} {tuple(half.shape)} on {half.device}")
    if n_t and n_f:
        _gated_act_kernel[(n_t, triton.cdiv(n_f, BLOCK))](
            gate, up, out, gate.stride(0), up.stride(0), out.stride(0), n_f, q[0], q[1], q[2],
            ACT=ACTIVATIONS[activation], BLOCK_F=BLOCK, QUANT=quantized is not None,
            num_warps=NUM_WARPS, p_h=half if half is not None else out, HALF=half is not None,
            **launch_options(pdl_on(gate.device)),
        )  # fmt: skip
    return out
