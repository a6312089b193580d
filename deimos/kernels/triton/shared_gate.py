"""The shared expert's gate and the MoE sum in one launch (Triton): out = routed +
sigmoid(x . gate_inp) * shared per token, for qwen35moe and qwen3next (llama.cpp's
ffn_gate_inp_shexp). Oracle: deimos.models.moe.shared_gate_add (the CPU block's).

Replaces four launches a layer: the float32 dot (cuBLAS's GEMV), the sigmoid, the product and
the sum. One program per token: its D inputs for the dot, then the D outputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deimos.quant.triton.pdl import launch_options, pdl_on, pdl_start

MAX_D = 16384


@triton.jit
def _shared_gate_kernel(p_r, p_s, p_x, p_g, p_o, stride_r, stride_s, stride_x, stride_o, D,
                        BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    i_t = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    b_x = tl.load(p_x + i_t * stride_x + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_g = tl.load(p_g + o_d, mask=m_d, other=0.0).to(tl.float32)
    gate = tl.sigmoid(tl.sum(b_x * b_g, axis=0))
    b_r = tl.load(p_r + i_t * stride_r + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_s = tl.load(p_s + i_t * stride_s + o_d, mask=m_d, other=0.0).to(tl.float32)
    tl.store(p_o + i_t * stride_o + o_d, (b_r + b_s * gate).to(p_o.dtype.element_ty), mask=m_d)


def _rows(name: str, t: torch.Tensor, n: int, d: int) -> None:
    if t.dim() != 2 or t.shape != (n, d) or t.stride(1) != 1:
        raise ValueError(f"shared_gate_add: {name} {tuple(t.shape)} (strides {t.stride()}) is "
                         f"not [{n}, {d}] with contiguous rows")  # fmt: skip


def shared_gate_add(routed: torch.Tensor, shared: torch.Tensor, x: torch.Tensor,
                    gate_inp: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``routed + sigmoid(x @ gate_inp)[:, None] * shared``: routed, shared and x ``[T, D]``
    (rows may be strided), gate_inp ``[D]``; the dot and the sum in float32, stored in
    routed's dtype (``out``: optional ``[T, D]``, may be ``routed`` itself). Returns out."""
    if x.dim() != 2:
        raise ValueError(f"shared_gate_add: x must be [T, D], got {tuple(x.shape)}")
    t, d = x.shape
    if not 0 < d <= MAX_D:
        raise ValueError(f"shared_gate_add: D = {d} not in 1..{MAX_D}")
    for name, u in (("x", x), ("routed", routed), ("shared", shared)):
        _rows(name, u, t, d)
    if gate_inp.shape != (d,) or gate_inp.stride(0) != 1:
        raise ValueError(f"shared_gate_add: gate_inp {tuple(gate_inp.shape)} (stride "
                         f"{gate_inp.stride()}) is not a contiguous [{d}]")  # fmt: skip
    for name, u in (("routed", routed), ("shared", shared), ("gate_inp", gate_inp)):
        if u.device != x.device:
            raise ValueError(f"shared_gate_add: {name} is on {u.device}, x on {x.device}")
    if out is None:
        out = torch.empty(t, d, dtype=routed.dtype, device=x.device)
    _rows("out", out, t, d)
    if t:
        block = triton.next_power_of_2(d)
        _shared_gate_kernel[(t,)](
            routed, shared, x, gate_inp, out, routed.stride(0), shared.stride(0), x.stride(0),
            out.stride(0), d, BLOCK_D=block, num_warps=max(1, min(8, block // 512)),
            **launch_options(pdl_on(x.device)),
        )  # fmt: skip
    return out
