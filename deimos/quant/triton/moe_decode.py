"""A one-token MoE step in two launches (after the router): the gate and up GEMVs with the
gated activation between them, and the down GEMV with the weighted combine.

Why: the unfused step is gate GEMV, up GEMV, gated activation, down GEMV and combine, five
launches a layer for ~22 MB of weights at qwen3moe 30B-A3B's shapes (5 us at the roof), where
each small launch costs 2-4 us of fill and drain in a decode graph. These kernels compute the
same products with the same code (gemv_q8's body, ``gemv_q8_rows``) in the same order, so their
output equals the unfused chain's bit for bit at the same ``block_s`` (tested).

``moe_gate_up``: program (i_n, i_p), pair i_p = t k + j: rows i_n BLOCK_N .. of gate and of up
of expert ids[t, j] times x row t, act(gate) * up, quantized per group of 32 rows
(gemv_q8.quantize_groups; BLOCK_N a multiple of 32) into the down GEMV's integer activation
``[T k, F]``. A pair whose expert has no slot gets a zero row.

``moe_down_combine``: program (i_n, t): rows i_n BLOCK_N .. of sum_j w[t, j] down_ids[t, j]
a_(t k + j), the k products in order j = 0..k-1 (moe_combine's order), unrolled so the k
experts' loads are in flight together. An expert without a slot adds nothing (its weight is
taken as 0, its slot as 0: the rows read are in bounds and multiplied by 0).

Both need every stack in one piece (the resident experts, not the offload's chunks).
Oracles: the unfused kernels (moe_gemv, gated_act, moe_combine), themselves checked against
deimos.kernels.moe's references.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deimos.kernels.triton.activation import ACTIVATIONS, gated_value
from deimos.kernels.triton.moe_route import MAX_TOP_K
from deimos.quant.triton.dequant_gemv import FMT_ID, gemv_out, scale16, weight_arrays
from deimos.quant.triton.gemv_q8 import (
    _INTERPRETED,
    INTERPRETER_TILE,
    Q8Config,
    QuantizedX,
    empty_quantized,
    gemv_q8_rows,
    q8_config,
    quantize_groups,
)
from deimos.quant.triton.layout import PackedWeight
from deimos.quant.triton.moe_gemv import check_expert_inputs, expert_slot, slot_base
from deimos.quant.triton.pdl import launch_options, pdl_on, pdl_start


@triton.jit
def _slot_rows(p_qw, p_qh, p_s, p_d, p_m, r_qw, r_qh, r_s, r_d, r_m, slot, N, p_xq, p_xd, p_xs,
               i_n, x_row, K, FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
               ASM: tl.constexpr, XB: tl.constexpr, EVEN: tl.constexpr, SCALE16: tl.constexpr):
    """Rows i_n BLOCK_N .. of slot ``slot`` (N rows a slot; r_*: each array's elements a row)
    times x row ``x_row``: float32 ``[BLOCK_N]``."""
    return gemv_q8_rows(slot_base(p_qw, p_qw, slot, N, r_qw, 1, False),
                        slot_base(p_qh, p_qh, slot, N, r_qh, 1, False),
                        slot_base(p_s, p_s, slot, N, r_s, 1, False),
                        slot_base(p_d, p_d, slot, N, r_d, 1, False),
                        slot_base(p_m, p_m, slot, N, r_m, 1, False),
                        p_xq, p_xd, p_xs, i_n, x_row, N, K, FMT=FMT, BLOCK_N=BLOCK_N,
                        BLOCK_S=BLOCK_S, ASM=ASM, XB=XB, EVEN=EVEN, SCALE16=SCALE16)


@triton.jit
def _moe_gate_up_kernel(
    g_qw, g_qh, g_s, g_d, g_m, u_qw, u_qh, u_s, u_d, u_m,  # the gate and up stacks' arrays
    p_xq, p_xd, p_xs, p_aq, p_ad, p_as, p_ids, p_slot,
    F, K, E, TOP_K, rg_qw, rg_qh, rg_s, rg_d, rg_m, ru_qw, ru_qh, ru_s, ru_d, ru_m,
    FMT_G: tl.constexpr, FMT_U: tl.constexpr, SCALE16_G: tl.constexpr, SCALE16_U: tl.constexpr,
    ACT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, ASM: tl.constexpr,
    XB: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_start(PDL)
    i_n = tl.program_id(0)
    i_p = tl.program_id(1)
    slot = expert_slot(p_ids, p_slot, i_p, E)
    o_y = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if slot < 0:
        a = tl.zeros([BLOCK_N], dtype=tl.float32)
    else:
        t = i_p // TOP_K
        g = _slot_rows(g_qw, g_qh, g_s, g_d, g_m, rg_qw, rg_qh, rg_s, rg_d, rg_m, slot, F,
                       p_xq, p_xd, p_xs, i_n, t, K, FMT=FMT_G, BLOCK_N=BLOCK_N, BLOCK_S=BLOCK_S,
                       ASM=ASM, XB=XB, EVEN=EVEN, SCALE16=SCALE16_G)
        u = _slot_rows(u_qw, u_qh, u_s, u_d, u_m, ru_qw, ru_qh, ru_s, ru_d, ru_m, slot, F,
                       p_xq, p_xd, p_xs, i_n, t, K, FMT=FMT_U, BLOCK_N=BLOCK_N, BLOCK_S=BLOCK_S,
                       ASM=ASM, XB=XB, EVEN=EVEN, SCALE16=SCALE16_U)
        a = gated_value(g, u, ACT)
    a = tl.where(o_y < F, a, 0.0)
    G: tl.constexpr = BLOCK_N // 32
    o_g = i_n * G + tl.arange(0, G)
    row = i_p.to(tl.int64)
    quantize_groups(tl.reshape(a, (G, 4, 8)), o_g, o_g < F // 32, p_aq + row * (F // 2),
                    p_ad + row * (F // 32), p_as + row * (F // 16))


@triton.jit
def _moe_down_combine_kernel(
    p_qw, p_qh, p_s, p_d, p_m, p_aq, p_ad, p_as, p_w, p_ids, p_slot, p_out,
    D, F, E, r_qw, r_qh, r_s, r_d, r_m,
    TOP_K: tl.constexpr, FMT: tl.constexpr, SCALE16: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr, ASM: tl.constexpr, XB: tl.constexpr, EVEN: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_start(PDL)
    i_n = tl.program_id(0)
    i_t = tl.program_id(1)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        i_p = i_t * TOP_K + j
        slot = expert_slot(p_ids, p_slot, i_p, E)
        w = tl.where(slot >= 0, tl.load(p_w + i_p), 0.0)
        y = _slot_rows(p_qw, p_qh, p_s, p_d, p_m, r_qw, r_qh, r_s, r_d, r_m, tl.maximum(slot, 0), D,
                       p_aq, p_ad, p_as, i_n, i_p, F, FMT=FMT, BLOCK_N=BLOCK_N, BLOCK_S=BLOCK_S,
                       ASM=ASM, XB=XB, EVEN=EVEN, SCALE16=SCALE16)
        acc += w * y
    o_y = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(p_out + i_t.to(tl.int64) * D + o_y, acc, mask=o_y < D)


def _widths(w: PackedWeight) -> tuple:
    return tuple(a.stride(0) for a in weight_arrays(w))


def gate_up_tile(ggml_type, n_ff: int, k: int) -> Q8Config:
    """moe_gate_up's tile on a GPU: 32 rows a program (the activation's groups of 32 quantized
    where they are made), gemv_q8's groups a step for the slot's matrix, at least 4 warps
    (not yet swept)."""
    base = q8_config(ggml_type, n_ff, k, 1)
    return Q8Config(32, base.block_s, max(base.num_warps, 4), False)


def gate_up_config(w_gate: PackedWeight, n_ff: int) -> Q8Config:
    """``gate_up_tile`` for the stack (the interpreter's tile on the CPU)."""
    return INTERPRETER_TILE if w_gate.device.type == "cpu" else gate_up_tile(w_gate.ggml_type, n_ff, w_gate.k)


def down_config(w_down: PackedWeight, d: int) -> Q8Config:
    """moe_down_combine's tile: gemv_q8's launch rule for one slot's ``[d, F]`` matrix (not yet
    swept on MoE shapes; the interpreter's tile on the CPU)."""
    if w_down.device.type == "cpu":
        return INTERPRETER_TILE
    return q8_config(w_down.ggml_type, d, w_down.k, 1)


def moe_gate_up(w_gate: PackedWeight, w_up: PackedWeight, n_ff: int, qx: QuantizedX,
                ids: torch.Tensor, slot_of: torch.Tensor, activation: str,
                out: QuantizedX | None = None, cfg: Q8Config | None = None) -> QuantizedX:
    """act(gate_e x_t) * (up_e x_t) for every pair p = t k + j (e = ids[t, j]), as the down
    GEMV's integer activation ``QuantizedX [T k, n_ff]`` (``out`` if given). w_gate, w_up:
    stacks of n_ff rows a slot (one format each); qx: x's ``[T, K]`` activation; ids int32
    ``[T, k]``; slot_of int32 ``[E]`` (-1: no slot, a zero row); activation: "silu" or
    "gelu_tanh". ``cfg``: the tile (block_n a multiple of 32; default ``gate_up_config``)."""
    for w, who in ((w_gate, "gate"), (w_up, "up")):
        check_expert_inputs(w, n_ff, slot_of, "token", f"moe_gate_up ({who})", ids)
    if w_gate.k != w_up.k or w_gate.n != w_up.n:
        raise ValueError(f"moe_gate_up: gate [{w_gate.n}, {w_gate.k}] and up [{w_up.n}, {w_up.k}] differ")
    if activation not in ACTIVATIONS:
        raise ValueError(f"moe_gate_up: unknown activation {activation!r}")
    if n_ff % 32:
        raise ValueError(f"moe_gate_up: n_ff = {n_ff} is not a multiple of 32")
    t, k = ids.shape
    if tuple(qx.shape) != (t, w_gate.k) or qx.xq.device != w_gate.device:
        raise ValueError(f"moe_gate_up: x must be [{t}, {w_gate.k}] on {w_gate.device}, got "
                         f"{tuple(qx.shape)} on {qx.xq.device}")  # fmt: skip
    if out is None:
        out = empty_quantized(t * k, n_ff, w_gate.device)
    elif tuple(out.shape) != (t * k, n_ff):
        raise ValueError(f"moe_gate_up: out must be [{t * k}, {n_ff}], got {tuple(out.shape)}")
    cfg = cfg or gate_up_config(w_gate, n_ff)
    if cfg.block_n % 32:
        raise ValueError(f"moe_gate_up: block_n = {cfg.block_n} is not a multiple of 32")
    if t * k:
        _moe_gate_up_kernel[(triton.cdiv(n_ff, cfg.block_n), t * k)](
            *weight_arrays(w_gate), *weight_arrays(w_up), qx.xq, qx.xd, qx.xs, out.xq, out.xd, out.xs,
            ids, slot_of, n_ff, w_gate.k, slot_of.numel(), k, *_widths(w_gate), *_widths(w_up),
            FMT_G=FMT_ID[w_gate.ggml_type], FMT_U=FMT_ID[w_up.ggml_type], SCALE16_G=scale16(w_gate),
            SCALE16_U=scale16(w_up), ACT=ACTIVATIONS[activation], BLOCK_N=cfg.block_n,
            BLOCK_S=cfg.block_s, ASM=not _INTERPRETED, XB=cfg.xb,
            EVEN=(w_gate.k // 32) % cfg.block_s == 0, num_warps=cfg.num_warps,
            **launch_options(pdl_on(out.xq.device)),
        )  # fmt: skip
    return out


def moe_down_combine(w_down: PackedWeight, d: int, qa: QuantizedX, ids: torch.Tensor,
                     weights: torch.Tensor, slot_of: torch.Tensor, out: torch.Tensor | None = None,
                     cfg: Q8Config | None = None) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] down_ids[t, j] a_(t k + j), float32 ``[T, d]``, the k
    terms in order. w_down: a stack of d rows a slot; qa: the pairs' activation ``[T k, F]``
    (``moe_gate_up``'s); ids int32 ``[T, k]``; weights float32 ``[T, k]``; slot_of int32
    ``[E]`` (-1: the pair adds nothing). ``cfg``: the tile (default ``down_config``)."""
    check_expert_inputs(w_down, d, slot_of, "pair", "moe_down_combine", ids)
    t, k = ids.shape
    if not 1 <= k <= MAX_TOP_K:
        raise ValueError(f"moe_down_combine: k = {k} not in 1..{MAX_TOP_K}")
    if weights.shape != (t, k) or weights.dtype != torch.float32 or not weights.is_contiguous():
        raise ValueError(f"moe_down_combine: weights must be contiguous float32 [{t}, {k}], got "
                         f"{weights.dtype} {tuple(weights.shape)}")  # fmt: skip
    if tuple(qa.shape) != (t * k, w_down.k) or qa.xq.device != w_down.device:
        raise ValueError(f"moe_down_combine: the activation must be [{t * k}, {w_down.k}] on "
                         f"{w_down.device}, got {tuple(qa.shape)} on {qa.xq.device}")  # fmt: skip
    out = gemv_out(out, t, d, w_down.device, "moe_down_combine")
    cfg = cfg or down_config(w_down, d)
    if t:
        _moe_down_combine_kernel[(triton.cdiv(d, cfg.block_n), t)](
            *weight_arrays(w_down), qa.xq, qa.xd, qa.xs, weights, ids, slot_of, out,
            d, w_down.k, slot_of.numel(), *_widths(w_down), TOP_K=k, FMT=FMT_ID[w_down.ggml_type],
            SCALE16=scale16(w_down), BLOCK_N=cfg.block_n, BLOCK_S=cfg.block_s,
            ASM=not _INTERPRETED, XB=cfg.xb, EVEN=(w_down.k // 32) % cfg.block_s == 0,
            num_warps=cfg.num_warps, **launch_options(pdl_on(out.device)),
        )  # fmt: skip
    return out
