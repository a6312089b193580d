"""Decode GEMVs of a mixture-of-experts layer's routed experts: every (token, chosen expert)
pair's product in ONE launch per projection, the expert ids read on the device (no host sync:
a decode step stays one CUDA graph).

Weights: one packed stack (layout.PackedWeight) of S * n rows: S slots (every expert, or a
cache of slots), slot s = rows s n .. s n + n - 1 (n any row count: the gate/up pair may be one
slot of 2 n_ff rows). ``slot_of[e]`` (int32, device) is expert e's slot, -1 when the expert is
not on the device: that pair's row is written as 0 (the CPU computes it; the caller adds it).

Slots in chunks (runtime.expert_cache.LayerCache, which frees whole chunks when the card's
memory shrinks): ``ExpertChunks`` gives, per array, an int64 device table of each chunk's base
address; slot s is row block s % spc of chunk s // spc. The kernels read the table on the
device (it is updated in place, so a captured graph follows the cache) and ``w_stack`` then
only says the format, K and each array's dtype and row width.

Program (i_n, i_p): rows i_n BLOCK_N .. of pair i_p = t k + j, expert ids[t, j]. It finds the
slot and runs gemv_q8's body (``gemv_q8_rows``: the same dp4a dot, tiles and launch rule,
nothing copied) on pointers moved to the slot's rows, for the activation row the pair reads:
x row t (``x_rows="token"``: gate/up, every pair of a token reads its normed hidden state) or
row p (``"pair"``: down, each pair reads its own gated activation); it stores y row p. An
expert id outside [0, E) counts as not on the device (its row is 0): nothing is read out of
bounds.

Oracle: deimos.kernels.moe.moe_experts_reference on the dequantized stack
(naive.dequantize_packed) and the dequantized activation (gemv_q8.quantize_x_reference).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from deimos.gguf.constants import GGMLType
from deimos.quant.triton.dequant_gemv import FMT_ID, gemv_grid, gemv_out, scale16, weight_arrays
from deimos.quant.triton.gemv_q8 import (
    _INTERPRETED,
    INTERPRETER_TILE,
    Q8Config,
    QuantizedX,
    gemv_q8_rows,
    q8_config,
)
from deimos.quant.triton.layout import PackedWeight
from deimos.quant.triton.pdl import ahead_on, launch_options, pdl_on, pdl_start

X_ROWS = ("token", "pair")  # the activation row of pair p = t k + j: t (gate/up) or p (down)


class ExpertChunks(NamedTuple):
    """Slots stored in chunks: ``tables[a]`` (int64 ``[max_chunks]`` on the device) holds the
    base address of array ``a``'s view in each chunk (runtime.expert_cache's
    ``chunk_ptrs[(part, a)]``), every array of the part's PackedWeight named; slot s is rows
    (s % slots_per_chunk) n .. of chunk s // slots_per_chunk."""

    tables: dict[str, torch.Tensor]
    slots_per_chunk: int


@triton.jit
def slot_base(p_a, t_a, slot, N, r_a, SPC, CHUNKED: tl.constexpr):
    """Pointer to the first row of ``slot`` (N rows a slot, ``r_a`` elements a row) in array
    ``a``: p_a's rows (one stack), or chunk slot // SPC of the address table ``t_a``."""
    if CHUNKED:
        base = tl.load(t_a + slot // SPC).to(p_a.dtype)
        return base + ((slot % SPC).to(tl.int64) * N) * r_a
    else:
        return p_a + (slot.to(tl.int64) * N) * r_a


@triton.jit
def expert_slot(p_ids, p_slot, i_p, E):
    """Pair i_p's slot: slot_of[ids[i_p]], -1 for an id outside [0, E) or an expert off the
    device (nothing read out of bounds). Read from L2 (.cg), never a line an SM's L1 kept: the
    ahead kernels read them before their PDL wait, and the router and the cache's publishing
    rewrite them every step."""
    e = tl.load(p_ids + i_p, cache_modifier=".cg")
    known = (e >= 0) & (e < E)
    slot = tl.load(p_slot + tl.where(known, e, 0), cache_modifier=".cg")
    return tl.where(known, slot, -1)


@triton.jit
def _moe_gemv_kernel(
    p_qw, p_qh, p_s, p_d, p_m,  # the stack's arrays (unused ones get any pointer)
    t_qw, t_qh, t_s, t_d, t_m,  # CHUNKED: their chunk address tables
    p_xq, p_xd, p_xs, p_y, p_ids, p_slot,
    N, K, E, TOP_K, r_qw, r_qh, r_s, r_d, r_m, SPC,  # r_*: each array's elements a row
    FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, ASM: tl.constexpr,
    XB: tl.constexpr, EVEN: tl.constexpr, SCALE16: tl.constexpr, PAIR_ROWS: tl.constexpr,
    CHUNKED: tl.constexpr = False, PDL: tl.constexpr = False, TWO: tl.constexpr = False,
    AHEAD: tl.constexpr = False,
    p_qw2=None, p_qh2=None, p_s2=None, p_d2=None, p_m2=None,
    t_qw2=None, t_qh2=None, t_s2=None, t_d2=None, t_m2=None, p_y2=None,
):  # fmt: skip
    """Rows i_n BLOCK_N .. of pair i_p's output: W_slot(ids[i_p]) x_row, or 0 when the expert
    has no slot. PAIR_ROWS: x row i_p, else i_p // TOP_K. TWO: program_id(2) = 1 takes the
    second stack (``*2``: the same format, shape and chunking) and stores into p_y2. AHEAD
    (with PDL; the caller's promise that the kernel just before writes neither the ids, the
    slot table nor the weights): the slot and the first weights are loaded before the wait."""
    if not AHEAD:
        pdl_start(PDL)
    i_n = tl.program_id(0)
    i_p = tl.program_id(1)
    if TWO:
        if tl.program_id(2) == 1:  # the second stack's pointers, the same code after
            p_qw, p_qh, p_s, p_d, p_m, p_y = p_qw2, p_qh2, p_s2, p_d2, p_m2, p_y2
            t_qw, t_qh, t_s, t_d, t_m = t_qw2, t_qh2, t_s2, t_d2, t_m2
    slot = expert_slot(p_ids, p_slot, i_p, E)
    if slot < 0:
        if AHEAD:
            pdl_start(True)
        o_y = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(p_y + i_p.to(tl.int64) * N + o_y, tl.zeros([BLOCK_N], dtype=tl.float32), mask=o_y < N)
    else:
        x_row = i_p if PAIR_ROWS else i_p // TOP_K
        y = gemv_q8_rows(slot_base(p_qw, t_qw, slot, N, r_qw, SPC, CHUNKED),
                         slot_base(p_qh, t_qh, slot, N, r_qh, SPC, CHUNKED),
                         slot_base(p_s, t_s, slot, N, r_s, SPC, CHUNKED),
                         slot_base(p_d, t_d, slot, N, r_d, SPC, CHUNKED),
                         slot_base(p_m, t_m, slot, N, r_m, SPC, CHUNKED),
                         p_xq, p_xd, p_xs, i_n, x_row, N, K, FMT=FMT, BLOCK_N=BLOCK_N,
                         BLOCK_S=BLOCK_S, ASM=ASM, XB=XB, EVEN=EVEN, SCALE16=SCALE16, WAIT=AHEAD)
        o_y = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(p_y + i_p.to(tl.int64) * N + o_y, y, mask=o_y < N)


def moe_gemv_tile(ggml_type, n: int, k: int) -> Q8Config:
    """The tile on a GPU, from bench/sweep_moe.py on the H200 (2026-12-02, qwen3moe 30B-A3B's
    shapes, 8 of 128 experts from memory, in a graph with PDL): Q4_K gate/up (768 x 2048)
    4 rows x 64 groups on one warp, 6.77 -> 5.38 us; Q6_K down (2048 x 768) 8 rows x 16
    groups on two warps, 8.84 -> 7.12 us. Other formats and shapes: gemv_q8's rule for one
    slot's matrix (not swept on MoE shapes)."""
    groups = k // 32
    if ggml_type == GGMLType.Q4_K and groups >= 64:
        return Q8Config(4, 64, 1)
    if ggml_type == GGMLType.Q6_K and groups <= 32:
        return Q8Config(8, 16, 2)
    return q8_config(ggml_type, n, k, 1)


def moe_gemv_config(w_stack: PackedWeight, n: int) -> Q8Config:
    """``moe_gemv_tile`` for the stack (the interpreter's tile on the CPU)."""
    if w_stack.device.type == "cpu":
        return INTERPRETER_TILE
    return moe_gemv_tile(w_stack.ggml_type, n, w_stack.k)


def slot_arrays(w_stack: PackedWeight, chunks: ExpertChunks | None, who: str) -> tuple:
    """The kernels' weight arguments: (the 5 arrays, their 5 chunk tables (the arrays again when
    not chunked: never read), the 5 row widths, slots a chunk, CHUNKED)."""
    arrays = weight_arrays(w_stack)
    widths = tuple(a.stride(0) for a in arrays)
    if chunks is None:
        return arrays, arrays, widths, 1, False
    t = chunks.tables
    if set(t) != set(w_stack.tensors):
        raise ValueError(f"{who}: chunk tables for {sorted(t)}, the weight has {sorted(w_stack.tensors)}")
    for name, tab in t.items():
        if tab.dtype != torch.int64 or tab.dim() != 1 or not tab.is_contiguous() or tab.device != w_stack.device:
            raise ValueError(f"{who}: chunk table {name!r} must be contiguous int64 [chunks] on "
                             f"{w_stack.device}, got {tab.dtype} {tuple(tab.shape)}")  # fmt: skip
    if not (isinstance(chunks.slots_per_chunk, int) and chunks.slots_per_chunk >= 1):
        raise ValueError(f"{who}: slots_per_chunk must be >= 1, got {chunks.slots_per_chunk}")
    qw = t["qw"]
    tables = (qw, t.get("qh", qw), t.get("meta", t.get("sc", qw)), t.get("d", qw), t.get("m", qw))
    return arrays, tables, widths, chunks.slots_per_chunk, True


def check_expert_inputs(w_stack: PackedWeight, n: int, slot_of: torch.Tensor, x_rows: str,
                        who: str, ids: torch.Tensor | None = None, chunked: bool = False) -> None:
    """The expert kernels' shared checks: a stack of whole slots of n rows (any rows when
    ``chunked``: the slots live in chunks) in a format with a kernel, slot_of contiguous int32
    ``[E]`` (and ids contiguous int32 ``[T, k]``) on the stack's device, x_rows one of
    ``X_ROWS``."""
    if w_stack.ggml_type not in FMT_ID:
        raise ValueError(f"{who}: no kernel for {w_stack.ggml_type.name}")
    if not (isinstance(n, int) and n > 0 and (chunked or w_stack.n % n == 0)):
        raise ValueError(f"{who}: the stack's {w_stack.n} rows are not whole slots of n = {n} rows")
    if any(t.dim() < 2 or not t.is_contiguous() for t in w_stack.tensors.values()):
        raise ValueError(f"{who}: the stack's arrays must be contiguous [rows, ...] tensors")
    if x_rows not in X_ROWS:
        raise ValueError(f"{who}: x_rows must be one of {X_ROWS}, got {x_rows!r}")
    for name, t, dims in (("ids", ids, 2), ("slot_of", slot_of, 1)):
        if t is None:
            continue
        if t.dtype != torch.int32 or t.dim() != dims or not t.is_contiguous():
            raise ValueError(f"{who}: {name} must be contiguous int32 with {dims} dimension(s), got "
                             f"{t.dtype} {tuple(t.shape)}")  # fmt: skip
        if t.device != w_stack.device:
            raise ValueError(f"{who}: {name} is on {t.device}, the weights on {w_stack.device}")
    if slot_of.numel() == 0:
        raise ValueError(f"{who}: slot_of is empty (no experts)")


def _check_gemv_inputs(w: PackedWeight, n: int, qx: QuantizedX, ids: torch.Tensor,
                       slot_of: torch.Tensor, x_rows: str, chunked: bool) -> None:
    """``check_expert_inputs`` plus the activation's shape ([T, K] token rows, [T k, K] pair
    rows) and device."""
    check_expert_inputs(w, n, slot_of, x_rows, "moe_gemv", ids, chunked=chunked)
    t, k = ids.shape
    rows, kx = qx.shape
    want = t if x_rows == "token" else t * k
    if kx != w.k or rows != want:
        raise ValueError(f"moe_gemv: x must be [{want}, {w.k}] ({x_rows} rows), got "
                         f"[{rows}, {kx}]")  # fmt: skip
    if qx.xq.device != w.device:
        raise ValueError(f"moe_gemv: x is on {qx.xq.device}, the weights on {w.device}")


def moe_gemv(w_stack: PackedWeight, n: int, qx: QuantizedX, ids: torch.Tensor,
             slot_of: torch.Tensor, x_rows: str, out: torch.Tensor | None = None,
             cfg: Q8Config | None = None, chunks: ExpertChunks | None = None,
             ahead: bool = False) -> torch.Tensor:
    """The chosen experts' GEMVs: out[p] = W_slot(ids[p]) x_row(p), float32 ``[T * k, n]``.

    w_stack: packed ``[S * n, K]`` (slot s = rows s n ..); with ``chunks`` (slots stored in
    chunks, ``ExpertChunks``) only its format, K and arrays' dtypes and row widths are used
    (any number of rows, e.g. one slot's weight). qx: the activation from
    gemv_q8.quantize_x (or a norm / gated_act kernel's ``quantized`` output): ``[T, K]`` for
    ``x_rows="token"`` (pair t k + j reads row t), ``[T * k, K]`` for ``"pair"`` (pair p reads
    row p). ids: int32 ``[T, k]`` expert ids (device). slot_of: int32 ``[E]``, each expert's
    slot or -1 (its pairs' rows are 0; an id outside [0, E) too). ``out``: optional
    contiguous float32 ``[T * k, n]``, written in full. ``cfg``: gemv_q8's tile (default
    ``moe_gemv_config``). ``ahead``: the caller's promise that the kernel launched just before
    this one writes neither ids, slot_of nor the weights (a down projection after the gated
    activation): with PDL the programs then find their slot and load their first weights
    before waiting on it (deimos.quant.triton.pdl)."""
    _check_gemv_inputs(w_stack, n, qx, ids, slot_of, x_rows, chunks is not None)
    t, k = ids.shape
    out = gemv_out(out, t * k, n, w_stack.device, "moe_gemv")
    if t * k == 0:
        return out
    cfg = cfg or moe_gemv_config(w_stack, n)
    arrays, tables, widths, spc, chunked = slot_arrays(w_stack, chunks, "moe_gemv")
    _moe_gemv_kernel[gemv_grid(n, t * k, cfg.block_n)](
        *arrays, *tables, qx.xq, qx.xd, qx.xs, out, ids, slot_of,
        n, w_stack.k, slot_of.numel(), k, *widths, spc,
        FMT=FMT_ID[w_stack.ggml_type], BLOCK_N=cfg.block_n, BLOCK_S=cfg.block_s,
        ASM=not _INTERPRETED, XB=cfg.xb, EVEN=(w_stack.k // 32) % cfg.block_s == 0,
        SCALE16=scale16(w_stack), PAIR_ROWS=x_rows == "pair", CHUNKED=chunked,
        AHEAD=ahead and ahead_on(out.device), num_warps=cfg.num_warps,
        **launch_options(pdl_on(out.device)),
    )  # fmt: skip
    return out


def moe_gemv_pair(w_a: PackedWeight, w_b: PackedWeight, n: int, qx: QuantizedX, ids: torch.Tensor,
                  slot_of: torch.Tensor, x_rows: str, chunks_a: ExpertChunks | None = None,
                  chunks_b: ExpertChunks | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(moe_gemv(w_a, ...), moe_gemv(w_b, ...))`` for two stacks that read the same
    activation (a layer's gate and up experts): one launch over both (grid axis 2 picks the
    stack) where they share a format, shape, scale layout and chunking, else two launches.
    One launch less a MoE layer per decode token."""
    chunked = chunks_a is not None
    same = (w_a.ggml_type == w_b.ggml_type and w_a.k == w_b.k and scale16(w_a) == scale16(w_b)
            and sorted(w_a.tensors) == sorted(w_b.tensors) and (chunks_b is not None) == chunked
            and (chunks_a.slots_per_chunk == chunks_b.slots_per_chunk if chunked else w_a.n == w_b.n))  # fmt: skip
    if same:
        arrays_a, tables_a, widths, spc, _ = slot_arrays(w_a, chunks_a, "moe_gemv")
        arrays_b, tables_b, widths_b, _, _ = slot_arrays(w_b, chunks_b, "moe_gemv")
        same = widths == widths_b and all(a.dtype == b.dtype for a, b in zip(arrays_a, arrays_b))
    if not same:
        return (moe_gemv(w_a, n, qx, ids, slot_of, x_rows, chunks=chunks_a),
                moe_gemv(w_b, n, qx, ids, slot_of, x_rows, chunks=chunks_b))
    for w in (w_a, w_b):
        _check_gemv_inputs(w, n, qx, ids, slot_of, x_rows, chunked)
    t, k = ids.shape
    out_a = gemv_out(None, t * k, n, w_a.device, "moe_gemv")
    out_b = gemv_out(None, t * k, n, w_a.device, "moe_gemv")
    if t * k == 0:
        return out_a, out_b
    cfg = moe_gemv_config(w_a, n)
    _moe_gemv_kernel[gemv_grid(n, t * k, cfg.block_n) + (2,)](
        *arrays_a, *tables_a, qx.xq, qx.xd, qx.xs, out_a, ids, slot_of,
        n, w_a.k, slot_of.numel(), k, *widths, spc,
        FMT=FMT_ID[w_a.ggml_type], BLOCK_N=cfg.block_n, BLOCK_S=cfg.block_s,
        ASM=not _INTERPRETED, XB=cfg.xb, EVEN=(w_a.k // 32) % cfg.block_s == 0,
        SCALE16=scale16(w_a), PAIR_ROWS=x_rows == "pair", CHUNKED=chunked, TWO=True,
        p_qw2=arrays_b[0], p_qh2=arrays_b[1], p_s2=arrays_b[2], p_d2=arrays_b[3], p_m2=arrays_b[4],
        t_qw2=tables_b[0], t_qh2=tables_b[1], t_s2=tables_b[2], t_d2=tables_b[3], t_m2=tables_b[4],
        p_y2=out_b, num_warps=cfg.num_warps, **launch_options(pdl_on(out_a.device)),
    )  # fmt: skip
    return out_a, out_b
