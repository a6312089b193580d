"""A routed-expert MLP step on the GPU kernels (``TritonOps.moe``), every expert on the device.

One token (a batch-1 decode step): the router's logits, ``moe_route`` (softmax, top-k,
renormalized), then the chosen experts' GEMVs, one launch per projection with the expert ids
read on the device (``moe_gemv``; the SwiGLU between them writes the down projection's integer
activation itself), then ``moe_combine``. More tokens (prefill, batched decode): the pairs
grouped by expert on the device (``moe_align``), the grouped GEMM (``moe_gemm``, x in element
order) for gate, up and down, then the combine. No host synchronisation: a step is a graph.

The router's logits are float32 products (torch.mm in float32, TF32 off): routing decides
discrete choices, and an fp16 product would flip near-ties against the float32 reference.
Slots: with every expert resident, ``slot_of`` is the identity (the expert cache, issue 15's
next part, gives a table of its own, -1 for the experts it does not hold).
"""

from __future__ import annotations

import torch

from deimos.kernels.triton.activation import gated_act
from deimos.kernels.triton.moe_route import moe_combine, moe_route
from deimos.quant.triton.gemv_q8 import empty_quantized, quantize_x
from deimos.quant.triton.moe_gemm import moe_align, moe_block_m, moe_gemm
from deimos.quant.triton.moe_gemv import moe_gemv
from deimos.quant.triton.dequant_gemv import MAX_BATCH


class ResidentSlots:
    """The identity slot table of each expert count (every expert on the device)."""

    def __init__(self) -> None:
        self._tables: dict[tuple[int, torch.device], torch.Tensor] = {}

    def __call__(self, n_expert: int, device: torch.device) -> torch.Tensor:
        key = (n_expert, device)
        t = self._tables.get(key)
        if t is None:
            t = self._tables[key] = torch.arange(n_expert, dtype=torch.int32, device=device)
        return t


def moe_step(x: torch.Tensor, block, slot_of: torch.Tensor, quantized=None) -> torch.Tensor:
    """x float32 ``[T, D]`` -> float32 ``[T, D]``: ``block``'s routed experts (a
    deimos.models.moe.MoE holding PackedExperts). ``quantized``: x's integer activation when
    the norm kernel made it (one token)."""
    t, k = x.shape[0], block.n_expert_used
    logits = torch.mm(x.float(), block.router.t())
    weights, ids = moe_route(logits, k, block.normalize)
    gate, up, down = block.gate, block.up, block.down
    if t == 1 and k <= MAX_BATCH:
        qx = quantized if quantized is not None else quantize_x(x)
        g = moe_gemv(gate.weight, gate.n, qx, ids, slot_of, "token")
        u = moe_gemv(up.weight, up.n, qx, ids, slot_of, "token")
        qa = empty_quantized(k, g.shape[1], x.device) if g.shape[1] % 32 == 0 else None
        a = gated_act(g, u, block.activation, quantized=qa)
        y = moe_gemv(down.weight, down.n, qa if qa is not None else quantize_x(a), ids, slot_of, "pair")
    else:
        tiles = moe_align(ids, block.n_expert, moe_block_m(t * k, block.n_expert))
        x16 = x.to(torch.float16).contiguous()
        g = moe_gemm(x16, gate.weight, gate.n, tiles, slot_of, "token", x_permuted=False)
        u = moe_gemm(x16, up.weight, up.n, tiles, slot_of, "token", x_permuted=False)
        a = gated_act(g, u, block.activation)
        y = moe_gemm(a.to(torch.float16), down.weight, down.n, tiles, slot_of, "pair", x_permuted=False)
    return moe_combine(y, weights)
