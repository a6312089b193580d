"""The short causal convolution's decode step (Triton): one new input row for each of B sequences
in one launch, each sequence's carried inputs a slot of a pool ``[n_slots, C, K - 1]`` float32,
shifted in place; the output is SiLU of the convolution (what the Gated DeltaNet block feeds
on). Oracle: ``causal_conv_update_reference`` below, built on deimos.kernels.deltanet.causal_conv1d
(ggml_ssm_conv).

One program per (BLOCK_C channels, sequence). For channel c with carried inputs s_0 .. s_{K-2}
(oldest first) and the new input x:

    y[c]        = silu(s_0 w[c, 0] + ... + s_{K-2} w[c, K-2] + x w[c, K-1])
    s_j <- s_{j+1} (j < K - 2),  s_{K-2} <- x

summed in that order (the reference's). A channel's carried inputs are loaded and stored by the
thread that owns the channel, in program order, so the in-place shift needs no barrier. The
slot of each sequence is read on the device (an int32 tensor), so a decode CUDA graph replays
with new slots; graph padding rows name the pool's scratch slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deimos.kernels.deltanet import causal_conv1d
from deimos.quant.triton.pdl import launch_options, pdl_on, pdl_start


@triton.jit
def _conv_update_kernel(p_x, p_w, p_pool, p_slot, p_y, C: tl.constexpr, K: tl.constexpr,
                        BLOCK_C: tl.constexpr, PDL: tl.constexpr = False):
    """Channels i_c BLOCK_C .. of sequence i_b."""
    pdl_start(PDL)
    i_c, i_b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    m_c = o_c < C
    slot = tl.load(p_slot + i_b).to(tl.int64)
    p_s = p_pool + slot * (C * (K - 1)) + o_c * (K - 1)  # tap 0 (the oldest input) of each channel
    p_wc = p_w + o_c * K
    b_x = tl.load(p_x + i_b * C + o_c, mask=m_c, other=0.0).to(tl.float32)
    b_s = tl.load(p_s, mask=m_c, other=0.0)
    b_y = b_s * tl.load(p_wc, mask=m_c, other=0.0).to(tl.float32)
    for j in tl.static_range(1, K - 1):
        b_s = tl.load(p_s + j, mask=m_c, other=0.0)
        b_y += b_s * tl.load(p_wc + j, mask=m_c, other=0.0).to(tl.float32)
        tl.store(p_s + (j - 1), b_s, mask=m_c)  # tap j - 1 was read the step before
    b_y += b_x * tl.load(p_wc + (K - 1), mask=m_c, other=0.0).to(tl.float32)
    tl.store(p_s + (K - 2), b_x, mask=m_c)
    b_y = b_y * tl.sigmoid(b_y)
    tl.store(p_y + i_b * C + o_c, b_y.to(p_y.dtype.element_ty), mask=m_c)


def conv_block_c(c: int) -> int:
    """Channels per program: 256 (two a thread at 4 warps; Qwen3.5's C = 8192 gives B * 32
    programs, each reading 8 KB of weights), fewer only for narrower layers."""
    return min(256, triton.next_power_of_2(c))


def _launch(x, weight, pool, slots, out):
    b, c = x.shape
    block_c = conv_block_c(c)
    _conv_update_kernel[(triton.cdiv(c, block_c), b)](
        x, weight, pool, slots, out, C=c, K=weight.shape[1], BLOCK_C=block_c, num_warps=4,
        **launch_options(pdl_on(x.device)),
    )  # fmt: skip


def causal_conv_update(x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor,
                       slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """One causal-convolution step for B sequences, SiLU applied; ``pool[slots[b]]`` shifted in
    place (its oldest input dropped, ``x[b]`` appended).

    x: ``[B, C]`` (float32, fp16 or bf16, contiguous): each sequence's new input row; weight:
    ``[C, K]`` (ggml's ssm_conv1d, any float dtype, contiguous), K >= 2; pool: float32
    ``[n_slots, C, K - 1]`` contiguous, the last K - 1 inputs of every channel oldest first;
    slots: int32 ``[B]`` on the device, each in [0, n_slots) (no two live rows may share one;
    padding rows may share the scratch slot); out: ``[B, C]`` contiguous, written in full
    (default: new float32). Returns out."""
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1] or weight.shape[1] < 2:
        raise ValueError(f"causal_conv_update: x {tuple(x.shape)} and weight {tuple(weight.shape)}: "
                         "want [B, C] and [C, K] with K >= 2")  # fmt: skip
    b, c = x.shape
    k = weight.shape[1]
    if pool.dim() != 3 or pool.shape[1:] != (c, k - 1) or pool.dtype != torch.float32:
        raise ValueError(f"causal_conv_update: pool {pool.dtype} {tuple(pool.shape)} is not "
                         f"float32 [n_slots, {c}, {k - 1}]")  # fmt: skip
    if slots.shape != (b,) or slots.dtype != torch.int32:
        raise ValueError(f"causal_conv_update: slots {slots.dtype} {tuple(slots.shape)} is not "
                         f"int32 [{b}]")  # fmt: skip
    if out is None:
        out = torch.empty(b, c, dtype=torch.float32, device=x.device)
    elif out.shape != x.shape or not out.is_contiguous():
        raise ValueError(f"causal_conv_update: out {tuple(out.shape)} is not a contiguous "
                         f"{tuple(x.shape)}")  # fmt: skip
    for name, t in (("x", x), ("weight", weight), ("pool", pool), ("slots", slots), ("out", out)):
        if not t.is_contiguous() or t.device != x.device:
            raise ValueError(f"causal_conv_update: {name} must be contiguous on {x.device}")
    if b:
        _launch(x, weight, pool, slots, out)
    return out


def causal_conv_update_reference(x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor,
                                 slots: torch.Tensor) -> torch.Tensor:
    """``causal_conv_update`` row by row through causal_conv1d (same arguments; pool updated in
    place, rows in order). Returns SiLU(y) ``[B, C]`` float32."""
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    for b, slot in enumerate(slots.tolist()):
        yb, state = causal_conv1d(x[b : b + 1].float(), weight.float(), pool[slot].t().float())
        y[b] = torch.nn.functional.silu(yb[0])
        pool[slot] = state.t()
    return y
