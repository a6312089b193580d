"""Split-K decode attention over the KV cache (flash-decoding, Triton).
Oracles: deimos.kernels.attention.causal_attention with k_pos = arange(S) (contiguous cache),
paged_attention_reference (paged cache).

q ``[B, Hq, D]`` at positions ``q_pos[B]`` (int32 on the device, so a CUDA graph can replay it
while the lengths grow). Two cache layouts:

- contiguous, ``k, v [S, Hkv, D]`` (deimos.runtime.kv_cache's per-layer layout; S = the
  capacity or any prefix of it that covers every q_pos): the B rows are queries of ONE
  sequence (1 for plain decode, more for drafted tokens), key s in row s;
- paged, ``block_tables`` int32 ``[B, MAXB]`` and ``k, v [n_slots, Hkv, D]`` the layer's pools
  (n_slots = n_blocks * block_size): every row b is ITS OWN sequence, its key s in the slot
  ``block_tables[b, s // block_size] * block_size + s % block_size``; S = MAXB * block_size.
  Each key's slot is computed inside the key loop from a vectorized load of the table
  entries of the tile (L1-resident), so block_size (a power of two) and the key tile need
  not divide each other.

Row b sees keys s <= q_pos[b] and, with a window W > 0, q_pos[b] - s < W.

Stage 1, grid (B * Hkv, n_split): a program takes one kv head, the G = Hq / Hkv query heads
that share it (GQA: each K/V byte is read once per group, not per head) and one split of the
keys; it runs an online softmax over BLOCK_S-key tiles and writes its partial (max, sum, acc).
The G heads are padded to 16 rows so both products are ``tl.dot`` (sm_90 needs M >= 16); the
padding costs tensor-core work only, and decode is bound by reading K/V. Splits that lie past
q_pos (or before the window) exit after writing an empty partial (max = -inf).
Stage 2, grid (B, Hq): combine the n_split partials of a head: out = sum_j e^(m_j - M) acc_j /
sum_j e^(m_j - M) l_j (``combine_splits``, also the paged prefill's stage 2). With
``counters`` stage 2 runs inside stage 1's launch instead: the last program of each (row, kv
head) to finish, found with an atomic counter, merges its G heads over only the splits that
hold keys. (Tried in the third session, before PDL and with every split merged: slower on
the H200, BENCHMARKS.md; this form too, session 49 on an H100: qwen3moe's batch-1 decode 18%
slower, so the engine passes ``counters`` only with DEIMOS_ATTN_MERGE=1.)

n_split is chosen from S, B * Hkv and D so stage 1 has about 4 programs per SM of an H200
(132 SMs; ``split_count``, the paged prefill's rule too); it depends only on shapes, so a
captured graph stays valid as q_pos grows. Each program takes 1/n_split of its row's visible
keys (read from q_pos on the device), so the work spreads over every split at any length,
not only over the splits a short row reaches.

Cost (what to compare the H200's ~4.8 TB/s with): stage 1 reads, per row b and kv head, the
K and V rows of its n_b = min(q_pos[b] + 1, W) visible keys, 2 * n_b * D * 2 bytes (fp16),
plus the table's int32 entries of those keys (4 bytes per block from DRAM; the rest L1
hits) and q (Hq * D * 2 bytes per row); it writes B * Hq * n_split * (D + 2) * 4 bytes of
partials, which stage 2 reads back, writing B * Hq * D * 2 bytes of output (plus the
QuantizedX, 1.25 bytes per element, with ``quantized``). Total ~ 4 * Hkv * D * sum_b n_b
bytes: a sequence of 4096 keys with 8 kv heads of 128 is 16.8 MB per layer, ~4 us at 4 TB/s.
The fused new token adds the new k and v reads (2 * Hkv * D * 4 bytes per row for an fp32
projection) and their stores (2 * Hkv * D * 2 bytes per row).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from deimos.kernels.triton._attention_io import check_attention_io
from deimos.kernels.triton._softmax import online_softmax_step
from deimos.kernels.triton.rope import rope_params, rope_tile
from deimos.quant.triton.pdl import launch_options, pdl_on, pdl_start
from deimos.quant.triton.gemv_q8 import quantize_groups

LOG2E = tl.constexpr(1.4426950408889634)
TARGET_PROGRAMS = 528  # ~4 per SM on an H200 (programs of a few tiles each)
GROUP_ROWS = 16  # tl.dot's minimum M on sm_90


@triton.jit
def key_slots(o_k, m_k, p_tab_row, bs_shift, PAGED: tl.constexpr):
    """Cache rows (int64) of the keys at positions ``o_k`` (those in ``m_k``; positions >= 0):
    the positions themselves, or PAGED through the sequence's table row, block_size =
    2^bs_shift keys a block. Shared with the paged prefill kernel."""
    if PAGED:
        b_blk = tl.load(p_tab_row + (o_k >> bs_shift), mask=m_k, other=0)
        return (b_blk.to(tl.int64) << bs_shift) + (o_k & ((1 << bs_shift) - 1))
    else:
        return o_k.to(tl.int64)


# N_SPLIT unspecialized: it follows the row count of an eager step (mixed steps vary theirs),
# and Triton would otherwise build a variant for 1, for multiples of 16 and for the rest
@triton.jit(do_not_specialize=["N_SPLIT"])
def _decode_split_kernel(
    p_q, p_k, p_v, p_pos, p_m, p_l, p_acc,
    sq_b, sq_h, sk_s, sk_h, sv_s, sv_h,
    S, HKV, D, N_SPLIT, scale, window,
    p_kn, p_vn, skn_h, svn_h, p_inv_freq, p_qnw, p_knw, eps, R,
    G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False, ROPE: tl.constexpr = False, NEOX: tl.constexpr = False,
    HAS_NORM: tl.constexpr = False, PAGED: tl.constexpr = False,
    skn_b=0, svn_b=0, p_tab=None, stab_b=0, bs_shift=0,
    MERGE: tl.constexpr = False, p_count=None, p_o=None, so_b=0, so_h=0,
    QUANT: tl.constexpr = False, p_xq=None, p_xd=None, p_xs=None, MERGE_SPLITS: tl.constexpr = 16,
):  # fmt: skip
    """PAGED: the keys of row b through its table row ``p_tab + b * stab_b`` (block_size =
    2^bs_shift), else in the rows of their positions. ROPE: q and the new token's k arrive as
    the projections made them (row b of each); each program rotates (and head-norms) its q
    heads and the new key itself, and the program whose split holds q_pos stores the new key
    and value in the cache row of q_pos (its slot when PAGED) and folds that key in from
    registers; no program reads that row. Without PAGED the B rows share one cache, so ROPE
    is for B = 1 there (the wrapper checks). MERGE: stage 2 in this launch: each program
    counts itself done on its (row, kv head)'s counter at p_count (acquire-release, GPU
    scope); the last one merges the G heads' partials of the splits that hold keys
    (``_merge_head``), stores them at p_o (and the integer activation with QUANT) and resets
    the counter."""
    pdl_start(PDL)
    i_bh = tl.program_id(0)
    i_sp = tl.program_id(1)
    i_b = i_bh // HKV
    i_kv = i_bh % HKV
    pos = tl.load(p_pos + i_b)
    if PAGED:
        p_tab_row = p_tab + i_b.to(tl.int64) * stab_b
    else:
        p_tab_row = p_pos  # never read
    # this row's visible keys [first, pos] cut into N_SPLIT equal runs of whole tiles: the
    # split length follows the row's own length (read on the device), so every split has work
    # at any length while the grid stays the captured one
    first = 0
    if window > 0:
        first = tl.maximum(pos - window + 1, 0)
    first = first - first % BLOCK_S
    split = tl.cdiv(tl.cdiv(pos + 1 - first, N_SPLIT), BLOCK_S) * BLOCK_S
    lo = first + i_sp * split
    own = (pos >= lo) & (pos < lo + split)  # this split holds the query's own key
    # keys [lo, hi) of this split, before the window (the S bound only guards a bad q_pos);
    # with ROPE the key at q_pos comes from registers, not the cache
    hi = tl.minimum(tl.minimum(lo + split, pos if ROPE else pos + 1), S)
    if window > 0:
        lo = tl.maximum(lo, pos - window + 1)
    o_g = tl.arange(0, G_PAD)
    o_d = tl.arange(0, BLOCK_D)
    m_g = o_g < G
    m_d = o_d < D
    o_h = i_kv * G + o_g  # query heads of the group
    if ROPE:  # q and the new key together: their loads overlap
        posf = pos.to(tl.float32)
        b_qf, m_qf = rope_tile(p_q + i_b.to(tl.int64) * sq_b, p_inv_freq, posf, i_kv * G, sq_h,
                               i_kv * G + G, D, R, p_qnw, eps, NEOX, G_PAD, BLOCK_D,
                               HAS_NORM)  # fmt: skip
        b_q = b_qf.to(p_k.dtype.element_ty)
        kt, m_kt = rope_tile(p_kn + i_b.to(tl.int64) * skn_b, p_inv_freq, posf, i_kv, skn_h,
                             i_kv + 1, D, R, p_knw, eps, NEOX, 2, BLOCK_D, HAS_NORM)  # fmt: skip
        k_new = tl.sum(kt, axis=0).to(p_k.dtype.element_ty)  # row 1 of the tile is masked
        p_vnb = p_vn + i_b.to(tl.int64) * svn_b + i_kv * svn_h + o_d
        v_new = tl.load(p_vnb, mask=m_d, other=0.0).to(p_v.dtype.element_ty)
    else:
        p_qb = p_q + i_b.to(tl.int64) * sq_b + o_h[:, None] * sq_h + o_d[None, :]
        b_q = tl.load(p_qb, mask=m_g[:, None] & m_d[None, :], other=0.0).to(p_k.dtype.element_ty)
    qk_scale = scale * LOG2E
    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, BLOCK_D], dtype=tl.float32)
    o_s = tl.arange(0, BLOCK_S)
    # start at the tile holding lo (tiles are aligned to BLOCK_S; SPLIT is a multiple of it)
    for s0 in range(lo - lo % BLOCK_S, hi, BLOCK_S):
        o_k = s0 + o_s
        m_s = (o_k >= lo) & (o_k < hi)
        o_row = key_slots(o_k, m_s, p_tab_row, bs_shift, PAGED)
        m_kd = m_s[:, None] & m_d[None, :]
        p_kb = p_k + o_row[:, None] * sk_s + i_kv * sk_h + o_d[None, :]
        p_vb = p_v + o_row[:, None] * sv_s + i_kv * sv_h + o_d[None, :]
        b_k = tl.load(p_kb, mask=m_kd, other=0.0)
        b_v = tl.load(p_vb, mask=m_kd, other=0.0)
        qk = tl.dot(b_q, tl.trans(b_k), out_dtype=tl.float32) * qk_scale  # [G_PAD, BLOCK_S]
        qk = tl.where(m_s[None, :], qk, float("-inf"))
        m_i, l_i, acc = online_softmax_step(qk, b_v, m_i, l_i, acc)
    if ROPE:
        if own:
            p_row = key_slots(pos, True, p_tab_row, bs_shift, PAGED)
            tl.store(p_k + p_row * sk_s + i_kv * sk_h + o_d, k_new, mask=m_d)
            tl.store(p_v + p_row * sv_s + i_kv * sv_h + o_d, v_new, mask=m_d)
            qk1 = tl.sum(b_q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * qk_scale
            m_new = tl.maximum(m_i, qk1)  # finite: the key is always visible
            alpha = tl.exp2(m_i - m_new)
            p1 = tl.exp2(qk1 - m_new)
            l_i = l_i * alpha + p1
            acc = acc * alpha[:, None] + p1[:, None] * v_new.to(tl.float32)[None, :]
            m_i = m_new
    # partials of head h, split j at [(b * Hq + h) * N_SPLIT + j]
    o_part = (i_b.to(tl.int64) * (HKV * G) + o_h) * N_SPLIT + i_sp
    tl.store(p_m + o_part, m_i, mask=m_g)
    tl.store(p_l + o_part, l_i, mask=m_g)
    tl.store(p_acc + o_part[:, None] * D + o_d[None, :], acc,
             mask=m_g[:, None] & m_d[None, :])  # fmt: skip
    if MERGE:
        tl.debug_barrier()  # every thread's partials stored before the count says so
        done = tl.atomic_add(p_count + i_bh, 1, sem="acq_rel", scope="gpu")
        if done == N_SPLIT - 1:  # the last split of this row and kv head: all partials in
            n_live = tl.minimum((pos - first) // split + 1, N_SPLIT)  # splits that hold keys
            for g in range(G):
                h = i_kv * G + g
                out = _merge_head(p_m, p_l, p_acc, (i_b.to(tl.int64) * (HKV * G) + h) * N_SPLIT, n_live,
                                  o_d, m_d, D, MERGE_SPLITS)  # fmt: skip
                b_o = out.to(p_o.dtype.element_ty)
                tl.store(p_o + i_b.to(tl.int64) * so_b + h * so_h + o_d, b_o, mask=m_d)
                if QUANT:
                    _quantize_head(b_o, p_xq, p_xd, p_xs, i_b, h, HKV * G, D, BLOCK_D)
            tl.atomic_xchg(p_count + i_bh, 0, sem="relaxed", scope="gpu")


@triton.jit
def _merge_head(p_m, p_l, p_acc, base, n_live, o_d, m_d, D, CHUNK: tl.constexpr):
    """One head's output from its first n_live partials at base + j, read past L1 (other
    programs wrote them): the max over them, then sum_j 2^(m_j - M) acc_j / sum_j 2^(m_j - M)
    l_j in chunks of CHUNK splits (a split with max -inf adds nothing)."""
    o_j = tl.arange(0, CHUNK)
    big = tl.full([CHUNK], float("-inf"), dtype=tl.float32)
    for j0 in range(0, n_live, CHUNK):
        b_m = tl.load(p_m + base + j0 + o_j, mask=j0 + o_j < n_live, other=float("-inf"), cache_modifier=".cg")
        big = tl.maximum(big, b_m)
    top = tl.max(big, axis=0)
    num = tl.zeros(o_d.shape, dtype=tl.float32)
    den = tl.zeros([CHUNK], dtype=tl.float32)
    for j0 in range(0, n_live, CHUNK):
        m_j = j0 + o_j < n_live
        b_m = tl.load(p_m + base + j0 + o_j, mask=m_j, other=float("-inf"), cache_modifier=".cg")
        b_l = tl.load(p_l + base + j0 + o_j, mask=m_j, other=0.0, cache_modifier=".cg")
        w = tl.exp2(b_m - top)
        p_a = p_acc + (base + j0 + o_j)[:, None] * D + o_d[None, :]
        b_acc = tl.load(p_a, mask=m_j[:, None] & m_d[None, :], other=0.0, cache_modifier=".cg")
        num += tl.sum(b_acc * w[:, None], axis=0)
        den += b_l * w
    return num / tl.sum(den, axis=0)


@triton.jit
def _quantize_head(b_o, p_xq, p_xd, p_xs, i_b, i_h, HQ, D, BLOCK_D: tl.constexpr):
    """Head i_h's D outputs of row i_b as their groups of the row's integer activation
    (``[HQ * D]``, the output projection's input)."""
    G: tl.constexpr = BLOCK_D // 32
    o_g = tl.arange(0, G)
    K = HQ * D
    quantize_groups(tl.reshape(b_o.to(tl.float32), (G, 4, 8)), i_h * (D // 32) + o_g,
                    o_g < D // 32, p_xq + i_b * (K // 2), p_xd + i_b * (K // 32),
                    p_xs + i_b * (K // 16))  # fmt: skip


# p_rows: the paged prefill passes cu_q[B:], 16-byte aligned or not by B (a variant each)
@triton.jit(do_not_specialize=["N_SPLIT"], do_not_specialize_on_alignment=["p_rows"])
def _decode_combine_kernel(
    p_m, p_l, p_acc, p_o, so_b, so_h, HQ, D, N_SPLIT, p_xq, p_xd, p_xs,
    BLOCK_SPLIT: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr, PDL: tl.constexpr = False,
    ROWS: tl.constexpr = False, p_rows=None, SPARSE: tl.constexpr = False,
):  # fmt: skip
    """Row b, head h: the merge of its N_SPLIT partials at [(b * HQ + h) * N_SPLIT + j]; a
    split whose max is -inf (nothing visible) adds nothing. ROWS: rows b >= *p_rows (read on
    the device) are left alone. SPARSE: such a split's acc is not read (its stage 1 need not
    write it), at the price of the acc loads waiting for the max loads. (Both for the paged
    prefill: its rows past cu_q[B], and the many empty splits of short prefixes.)"""
    pdl_start(PDL)
    i_b = tl.program_id(0)
    i_h = tl.program_id(1)
    o_j = tl.arange(0, BLOCK_SPLIT)
    o_d = tl.arange(0, BLOCK_D)
    n_j = N_SPLIT
    n_d = D
    if ROWS:  # a row past the bound: no split read, no column stored
        live = i_b < tl.load(p_rows)
        n_j = tl.where(live, N_SPLIT, 0)
        n_d = tl.where(live, D, 0)
    m_j = o_j < n_j
    m_d = o_d < n_d
    base = (i_b * HQ + i_h) * N_SPLIT
    b_m = tl.load(p_m + base + o_j, mask=m_j, other=float("-inf"))
    b_l = tl.load(p_l + base + o_j, mask=m_j, other=0.0)
    if ROWS:  # a row past the bound merges dummies (max 0, sum 1, acc 0): no 0/0 (not stored)
        b_m = tl.where(live, b_m, 0.0)
        b_l = tl.where(live, b_l, 1.0)
    # the query's own key is always visible, so some split of a real row has a finite max.
    # (Guarding the max and the sum here instead took 87 -> 168 registers at D = 256.)
    w = tl.exp2(b_m - tl.max(b_m, axis=0))
    m_a = m_j
    if SPARSE:
        m_a = m_j & (b_m > float("-inf"))
    p_a = p_acc + (base + o_j)[:, None].to(tl.int64) * D + o_d[None, :]
    b_acc = tl.load(p_a, mask=m_a[:, None] & m_d[None, :], other=0.0)
    out = tl.sum(b_acc * w[:, None], axis=0) / tl.sum(b_l * w, axis=0)
    p_out = p_o + i_b.to(tl.int64) * so_b + i_h * so_h + o_d
    b_o = out.to(p_o.dtype.element_ty)
    tl.store(p_out, b_o, mask=m_d)
    if QUANT:  # the row [Hq * D] also as the output projection's integer activation
        _quantize_head(b_o, p_xq, p_xd, p_xs, i_b, i_h, HQ, D, BLOCK_D)


class DecodeConfig(NamedTuple):
    block_s: int  # keys per tile
    n_split: int  # splits per (row, kv head): each a 1/n_split share of the row's keys
    num_warps: int
    num_stages: int = 3  # Triton's default for sm_90


def split_count(programs: int, s: int, block_s: int, d: int) -> int:
    """Key splits for a grid of ``programs`` (row or tile, kv head) programs over at most
    ``s`` keys in tiles of ``block_s``: programs * n_split ~ TARGET_PROGRAMS, at least 1, at
    most a tile each of s, and at most 16K // D (the combine holds [n_split, D] fp32 partials
    in 4 warps' registers: D = 256 takes 64 splits; 128 splits took all 255 registers, sm_90
    compile). Shapes only: a captured graph stays valid. The paged prefill uses it too."""
    want = max(1, TARGET_PROGRAMS // max(1, programs))
    want = min(want, max(1, 16384 // max(16, triton.next_power_of_2(d))))
    return max(1, min(want, triton.cdiv(s, block_s)))


def decode_config(s: int, b: int, hkv: int, d: int) -> DecodeConfig:
    """BLOCK_S = 64 keys (32 at D = 256: a K and a V tile of 16 KB fp16 each stay in registers
    of 4 warps); n_split so B * Hkv * n_split ~ TARGET_PROGRAMS (``split_count``). Each
    program then takes 1/n_split of its row's visible keys (whole tiles), whatever the row's
    length: B = 16 rows of 550 keys in a 4096-key table run 4 splits of 3 tiles each, where
    splits of fixed keys (S / n_split) left one split of 9 tiles per row with work."""
    block_s = 32 if d > 128 else 64
    return DecodeConfig(block_s, split_count(b * hkv, s, block_s, d), 4)


def variant_rows(s: int, max_rows: int, hkv: int, d: int) -> list[int]:
    """The least row count (of 1..``max_rows``, tables of ``s`` positions) of each kernel
    variant ``decode_attention`` launches under ``decode_config``'s rule: the combine's
    BLOCK_SPLIT is the split count's next power of two, and the split count follows the rows
    (the split kernel's N_SPLIT is not specialized). A warm-up that runs these row counts
    builds every variant an eager step of up to ``max_rows`` rows can ask for."""
    first: dict[int, int] = {}
    for b in range(1, max_rows + 1):
        first.setdefault(triton.next_power_of_2(decode_config(s, b, hkv, d).n_split), b)
    return sorted(first.values())


def combine_splits(part_m: torch.Tensor, part_l: torch.Tensor, part_acc: torch.Tensor,
                   out: torch.Tensor, quantized=None, n_rows: torch.Tensor | None = None,
                   sparse: bool = False, pdl: bool = False) -> None:
    """Stage 2 of a split-K attention: ``out[b, h]`` (``[B, Hq, D]``, last dim contiguous)
    = sum_j 2^(m_j - M) acc_j / sum_j 2^(m_j - M) l_j over the partials ``part_m``, ``part_l``
    fp32 ``[B, Hq, n_split]`` and ``part_acc`` fp32 ``[B, Hq, n_split, D]`` (contiguous; max
    in base 2, acc unnormalized; a split with max -inf adds nothing). ``quantized``: a
    QuantizedX ``[B, Hq * D]`` that also gets the rows. ``n_rows``: an int32 device tensor
    whose first element bounds the rows written (the rest are left alone). ``sparse``: the acc
    of a split with max -inf may be unwritten (it is not read)."""
    n_b, hq, n_split = part_m.shape
    d = out.shape[2]
    qx = quantized if quantized is not None else (out, out, out)
    rows = {} if n_rows is None else {"ROWS": True, "p_rows": n_rows}
    if sparse:
        rows["SPARSE"] = True
    _decode_combine_kernel[(n_b, hq)](
        part_m, part_l, part_acc, out, out.stride(0), out.stride(1), hq, d, n_split,
        qx[0], qx[1], qx[2],
        BLOCK_SPLIT=triton.next_power_of_2(n_split), BLOCK_D=max(16, triton.next_power_of_2(d)),
        QUANT=quantized is not None, num_warps=4, **rows, **launch_options(pdl),
    )  # fmt: skip


class NewToken(NamedTuple):
    """The decode step's own tokens for ``decode_attention`` to rotate and store itself (RoPE
    fused into the attention launch): q is passed un-rotated; k, v ``[B, Hkv, D]`` as the
    projections made them (strided views are fine, last dim contiguous; B = 1 without block
    tables); rotation as deimos.kernels.triton.rope (``inv_freq`` from ``rope_inv_freq``,
    ``rope_type`` "norm"/"neox", optional qk-norm ``head_norms=(q_weight, k_weight, eps)``)."""

    k: torch.Tensor
    v: torch.Tensor
    inv_freq: torch.Tensor
    rope_type: str
    head_norms: tuple[torch.Tensor, torch.Tensor, float] | None = None


def _new_token_args(new: NewToken | None, q: torch.Tensor, k: torch.Tensor,
                    paged: bool) -> tuple[list, dict]:
    """The split kernel's extra arguments for ``new`` (placeholders without it), checked."""
    if new is None:
        return [q, q, 0, 0, q, q, q, 0.0, 2], {}
    n_b, hq, d = q.shape
    hkv = k.shape[1]
    if n_b != 1 and not paged:
        raise ValueError(f"decode_attention: a fused new token needs one query row, got {n_b} "
                         "(B rows of one contiguous cache would read each other's new keys)")
    r, qn, kn, eps = rope_params("decode_attention", d, q.device, new.inv_freq, new.rope_type,
                                 new.head_norms)  # fmt: skip
    for name, t in (("k", new.k), ("v", new.v)):
        if t.shape != (n_b, hkv, d) or t.stride(2) != 1 or t.device != q.device:
            raise ValueError(f"decode_attention: the new token's {name} must be [{n_b}, {hkv}, "
                             f"{d}] on {q.device}, last dim contiguous; got {tuple(t.shape)}")
    args = [new.k, new.v, new.k.stride(1), new.v.stride(1), new.inv_freq, qn, kn, eps, r]
    kw = {"ROPE": True, "NEOX": new.rope_type == "neox", "HAS_NORM": new.head_norms is not None,
          "skn_b": new.k.stride(0), "svn_b": new.v.stride(0)}
    return args, kw


def check_block_tables(op: str, block_tables: torch.Tensor, block_size: int, n_rows: int,
                       pool: torch.Tensor) -> int:
    """Checks a paged cache's tables int32 ``[n_rows, MAXB]`` on the pool's device and
    ``block_size`` (a power of two dividing the pool's ``n_slots`` rows); returns log2 of it."""
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"{op}: block_size must be a power of two, got {block_size}")
    if pool.shape[0] % block_size:
        raise ValueError(f"{op}: the pool's {pool.shape[0]} slots are not whole blocks of "
                         f"{block_size}")
    if block_tables.dim() != 2 or block_tables.shape[0] != n_rows or block_tables.shape[1] < 1:
        raise ValueError(f"{op}: block_tables must be [{n_rows}, MAXB], got "
                         f"{tuple(block_tables.shape)}")
    if block_tables.dtype != torch.int32:
        raise ValueError(f"{op}: block_tables must be int32, got {block_tables.dtype}")
    if block_tables.device != pool.device:
        raise ValueError(f"{op}: block_tables on {block_tables.device}, the pool on {pool.device}")
    if block_tables.stride(1) != 1:
        raise ValueError(f"{op}: block_tables' rows must be contiguous")
    if block_tables.shape[1] * block_size >= 2**31:
        raise ValueError(f"{op}: a table of {block_tables.shape[1]} blocks of {block_size} "
                         f"keys spans S = {block_tables.shape[1] * block_size} >= 2^31 positions")
    if pool.shape[0] >= 2**31:
        raise ValueError(f"{op}: {pool.shape[0]} slots >= 2^31")
    return block_size.bit_length() - 1


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    window: int = 0,
    out: torch.Tensor | None = None,
    quantized=None,
    new: NewToken | None = None,
    block_tables: torch.Tensor | None = None,
    block_size: int = 0,
    cfg: DecodeConfig | None = None,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of B query rows over a KV cache.

    q: ``[B, Hq, D]``; q_pos: int32 (or int64) ``[B]`` on the device; window: sliding window W
    (0 = none). Products run in k's dtype (fp32 caches use TF32 on the GPU), accumulation in
    fp32. Returns ``[B, Hq, D]`` in q's dtype (or ``out``).

    Contiguous (``block_tables`` None): k, v ``[S, Hkv, D]`` (same dtype, fp16/bf16/fp32; last
    dim contiguous), the B rows of one sequence, every q_pos < S and keys 0..q_pos written.
    Paged: ``block_tables`` int32 ``[B, MAXB]`` on the device and ``block_size`` (a power of
    two, 16..256 in the engine) with k, v the pools ``[n_slots, Hkv, D]``: row b is its own
    sequence, its keys 0..q_pos[b] in the slots its table row gives (module docstring);
    q_pos[b] < MAXB * block_size. The split count depends only on (MAXB * block_size, B, Hkv,
    D): a captured graph replays for any positions and table contents. A graph's padding row
    (q_pos 0, a table row of a scratch block) just runs.

    ``quantized``: a ``QuantizedX`` ``[B, Hq * D]`` (D a multiple of 32) that also receives the
    output rows as the output projection's integer activation.
    ``new``: q not yet rotated, and the key/value of q_pos not yet in the cache: this launch
    rotates q and the new key (``NewToken``) and writes the row of q_pos of k and v (the slot
    of q_pos[b] in row b's table when paged; B = 1 when contiguous): what
    ``apply_rope(..., cache=..., slots=...)`` followed by this function does, in one launch
    fewer.
    ``cfg``: the tile, splits, warps and stages (None: ``decode_config``'s rule; a sweep's).
    ``counters``: int32 zeros on the device, at least B * Hkv of them (a ``SplitScratch``'s,
    zero again after the launch): the splits' merge runs in the split launch, by the last
    split of each row and kv head (``MERGE``), instead of a combine launch.
    """
    out = check_attention_io("decode_attention", q, k, v, window, out, q_pos.device, "B")
    n_b, hq, d = q.shape
    n_rows, hkv, _ = k.shape
    if hq // hkv > GROUP_ROWS:
        raise ValueError(f"decode_attention: {hq // hkv} query heads per kv head > {GROUP_ROWS}")
    if q_pos.shape != (n_b,) or q_pos.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"decode_attention: q_pos must be int32 [{n_b}], got "
                         f"{q_pos.dtype} {tuple(q_pos.shape)}")  # fmt: skip
    paged = block_tables is not None
    if paged:
        bs_shift = check_block_tables("decode_attention", block_tables, block_size, n_b, k)
        s = block_tables.shape[1] * block_size
        paged_kw = {"PAGED": True, "p_tab": block_tables, "stab_b": block_tables.stride(0),
                    "bs_shift": bs_shift}
    else:
        if block_size:
            raise ValueError("decode_attention: block_size without block_tables")
        s, paged_kw = n_rows, {}
    if n_b == 0:
        return out
    new_args, new_kw = _new_token_args(new, q, k, paged)
    if cfg is None:
        cfg = decode_config(s, n_b, hkv, d)
    elif cfg.n_split < 1 or cfg.block_s < 16 or cfg.block_s & (cfg.block_s - 1):
        raise ValueError(f"decode_attention: bad config {cfg}")
    f32 = dict(dtype=torch.float32, device=q.device)
    part_m = torch.empty((n_b, hq, cfg.n_split), **f32)
    part_l = torch.empty((n_b, hq, cfg.n_split), **f32)
    part_acc = torch.empty((n_b, hq, cfg.n_split, d), **f32)
    block_d = max(16, triton.next_power_of_2(d))
    if quantized is not None and (d % 32 or tuple(quantized.shape) != (n_b, hq * d)):
        raise ValueError(f"decode_attention: quantized output {tuple(quantized.shape)} does not "
                         f"fit [{n_b}, {hq * d}] (D a multiple of 32)")
    merge = {}
    if counters is not None:
        if counters.dtype != torch.int32 or counters.device != q.device or counters.numel() < n_b * hkv:
            raise ValueError(f"decode_attention: counters must be int32 on {q.device}, at least "
                             f"{n_b * hkv}; got {counters.dtype} {tuple(counters.shape)} on {counters.device}")
        qx = quantized if quantized is not None else (out, out, out)
        merge = dict(MERGE=True, p_count=counters, p_o=out, so_b=out.stride(0), so_h=out.stride(1),
                     QUANT=quantized is not None, p_xq=qx[0], p_xd=qx[1], p_xs=qx[2])  # fmt: skip
    _decode_split_kernel[(n_b * hkv, cfg.n_split)](
        q, k, v, q_pos, part_m, part_l, part_acc,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        s, hkv, d, cfg.n_split, scale, window, *new_args,
        G=hq // hkv, G_PAD=GROUP_ROWS, BLOCK_S=cfg.block_s, BLOCK_D=block_d,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **new_kw, **paged_kw, **merge,
        **launch_options(pdl_on(q.device)),
    )  # fmt: skip
    if not merge:
        combine_splits(part_m, part_l, part_acc, out, quantized, pdl=pdl_on(q.device))
    return out
