"""Prefill and batched decode of a mixture-of-experts layer's routed experts: the (token,
expert) pairs grouped by expert on the device (``moe_align``), then one grouped GEMM over the
packed expert stack (``moe_gemm``). No host sync anywhere: every size is fixed by T, k, E and
block_m, so the step can be a CUDA graph.

``moe_align(ids [T, k], E, block_m)``: pair p = t k + j (expert ids[t, j]) goes into its
expert's run, in increasing pair id; each expert's run is padded with -1 to whole tiles of
block_m; ``tile_expert`` says whose each tile is. The grid of the GEMM is sized from the bound
``max_tiles = min(T k // block_m + E, T k)`` (kernels.moe.moe_max_tiles); tiles past the last
are -1 and exit at once. Three small launches:
  1. count (grid: chunks of ALIGN_CHUNK pairs): each chunk's pairs per expert;
  2. scan (one program): per expert the total, its tiles and first entry, each chunk's offset
     in the expert's run (an exclusive sum over the chunks); writes tile_expert, the -1
     padding and the tile count;
  3. scatter (grid: chunks): each pair's rank among the earlier pairs of its chunk with the
     same expert, plus its chunk's offset: its entry.
Ids outside [0, E) are left out (their output rows are then not written).

``moe_gemm``: program (tile, n block) gathers its block_m pairs' activation rows (x row t for
``x_rows="token"``, p for ``"pair"``), decodes its expert's packed weight tile in registers
with gemm_q's helpers (``group_words``, ``group_scales`` / ``q2k_scales``, ``decode_tile``:
its float16 decode) feeding tl.dot (fp32 accumulation), or for Q4_K in tiles of up to 32
pairs (and Q5_K, Q6_K and Q8_0's layout when asked) through ``mmq``'s products (the code
bytes decoded in the dot's operand layout), and stores each pair's row of the output [T k, n].
A tile whose expert has no slot (slot_of -1) stores zeros. Slots may be stored in chunks (moe_gemv.ExpertChunks: the cache's chunk address tables, read on the device).

Oracles: kernels.moe.moe_align_reference (equal entry for entry) and moe_experts_reference
on the dequantized stack (naive.dequantize_packed; naive.dequantize_packed_half for the
decode's own weights).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from deimos.gguf.constants import GGMLType
from deimos.quant.triton.dequant_gemv import (
    FMT_ID,
    Q2_K,
    Q8_0,
    gemv_out,
    group_scales,
    group_words,
    pow2_at_most,
    q2k_scales,
    scale16,
    words_per_group,
)
from deimos.quant.triton.gemm_q import HALF_DECODE, TILE_ELEMENTS, decode_tile
from deimos.quant.triton.gemv_q8 import _INTERPRETED
from deimos.quant.triton.layout import KERNEL_TYPE, PackedWeight
from deimos.quant.triton.mmq import ELEMENTS, MMQ_TYPES, WORDS, mmq_product
from deimos.quant.triton.moe_gemv import ExpertChunks, check_expert_inputs, slot_arrays, slot_base
from deimos.quant.triton.pdl import launch_options, pdl_on, pdl_start
from deimos.switches import env_switch

# Q4_K experts through deimos.quant.triton.mmq unless DEIMOS_MOE_MMQ=0. H100, session 49
# (bench/exp_gemm_mmq.py, 128 stacked [1536, 2048] experts): Q4_K 181 us against gemm_q's 437 at
# 16 rows, 295 against 604 at 32; Q6_K's mmq ran slower than gemm_q (529 against 377 us at 16
# rows, 597 against 527 at 32): Q6_K stays on gemm_q's decode unless asked (mmq=True). At 64
# rows an expert mmq's best tile took 552 us against gemm_q's 481: tiles of 64 rows stay on
# gemm_q (qwen3moe's prompt steps over 512 tokens)
MMQ_ON = env_switch("DEIMOS_MOE_MMQ", True)
MMQ_DEFAULT_TYPES = (GGMLType.Q4_K,)
MMQ_MAX_BLOCK_M = 32
ALIGN_CHUNK = 128  # pairs a program of the count and scatter passes
MAX_PAIRS = 1 << 17  # the scan holds every chunk's count of an expert block: 1024 chunks
BLOCK_MS = (16, 32, 64)


# ---- moe_align ------------------------------------------------------------------------------


@triton.jit
def _align_count_kernel(p_ids, p_count, P, E, CHUNK: tl.constexpr, E_BLOCK: tl.constexpr,
                        PDL: tl.constexpr = False):
    """count[c, e] = pairs of chunk c with expert e."""
    pdl_start(PDL)
    i_c = tl.program_id(0)
    o_p = i_c * CHUNK + tl.arange(0, CHUNK)
    b_e = tl.load(p_ids + o_p, mask=o_p < P, other=-1)
    for e0 in range(0, E, E_BLOCK):
        o_e = e0 + tl.arange(0, E_BLOCK)
        b_c = tl.sum((b_e[:, None] == o_e[None, :]).to(tl.int32), axis=0)
        tl.store(p_count + i_c * E + o_e, b_c, mask=o_e < E)


@triton.jit
def _align_scan_kernel(p_count, p_base, p_order, p_tile_e, p_n_tiles, NC, E, MAX_TILES,
                       BLOCK_M: tl.constexpr, NC_PAD: tl.constexpr, E_BLOCK: tl.constexpr,
                       T_BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """One program. Per expert block: totals over the NC chunks, tiles, first entry;
    base[c, e] = first entry + pairs of e in chunks before c; tile_expert of e's tiles; -1 in
    the padding of e's last tile. Then the tile count and -1 past the last tile."""
    pdl_start(PDL)
    o_c = tl.arange(0, NC_PAD)
    m_c = o_c < NC
    o_r = tl.arange(0, BLOCK_M)
    o_j = tl.arange(0, 4)  # an expert's tiles, 4 at a time
    tiles = tl.zeros([], dtype=tl.int32)  # tiles of the experts before the block
    for e0 in range(0, E, E_BLOCK):
        o_e = e0 + tl.arange(0, E_BLOCK)
        m_e = o_e < E
        m_ce = m_c[:, None] & m_e[None, :]
        o_ce = o_c[:, None] * E + o_e[None, :]
        b_c = tl.load(p_count + o_ce, mask=m_ce, other=0)  # [NC_PAD, E_BLOCK]
        total = tl.sum(b_c, axis=0)
        n_t = (total + BLOCK_M - 1) // BLOCK_M
        t_end = tiles + tl.cumsum(n_t, axis=0)
        t_start = t_end - n_t
        start = t_start * BLOCK_M
        tl.store(p_base + o_ce, start[None, :] + tl.cumsum(b_c, axis=0) - b_c, mask=m_ce)
        for j0 in range(0, tl.max(n_t, axis=0), 4):
            o_t = j0 + o_j
            tl.store(p_tile_e + t_start[:, None] + o_t[None, :], o_e[:, None] + 0 * o_t[None, :],
                     mask=m_e[:, None] & (o_t[None, :] < n_t[:, None]))
        o_h = (start + total)[:, None] + o_r[None, :]  # after the run, to the tile's end
        tl.store(p_order + o_h, tl.full([E_BLOCK, BLOCK_M], -1, dtype=tl.int32),
                 mask=m_e[:, None] & (o_h < t_end[:, None] * BLOCK_M))
        tiles += tl.sum(n_t, axis=0)
    tl.store(p_n_tiles, tiles)
    for t0 in range(tiles, MAX_TILES, T_BLOCK):
        o_t = t0 + tl.arange(0, T_BLOCK)
        m_t = o_t < MAX_TILES
        tl.store(p_tile_e + o_t, tl.full([T_BLOCK], -1, dtype=tl.int32), mask=m_t)
        o_q = o_t[:, None] * BLOCK_M + o_r[None, :]
        tl.store(p_order + o_q, tl.full([T_BLOCK, BLOCK_M], -1, dtype=tl.int32), mask=m_t[:, None])


@triton.jit
def _align_scatter_kernel(p_ids, p_base, p_order, P, E, CHUNK: tl.constexpr,
                          PDL: tl.constexpr = False):
    """order[base[c, e] + rank] = p for every pair p of chunk c (rank: the chunk's earlier
    pairs with the same expert e)."""
    pdl_start(PDL)
    i_c = tl.program_id(0)
    o_q = tl.arange(0, CHUNK)
    o_p = i_c * CHUNK + o_q
    b_e = tl.load(p_ids + o_p, mask=o_p < P, other=-1)
    m_p = (b_e >= 0) & (b_e < E)
    same = (b_e[None, :] == b_e[:, None]) & (o_q[None, :] < o_q[:, None])
    rank = tl.sum(same.to(tl.int32), axis=1)
    b_base = tl.load(p_base + i_c * E + b_e, mask=m_p, other=0)
    tl.store(p_order + b_base + rank, o_p, mask=m_p)


class MoeTiles(NamedTuple):
    """Pairs grouped by expert (``moe_align``), on the device.

    order: int32 ``[max_tiles * block_m]`` pair ids, expert by expert, each expert's run padded
    with -1 to whole tiles, -1 after the last tile; tile_expert: int32 ``[max_tiles]``, each
    tile's expert, -1 past the last; n_tiles: int32 ``[1]``, the tiles in use. block_m, top_k,
    n_tokens (T) and n_expert (E) describe the shapes (host ints)."""

    order: torch.Tensor
    tile_expert: torch.Tensor
    n_tiles: torch.Tensor
    block_m: int
    top_k: int
    n_tokens: int
    n_expert: int

    @property
    def max_tiles(self) -> int:
        return self.tile_expert.shape[0]


def max_tiles(n_pairs: int, n_expert: int, block_m: int) -> int:
    """The tiles ``moe_align`` may use: sum over e of ceil(c_e / block_m) < n_pairs / block_m + E,
    and every tile holds a pair."""
    return min(n_pairs // block_m + n_expert, n_pairs)


def moe_block_m(n_pairs: int, n_expert: int) -> int:
    """The tile height for ``n_pairs`` pairs over ``n_expert`` experts (not yet measured): a
    tile decodes its expert's weight tile once for its block_m rows, and padding rows cost only
    tensor-core work (their x loads are masked), so the rule takes the tile that holds an
    average expert's pairs in one: 16 up to 16 pairs an expert (decode batches), 32, then 64
    (prefill). Not 128: its tiles need 214-255 registers a thread on sm_90 (the compile check)."""
    avg = n_pairs / max(n_expert, 1)
    return 16 if avg <= 16 else 32 if avg <= 32 else 64


def empty_tiles(n_tokens: int, top_k: int, n_expert: int, block_m: int,
                device: torch.device | str) -> MoeTiles:
    """Buffers for ``moe_align``'s output (static buffers of a CUDA graph)."""
    mt = max_tiles(n_tokens * top_k, n_expert, block_m)
    return MoeTiles(torch.empty(mt * block_m, dtype=torch.int32, device=device),
                    torch.empty(mt, dtype=torch.int32, device=device),
                    torch.empty(1, dtype=torch.int32, device=device), block_m, top_k, n_tokens,
                    n_expert)  # fmt: skip


def scan_blocks(n_chunks: int, block_m: int) -> dict[str, int]:
    """The scan's block sizes: every chunk's counts of E_BLOCK experts, and E_BLOCK x block_m
    padding entries, T_BLOCK x block_m tail entries, within 4096 / 2048 / 1024 elements."""
    nc_pad = triton.next_power_of_2(n_chunks)
    return {"NC_PAD": nc_pad, "E_BLOCK": max(2, min(64, 4096 // nc_pad, 2048 // block_m)),
            "T_BLOCK": max(8, 1024 // block_m)}


def moe_align(ids: torch.Tensor, n_expert: int, block_m: int, out: MoeTiles | None = None) -> MoeTiles:
    """Group the pairs of ``ids`` (contiguous int32 ``[T, k]``, expert ids on the device) by
    expert into tiles of ``block_m`` (16, 32 or 64) rows: a ``MoeTiles`` (written in full;
    ``out``: one from ``empty_tiles`` with the same T, k, E, block_m). Ids outside
    [0, n_expert) are left out. Three launches, no host sync (module docstring)."""
    if ids.dim() != 2 or ids.dtype != torch.int32 or not ids.is_contiguous():
        raise ValueError(f"moe_align: ids must be contiguous int32 [T, k], got {ids.dtype} "
                         f"{tuple(ids.shape)}")  # fmt: skip
    if block_m not in BLOCK_MS:
        raise ValueError(f"moe_align: block_m = {block_m} not one of {BLOCK_MS}")
    if not (isinstance(n_expert, int) and 1 <= n_expert <= 4096):
        raise ValueError(f"moe_align: n_expert = {n_expert} not in 1..4096")
    t, k = ids.shape
    p = t * k
    if not 1 <= p <= MAX_PAIRS:
        raise ValueError(f"moe_align: T * k = {p} pairs not in 1..{MAX_PAIRS}")
    if out is None:
        out = empty_tiles(t, k, n_expert, block_m, ids.device)
    want = empty_tiles(t, k, n_expert, block_m, "meta")
    if (out.block_m, out.top_k, out.n_tokens, out.n_expert) != (block_m, k, t, n_expert) or any(
            a.shape != b.shape or a.dtype != b.dtype or not a.is_contiguous() or a.device != ids.device
            for a, b in zip(out[:3], want[:3])):  # fmt: skip
        raise ValueError(f"moe_align: out must be empty_tiles({t}, {k}, {n_expert}, {block_m}) on "
                         f"{ids.device}")  # fmt: skip
    nc = triton.cdiv(p, ALIGN_CHUNK)
    count = torch.empty((nc, n_expert), dtype=torch.int32, device=ids.device)
    base = torch.empty((nc, n_expert), dtype=torch.int32, device=ids.device)
    pdl = launch_options(pdl_on(ids.device))
    _align_count_kernel[(nc,)](ids, count, p, n_expert, CHUNK=ALIGN_CHUNK, E_BLOCK=64, num_warps=4,
                               **pdl)  # fmt: skip
    _align_scan_kernel[(1,)](
        count, base, out.order, out.tile_expert, out.n_tiles, nc, n_expert, out.max_tiles,
        BLOCK_M=block_m, **scan_blocks(nc, block_m), num_warps=4, **pdl,
    )  # fmt: skip
    _align_scatter_kernel[(nc,)](ids, base, out.order, p, n_expert, CHUNK=ALIGN_CHUNK, num_warps=4,
                                 **pdl)  # fmt: skip
    return out


# ---- moe_gemm -------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["TOP_K", "stride_xm"])
def _moe_gemm_kernel(
    p_x, p_qw, p_qh, p_s, p_d, p_m, t_qw, t_qh, t_s, t_d, t_m, p_y, p_order, p_tile_e, p_slot,
    N, K, TOP_K, stride_xm, r_qw, r_qh, r_s, r_d, r_m, SPC,
    FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr,
    PAIR_ROWS: tl.constexpr, X_PERMUTED: tl.constexpr, EVEN: tl.constexpr,
    SCALE16: tl.constexpr = False, CHUNKED: tl.constexpr = False, PDL: tl.constexpr = False,
    ASM: tl.constexpr = False, HALF: tl.constexpr = True, MMQ: tl.constexpr = False,
):  # fmt: skip
    """Program (i_t, i_n): the pairs of tile i_t (its expert's slot) times rows i_n BLOCK_N ..
    of that slot. X_PERMUTED: x's columns are in the packed words' order (gemm_q's contract),
    else in element order (gathered here per group). EVEN: BLOCK_J / W groups divide K / 32.
    MMQ (Q4_K, Q6_K): the codes decoded in the dot's operand layout (mmq.q4k_product /
    q6k_product; BLOCK_J unused)."""
    pdl_start(PDL)
    W: tl.constexpr = 8 if FMT == Q8_0 else (2 if FMT == Q2_K else 4)
    NK: tl.constexpr = 32 // W
    BLOCK_S: tl.constexpr = BLOCK_J // W  # groups of 32 a step
    BLOCK_K: tl.constexpr = BLOCK_S * 32
    i_t = tl.program_id(0)
    i_n = tl.program_id(1)
    e = tl.load(p_tile_e + i_t)
    if e >= 0:  # a tile in use
        slot = tl.load(p_slot + e)
        o_m = tl.arange(0, BLOCK_M)
        b_pair = tl.load(p_order + i_t * BLOCK_M + o_m)
        m_m = b_pair >= 0
        pair = tl.where(m_m, b_pair, 0).to(tl.int64)
        o_y = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
        p_out = p_y + pair[:, None] * N + o_y[None, :]
        m_out = m_m[:, None] & (o_y < N)[None, :]
        if slot < 0:
            tl.store(p_out, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), mask=m_out)
        else:
            S_TOTAL = K // 32
            # the slot's arrays (slot_base: one stack or a chunk), its rows past N clamped
            # (loaded, never stored)
            p_qw = slot_base(p_qw, t_qw, slot, N, r_qw, SPC, CHUNKED)
            p_qh = slot_base(p_qh, t_qh, slot, N, r_qh, SPC, CHUNKED)
            p_s = slot_base(p_s, t_s, slot, N, r_s, SPC, CHUNKED)
            p_d = slot_base(p_d, t_d, slot, N, r_d, SPC, CHUNKED)
            p_m = slot_base(p_m, t_m, slot, N, r_m, SPC, CHUNKED)
            o_n = tl.minimum(o_y, N - 1).to(tl.int64)
            m_n = o_n >= 0  # all true: the shape the loop's masks broadcast from
            if PAIR_ROWS:
                row = pair
            else:
                row = pair // TOP_K
            if MMQ:  # mmq's products over all of K (its blocks of 256)
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                p_xr = p_x + row[:, None] * stride_xm
                if X_PERMUTED:
                    X_ORDER: tl.constexpr = WORDS
                else:
                    X_ORDER: tl.constexpr = ELEMENTS
                acc = mmq_product(acc, FMT, p_qw, p_qh, p_s, p_d, r_qw, r_qh, r_s, r_d, o_n, p_xr, m_m, 0, K // 256,
                                  X_ORDER, HALF, ASM, SCALE16)
            else:
                o_kk = tl.arange(0, BLOCK_K)
                if X_PERMUTED:
                    o_col = o_kk
                else:  # permuted column c of a group holds element (c % NK) W + c // NK
                    r = o_kk % 32
                    o_col = o_kk - r + (r % NK) * W + r // NK
                p_xt = p_x + row[:, None] * stride_xm + o_col[None, :]
                o_s = tl.arange(0, BLOCK_S)
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for s0 in range(0, S_TOTAL, BLOCK_S):
                    u = s0 + o_s
                    m_s = u < S_TOTAL
                    m_ns = m_n[:, None] & m_s[None, :]
                    b_w, b_h, _ = group_words(p_qw, p_qh, o_n, m_n, u, m_s, S_TOTAL, FMT, not EVEN)
                    if FMT == Q2_K:
                        sc_lo, sc_hi, mn_lo, mn_hi = q2k_scales(p_s, p_d, p_m, o_n, u, m_ns, S_TOTAL,
                                                                not EVEN)
                    else:
                        sc_lo, sc_hi, mn_lo = group_scales(p_s, p_d, p_m, o_n, u, m_ns, S_TOTAL, FMT,
                                                           not EVEN, SCALE16)
                        mn_hi = mn_lo
                    # [BLOCK_N, BLOCK_K], the words' column order
                    b_wt = decode_tile(b_w, b_h, sc_lo, sc_hi, mn_lo, mn_hi, FMT, BLOCK_N, BLOCK_S,
                                       ASM, HALF)
                    if EVEN:
                        b_x = tl.load(p_xt + s0 * 32, mask=m_m[:, None], other=0.0)
                    else:
                        m_k = s0 * 32 + o_kk < K
                        b_x = tl.load(p_xt + s0 * 32, mask=m_m[:, None] & m_k[None, :], other=0.0)
                    acc = tl.dot(b_x, tl.trans(b_wt), acc, out_dtype=tl.float32)
            tl.store(p_out, acc, mask=m_out)


class MoeGemmConfig(NamedTuple):
    """A launch of ``moe_gemm`` (block_m is the tile map's)."""

    block_n: int  # weight rows a program
    block_j: int  # code words of each weight row a loop step (block_j * 32 / W columns)
    num_warps: int
    num_stages: int


# Triton's interpreter runs programs one after another: the fewest programs and steps win
INTERPRETER_TILE = MoeGemmConfig(64, 64, 4, 1)


def moe_gemm_config(ggml_type: GGMLType, n: int, k: int, block_m: int) -> MoeGemmConfig:
    """The launch rule, from ``bench/sweep_moe_gemm.py`` at qwen35moe's expert shapes (512
    tokens over 256 experts, k 8; gate [512, 2048] Q4_K, down [2048, 512] Q6_K; H200,
    2026-12-04): below block_m 64, tiles of 128 weight rows x 128 columns on 4 warps (gate
    574 -> 489 us, down 466 -> 397 us against the earlier 64-row rule at block_m 16; the best
    of 12 tiles at block_m 16 and 32); from 64, 128 rows x 64 columns on 8 warps (the best
    there). 3 pipeline stages of the gathered x tile. ``ggml_type``: the kernel format (a
    format packed in another's layout gets that layout's rule)."""
    del n, k
    t = KERNEL_TYPE.get(GGMLType(ggml_type), GGMLType(ggml_type))
    nk = 32 // words_per_group(t)
    if block_m >= 64:
        return MoeGemmConfig(128, (TILE_ELEMENTS // 128) // nk, 8, 3)
    return MoeGemmConfig(128, 128 // nk, 4, 3)


def _check_config(cfg: MoeGemmConfig, wpg: int) -> None:
    nk = 32 // wpg
    ok = (pow2_at_most(cfg.block_n, 256) and cfg.block_n >= 16 and pow2_at_most(cfg.block_j, 1024)
          and cfg.block_j >= wpg and 16 <= cfg.block_j * nk <= 1024 and cfg.num_warps in (1, 2, 4, 8)
          and 1 <= cfg.num_stages <= 6)  # fmt: skip
    if not ok:
        raise ValueError(f"moe_gemm: bad tile {cfg} (block_n a power of two in 16..256; block_j one "
                         f"from {wpg} (a group's words) with block_j * {nk} columns in 16..1024; "
                         "num_warps 1, 2, 4 or 8; 1..6 stages)")


def _use_mmq(mmq: bool | None, ggml_type, block_m: int, k: int = 256) -> bool:
    """moe_gemm's ``mmq``: None, the default (``DEIMOS_MOE_MMQ``, Q4_K, tiles up to
    MMQ_MAX_BLOCK_M rows); True, any format mmq has a product for (K a multiple of 256, its
    blocks: Q8_0's layout may have other K); False, none."""
    if k % 256:
        return False
    if mmq is None:
        return MMQ_ON and ggml_type in MMQ_DEFAULT_TYPES and block_m <= MMQ_MAX_BLOCK_M
    return bool(mmq) and ggml_type in MMQ_TYPES


def moe_gemm(x: torch.Tensor, w_stack: PackedWeight, n: int, tiles: MoeTiles, slot_of: torch.Tensor,
             x_rows: str, x_permuted: bool = True, out: torch.Tensor | None = None,
             cfg: MoeGemmConfig | None = None, chunks: ExpertChunks | None = None,
             mmq: bool | None = None) -> torch.Tensor:
    """The chosen experts' products for many tokens: out[p] = W_slot(ids[p]) x_row(p), float32
    ``[T * k, n]``, one launch over the tile map of ``moe_align``.

    x: float16 ``[T, K]`` (``x_rows="token"``: pair t k + j reads row t) or ``[T * k, K]``
    (``"pair"``: pair p reads row p), unit column stride; its columns in the stack's packed
    words' order (``x_permuted``, gemm_q's contract: x[:, dequant.permuted_columns(w)]) or in
    element order (``x_permuted=False``: the kernel gathers them, no permuted copy).
    w_stack: packed ``[S * n, K]`` (slot s = rows s n ..; with ``chunks``, slots stored in
    chunks, only its format, K and arrays are used: moe_gemv). tiles: ``moe_align`` of the step's
    ids. slot_of: int32 ``[E]``, each expert's slot or -1 (its rows are 0). ``out``: optional
    contiguous float32 ``[T * k, n]``; every pair's row with an id in [0, E) is written.
    ``cfg``: the tile (default ``moe_gemm_config``; ``INTERPRETER_TILE`` for a stack on the
    CPU). ``mmq``: True, Q4_K, Q5_K, Q6_K and Q8_0's layout through deimos.quant.triton.mmq (K
    a multiple of 256); None, Q4_K in tiles of up to 32 rows unless ``DEIMOS_MOE_MMQ=0``; other
    formats ignore it."""
    check_expert_inputs(w_stack, n, slot_of, x_rows, "moe_gemm", chunked=chunks is not None)
    if tiles.order.device != w_stack.device:
        raise ValueError(f"moe_gemm: the tiles are on {tiles.order.device}, the weights on "
                         f"{w_stack.device}")  # fmt: skip
    if slot_of.numel() != tiles.n_expert:
        raise ValueError(f"moe_gemm: slot_of has {slot_of.numel()} experts, the tiles were made for "
                         f"{tiles.n_expert}")  # fmt: skip
    t, k = tiles.n_tokens, tiles.top_k
    want = t if x_rows == "token" else t * k
    if x.dim() != 2 or x.shape != (want, w_stack.k) or x.dtype != torch.float16:
        raise ValueError(f"moe_gemm: x must be float16 [{want}, {w_stack.k}] ({x_rows} rows), got "
                         f"{x.dtype} {tuple(x.shape)}")  # fmt: skip
    if x.stride(1) != 1:
        raise ValueError("moe_gemm: x needs unit column stride")
    if x.device != w_stack.device:
        raise ValueError(f"moe_gemm: x is on {x.device}, the weights on {w_stack.device}")
    out = gemv_out(out, t * k, n, w_stack.device, "moe_gemm")
    wpg = words_per_group(w_stack.ggml_type)
    if cfg is None:
        cfg = (INTERPRETER_TILE if w_stack.device.type == "cpu"
               else moe_gemm_config(w_stack.ggml_type, n, w_stack.k, tiles.block_m))  # fmt: skip
    _check_config(cfg, wpg)
    n_blocks = triton.cdiv(n, cfg.block_n)
    if n_blocks > 65535:
        raise ValueError(f"moe_gemm: {n} rows a slot do not fit a CUDA grid")
    arrays, tables, widths, spc, chunked = slot_arrays(w_stack, chunks, "moe_gemm")
    _moe_gemm_kernel[(tiles.max_tiles, n_blocks)](
        x, *arrays, *tables, out, tiles.order, tiles.tile_expert, slot_of,
        n, w_stack.k, k, x.stride(0), *widths, spc,
        FMT=FMT_ID[w_stack.ggml_type], BLOCK_M=tiles.block_m, BLOCK_N=cfg.block_n,
        BLOCK_J=cfg.block_j, PAIR_ROWS=x_rows == "pair", X_PERMUTED=bool(x_permuted),
        EVEN=(w_stack.k // 32) % (cfg.block_j // wpg) == 0, SCALE16=scale16(w_stack),
        CHUNKED=chunked, ASM=not _INTERPRETED, HALF=HALF_DECODE,
        MMQ=_use_mmq(mmq, w_stack.ggml_type, tiles.block_m, w_stack.k),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **launch_options(pdl_on(out.device)),
    )  # fmt: skip
    return out
