"""A routed-expert MLP step on the GPU kernels (``TritonOps.moe``), every expert on the device.

One token (a batch-1 decode step): the router in one launch (``moe_router``: the float32
logits, softmax, top-k, renormalized), ``moe_gemv`` per projection (expert ids read on the
device; gate and up in one launch, ``moe_gemv_pair``), ``gated_act`` (writing the down
projection's integer activation), ``moe_combine``. With DEIMOS_MOE_FUSED=0 (read once) the
router is torch's float32 product then ``moe_route`` (the default until session 45: the
one-launch router, its swept tile and its weights loaded before the PDL wait, measured 5%
faster on qwen3moe 30B-A3B's decode, H100: BENCHMARKS.md); with
DEIMOS_MOE_FUSED=1 (experts resident) the whole step is three launches: ``moe_router`` (the
logits and the routing in one), ``moe_gate_up`` (gate and up with the gated activation between
them) and ``moe_down_combine`` (down with the weighted combine), quant.triton.moe_decode.
More tokens (prefill, batched decode): the pairs grouped by expert on the device
(``moe_align``), the grouped GEMM (``moe_gemm``, x in element order) for gate, up and down,
then the combine. No host synchronisation: a step is a graph.

The router's logits are float32 products (torch.mm in float32, TF32 off): routing decides
discrete choices, and an fp16 product would flip near-ties against the float32 reference.
Slots: with every expert resident, ``slot_of`` is the identity (the expert cache, issue 15's
next part, gives a table of its own, -1 for the experts it does not hold).
"""

from __future__ import annotations

import os

import torch

from deimos.kernels.triton.activation import gated_act
from deimos.kernels.triton.moe_route import moe_combine, moe_route
from deimos.kernels.triton.moe_router import MAX_TOKENS, RouterScratch, moe_router
from deimos.models.ops import ExpertSum
from deimos.quant.triton.dequant_gemv import MAX_BATCH
from deimos.quant.triton.gemv_q8 import empty_quantized, quantize_x
from deimos.quant.triton.moe_decode import moe_down_combine, moe_gate_up
from deimos.quant.triton.moe_gemm import moe_align, moe_block_m, moe_gemm
from deimos.quant.triton.moe_gemv import moe_gemv, moe_gemv_pair
from deimos.switches import env_switch

# read once: which one-token steps TritonOps fuses (a profile's switch; the default is what was
# measured fastest: session 45, H100): "0" none, "router" the router only, "1" all three launches
FUSED = os.environ.get("DEIMOS_MOE_FUSED", "router")
if FUSED not in ("0", "router", "1"):
    raise ValueError(f"DEIMOS_MOE_FUSED must be 0, router or 1, got {FUSED!r}")


# read once: DEIMOS_MOE_DEFER=0 keeps the experts' sum in a combine launch of its own even where
# the layer would let the next norm take it (Ops.moe's defer; a profile's A/B)
DEFER = env_switch("DEIMOS_MOE_DEFER", True)


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


def route(x: torch.Tensor, block, scratch: RouterScratch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The router -> (weights, ids): with the ops' ``scratch`` and at most MAX_TOKENS tokens
    one launch (``moe_router``), else float32 logits of x ``[T, D]`` (torch) then
    ``moe_route``."""
    r = block.router
    if (scratch is not None and x.shape[0] <= MAX_TOKENS and r.dtype == torch.float32
            and r.is_contiguous() and x.is_contiguous()):  # fmt: skip
        return moe_router(x, r, block.n_expert_used, block.normalize, scratch(block.n_expert, x.device))
    logits = torch.mm(x.float(), r.t())
    return moe_route(logits, block.n_expert_used, block.normalize)


def expert_products(x: torch.Tensor, block, ids: torch.Tensor, slot_of: torch.Tensor,
                    stacks: dict | None = None, chunks: dict | None = None,
                    quantized=None, half: torch.Tensor | None = None) -> torch.Tensor:
    """Every (token, chosen expert) pair's SwiGLU FFN, float32 ``[T * k, D]`` (pairs whose
    expert has no slot in ``slot_of``: rows of 0). ``stacks``: the packed weight of each part
    ("gate", "up", "down"; default the block's own); ``chunks``: each part's ExpertChunks when
    the slots live in the expert cache's chunks. One token: the GEMVs on integer activations
    (``quantized``: x's, when the norm kernel made it); more: the pairs grouped by expert and
    the grouped GEMM (``half``: x in float16, when the norm kernel made it)."""
    t, k = x.shape[0], block.n_expert_used
    w = stacks or {"gate": block.gate.weight, "up": block.up.weight, "down": block.down.weight}
    c = chunks or {}
    f, d = block.n_ff, x.shape[1]
    if t == 1 and k <= MAX_BATCH:
        qx = quantized if quantized is not None else quantize_x(x)
        g, u = moe_gemv_pair(w["gate"], w["up"], f, qx, ids, slot_of, "token", c.get("gate"), c.get("up"))
        qa = empty_quantized(k, f, x.device) if f % 32 == 0 else None
        a = gated_act(g, u, block.activation, quantized=qa)
        # ahead: the kernel just before is gated_act's (or quantize_x's), which writes
        # neither ids, slot_of nor the weights
        return moe_gemv(w["down"], d, qa if qa is not None else quantize_x(a), ids, slot_of, "pair",
                        chunks=c.get("down"), ahead=True)
    tiles = moe_align(ids, block.n_expert, moe_block_m(t * k, block.n_expert))
    x16 = half if half is not None else x.to(torch.float16).contiguous()
    g = moe_gemm(x16, w["gate"], f, tiles, slot_of, "token", x_permuted=False, chunks=c.get("gate"))
    u = moe_gemm(x16, w["up"], f, tiles, slot_of, "token", x_permuted=False, chunks=c.get("up"))
    a = gated_act(g, u, block.activation).to(torch.float16)
    return moe_gemm(a, w["down"], d, tiles, slot_of, "pair", x_permuted=False, chunks=c.get("down"))


def fused_decode(x: torch.Tensor, block, slot_of: torch.Tensor, router: RouterScratch,
                 quantized=None) -> torch.Tensor | None:
    """One token's routed experts in three launches (module docstring), or None when the
    step does not fit them (more tokens, k > MAX_BATCH, F not whole groups of 32)."""
    k, f = block.n_expert_used, block.n_ff
    if x.shape[0] != 1 or k > MAX_BATCH or f % 32:
        return None
    weights, ids = route(x, block, router)
    qx = quantized if quantized is not None else quantize_x(x)
    qa = moe_gate_up(block.gate.weight, block.up.weight, f, qx, ids, slot_of, block.activation)
    return moe_down_combine(block.down.weight, x.shape[1], qa, ids, weights, slot_of)


def moe_step(x: torch.Tensor, block, slot_of: torch.Tensor, quantized=None,
             router: RouterScratch | None = None, experts_fused: bool = True,
             shared: tuple[torch.Tensor, torch.Tensor] | None = None,
             half: torch.Tensor | None = None, defer: bool = False) -> torch.Tensor | ExpertSum:
    """x float32 ``[T, D]`` -> float32 ``[T, D]``: ``block``'s routed experts (a
    deimos.models.moe.MoE holding PackedExperts). ``quantized``: x's integer activation when
    the norm kernel made it (one token). ``router``: the ops' scratch for the fused router
    (a few tokens: ``moe_router``); with ``experts_fused`` one token then runs in three
    launches (``fused_decode``). None: the unfused chain. ``shared``: (a shared expert's
    output float32 ``[T, D]``, its gate float32 ``[D]``): the combine adds it scaled by
    sigmoid(x . gate) (the unfused chain only). ``half``: x in contiguous float16 (more
    tokens: what the grouped GEMM reads), when the norm kernel made it. ``defer``: the experts'
    outputs and weights (and the shared expert's row and gate) as an ``ExpertSum``, for the
    next add_rms_norm to sum in its launch (no combine launch; DEIMOS_MOE_DEFER=0: the
    combine all the same)."""
    if router is not None and experts_fused and shared is None:
        y = fused_decode(x, block, slot_of, router, quantized)
        if y is not None:
            return y
    weights, ids = route(x, block, router)
    y = expert_products(x, block, ids, slot_of, quantized=quantized, half=half)
    if defer and DEFER:
        return ExpertSum(y, weights) if shared is None else ExpertSum(y, weights, shared[0], (x, shared[1]))
    if shared is None:
        return moe_combine(y, weights)
    return moe_combine(y, weights, add=shared[0], gate=(x, shared[1]))
