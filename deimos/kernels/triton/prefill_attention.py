"""Causal flash attention for prefill with GQA and an optional sliding window (Triton):
``paged_prefill_attention`` (the chunks of B sequences packed, over a paged cache; below) and
``prefill_attention`` (one sequence's chunk over a contiguous cache: the paged kernel with the
cache's rows as the sequence's blocks, in order).
Oracle: deimos.kernels.attention.causal_attention with q_pos = start + arange(T),
k_pos = arange(S); paged: paged_attention_reference, one sequence at a time.

q ``[T, Hq, D]`` holds a chunk at positions start .. start+T-1; k, v ``[S, Hkv, D]`` the cache
with the chunk's own keys already written (S >= start + T; S may be the whole capacity). Query
t sees key s when s <= start + t and, with a window W > 0, start + t - s < W.

Tiles: a program owns BLOCK_M rows of one kv head, where the rows are (token, group head)
pairs ``r = t * G + g`` (G = Hq / Hkv): the G query heads that share a K/V tile sit in the same
M tile, so each K/V byte is loaded once per group instead of once per head. It loops over
BLOCK_N-key tiles from the window's first key to the tile's last query position, with an
online softmax in base 2 (scale * log2 e folded into the scores) and fp32 accumulators;
``tl.dot`` runs on the cache's dtype (fp16) with ``out_dtype=float32``.
Every key tile is masked (causal and window); splitting off the unmasked interior is a
possible speed-up not done yet.

Shared memory (sm_90: 232,448 B per block): Q [M, D] plus num_stages copies of the K and V
tiles [N, D] in fp16. D = 256: M = 64, N = 32, 2 stages -> 32 KB + 2 x 32 KB; D <= 128:
M = 128, N = 64 -> 32 KB + 2 x 32 KB at D = 128. tools/compile_kernels.py checks the real
numbers.

Paged varlen prefill (``paged_prefill_attention``).

q ``[T, Hq, D]`` holds the chunks one after another: sequence b's rows cu_q[b] .. cu_q[b+1]-1
at positions q_start[b] .. q_start[b] + len_b - 1 (a chunk may continue a cached prefix).
Its keys 0 .. q_start[b] + len_b - 1 are already in the pools ``k, v [n_slots, Hkv, D]``
(the rope kernel stored the chunk's own: ``apply_rope(..., cache=..., slots=...)``), key s in
the slot ``block_tables[b, s // block_size] * block_size + s % block_size``. Query t of
sequence b sees its key s when s <= q_start[b] + t and, with a window W > 0,
q_start[b] + t - s < W.

Tiles as above: a program owns BLOCK_M rows of one kv head, the rows being
(token, group head) pairs ``r = t * G + g`` of ONE sequence (G = Hq / Hkv), so each K/V byte
is loaded once per group. The host's ``prefill_tile_map`` lists the (sequence, M tile) pairs
from the chunk lengths; the grid is (n_tiles, Hkv, n_split), and a program reads its sequence,
tile, rows, start and table on the device, so a CUDA graph captured for one tile map replays
for any starts and tables (and for device lengths up to the ones the map was made for: the
tiles past a sequence's device length do nothing). Each key tile's slots come from a
vectorized load of the table entries of its keys (key_slots, shared with decode), so
block_size (a power of two) and BLOCK_N need not divide each other. Online softmax in base 2,
fp32 accumulators, ``tl.dot`` on the pool's dtype with ``out_dtype=float32``; every key tile
is masked (causal and window).

Key split (flash-decoding): a short chunk after a long prefix has few tiles (150 tokens of
llama 8B: 5 tiles x 8 kv heads = 40 programs on 132 SMs), each over all the prefix's keys.
The n_split programs of a (tile, kv head) each take 1/n_split of THAT tile's visible keys
[lo, hi) (computed on the device from its start, rows and window), in runs of whole key
tiles, so every split has work at any prefix length while the grid stays the captured one.
n_split comes from the tile count alone (``paged_prefill_split``: decode attention's rule,
~4 programs per SM). n_split = 1 is the one-launch kernel that writes the output; above it,
each program writes its rows' partials (max, sum, unnormalized acc; fp32) to a workspace and
decode attention's combine (``combine_splits``, sparse, its rows bounded by cu_q[B] on the
device) merges them into q's dtype. A split with no visible key for a row (a short prefix:
most splits of a 150-token chunk with nothing cached) writes max -inf and sum 0 and no acc,
which the combine skips: no NaN, and little traffic.
Within a launch the programs of the same (kv head, split) for all tiles are neighbours in the
grid order, so they run together and share the K/V run through L2. Results depend on n_split
in the last bits (the sums' order): a chunk run eagerly (tiles of its length) and on a padded
graph (tiles of the bucket) may pick different counts.

Cost (to compare with the H200): FLOPs 4 * Hq * D * sum over rows of their visible keys
(about 4 * Hq * D * len_b * (q_start[b] + len_b / 2) per sequence without a window; the M
tiles pad each sequence's rows to BLOCK_M / G tokens), on the tensor cores at fp16 (~790
TFLOP/s dense measured for bf16 here). Bytes: q and the output (2 * T * Hq * D * 2) and each
sequence's K/V once from DRAM, 4 * Hkv * D * (q_start[b] + len_b); the M tiles of a sequence
re-read its keys, (len_b * G / BLOCK_M) times in all, mostly from L2. The table adds 4 bytes
per key per tile (L1 hits after the first). With n_split > 1 the workspace adds T * Hq *
n_split * (D + 2) * 4 bytes written (less where splits are empty) and read back once.

The case that set the split (llama 8B Q4_K_M, Hq 32, Hkv 8, D 128, fp16 cache; 150 new
tokens after a 30,000-token cached prefix; per layer): 4 * 32 * 128 * 150 * 30,075 = 73.9
GFLOP (78.8 with the tile padding: 5 tiles of 32 tokens), K/V 4 * 8 * 128 * 30,150 = 123 MB
from DRAM (L2 serves the 5 tiles' re-reads), q and out 2.5 MB; 13 splits add 32 MB of
partials written and read. Unsplit: 40 programs, 45 ms for 32 layers (H200), 52 TFLOP/s,
1.3 TFLOP/s per busy SM. Split: 13 splits, 520 programs in 4 waves of 132 (one program per
SM: 212 registers x 256 threads fit once in an SM's 64K, sm_90 compile), each 1/13 of the
keys: predicted ~4 x 45 / 13 = 13.8 ms at the same per-SM rate, plus the partials (~64 MB a
layer, ~0.5 ms in all) and 32 combine launches: ~14-15 ms (~170 TFLOP/s, ~3x). On the
256-token prefill graph (8 tiles, 3 idle past the chunk: 8 splits, 320 working programs, 3
waves of 1/8 of the keys): ~17-18 ms. The roof is far: 2.5 TFLOP at 790 TFLOP/s is 3.2 ms,
4 GB of K/V at 4.8 TB/s 0.8 ms; what is left is the per-SM rate (a Q tile of 128 rows,
masked K/V tiles of 64, 8 warps, one program per SM).

Shared memory: as above (the same tiles).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from deimos.kernels.triton._attention_io import check_attention_io
from deimos.kernels.triton._softmax import online_softmax_step
from deimos.kernels.triton.decode_attention import (
    check_block_tables,
    combine_splits,
    key_slots,
    split_count,
)

LOG2E = tl.constexpr(1.4426950408889634)


class PrefillConfig(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def prefill_config(d: int) -> PrefillConfig:
    """Tiles by head size (see the module docstring for the shared-memory budget): D <= 64:
    128 x 64, 4 warps; D <= 128: 128 x 64, 8 warps (FA2's choice for D = 128); D <= 256:
    64 x 32, 4 warps (the Q tile and the fp32 accumulator [64, 256] fill 4 warps' registers)."""
    if d <= 64:
        return PrefillConfig(128, 64, 4, 2)
    if d <= 128:
        return PrefillConfig(128, 64, 8, 2)
    return PrefillConfig(64, 32, 4, 2)


MAX_HEAD_DIM = 256


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int | torch.Tensor,
    scale: float,
    window: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a prompt chunk over the cache.

    q: ``[T, Hq, D]`` at positions start .. start+T-1; k, v: ``[S, Hkv, D]`` with S >= start + T
    and keys 0..start+T-1 written (same dtype; fp16/bf16 on the GPU; last dims contiguous);
    D <= 256; window: sliding window W (0 = none). ``start``: a host int, or an int tensor on
    the device whose first element is it (the chunk's positions: nothing is read back, so a
    CUDA graph can replay the call for any start; S >= start + T is then the caller's
    promise). Returns ``[T, Hq, D]`` in q's dtype.
    """
    out = check_attention_io("prefill_attention", q, k, v, window, out, q.device, "T")
    n_t, hq, d = q.shape
    s, hkv, _ = k.shape
    if d > MAX_HEAD_DIM:
        raise ValueError(f"prefill_attention: head size {d} > {MAX_HEAD_DIM}")
    on_device = isinstance(start, torch.Tensor)
    if on_device:
        if start.device != q.device or start.dtype.is_floating_point or start.numel() < 1:
            raise ValueError("prefill_attention: a device start must be an int tensor on q's device")
    elif start < 0 or start + n_t > s:
        raise ValueError(
            f"prefill_attention: positions {start}..{start + n_t - 1} need a cache of at least "
            f"{start + n_t} keys, k has {s}"
        )
    if n_t == 0:
        return out
    # one sequence whose blocks are the cache's rows in order: the paged kernel with a
    # table 0, 1, 2, ... of the largest power-of-two blocks (at most 256) that divide S
    bs = min(s & -s, 256)
    i32 = dict(dtype=torch.int32, device=q.device)
    table = torch.arange(s // bs, **i32).view(1, -1)
    q_start = start.reshape(-1)[:1].to(torch.int32) if on_device else torch.tensor([start], **i32)
    cu = torch.tensor([0, n_t], **i32)
    tiles = prefill_tile_map([n_t], hq, hkv, d, q.device)
    return paged_prefill_attention(q, k, v, table, cu, q_start, tiles, bs, scale, window, out)


# ---- paged varlen prefill ---------------------------------------------------------------------


# n_split follows the chunk's tiles, and p_start / p_tab are slices at the step's decode-row
# count (4-byte rows): unspecialized, so a mixed step's row count makes no new variant
@triton.jit(do_not_specialize=["n_split"], do_not_specialize_on_alignment=["p_start", "p_tab"])
def _paged_prefill_kernel(
    p_q, p_k, p_v, p_o, p_tab, p_cu, p_start, p_map,
    sq_t, sq_h, sk_s, sk_h, sv_s, sv_h, so_t, so_h, stab_b,
    D, scale, window, bs_shift,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr = False, n_split=1, p_m=None, p_l=None, p_acc=None,
):  # fmt: skip
    """Grid (n_tiles, Hkv) or, with SPLIT, (n_tiles, Hkv, n_split): program (tile, kv head,
    j) then takes the j-th of n_split runs of whole key tiles of its tile's keys and writes
    its rows' partials (base-2 max, sum, unnormalized acc; fp32) at [(row * Hq + head) *
    n_split + j] of p_m, p_l, p_acc (the acc only where the max is finite) for
    decode_attention's combine; without SPLIT it writes the normalized output."""
    i_tile = tl.program_id(0)
    i_kv = tl.program_id(1)
    i_seq = tl.load(p_map + 2 * i_tile)
    i_m = tl.load(p_map + 2 * i_tile + 1)
    row0 = tl.load(p_cu + i_seq)
    n_t = tl.load(p_cu + i_seq + 1) - row0  # the sequence's rows in q
    start = tl.load(p_start + i_seq)
    p_tab_row = p_tab + i_seq.to(tl.int64) * stab_b

    o_r = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_t = o_r // G
    o_h = i_kv * G + o_r % G
    m_r = o_t < n_t
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    q_pos = start + o_t
    m_qd = m_r[:, None] & m_d[None, :]
    o_q = (row0 + o_t).to(tl.int64)
    p_qb = p_q + o_q[:, None] * sq_t + o_h[:, None] * sq_h + o_d[None, :]
    b_q = tl.load(p_qb, mask=m_qd, other=0.0).to(p_k.dtype.element_ty)

    # keys of the tile: [lo, hi) with hi past the last row's position; none for a tile past
    # the sequence's rows
    t_first = (i_m * BLOCK_M) // G
    t_last = tl.minimum((i_m * BLOCK_M + BLOCK_M - 1) // G, n_t - 1)
    lo = 0
    if window > 0:
        lo = tl.maximum(0, start + t_first - window + 1)
        lo = lo - lo % BLOCK_N
    hi = tl.where(t_first < n_t, start + t_last + 1, lo)
    if SPLIT:  # this program's run: lo stays tile-aligned; past hi the loop is empty
        span = tl.cdiv(tl.cdiv(hi - lo, n_split), BLOCK_N) * BLOCK_N
        lo = lo + tl.program_id(2) * span
        hi = tl.minimum(hi, lo + span)

    qk_scale = scale * LOG2E
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    o_n = tl.arange(0, BLOCK_N)
    for s0 in range(lo, hi, BLOCK_N):
        o_s = s0 + o_n
        m_s = o_s < hi
        o_row = key_slots(o_s, m_s, p_tab_row, bs_shift, True)
        m_kd = m_s[:, None] & m_d[None, :]
        p_kb = p_k + o_row[:, None] * sk_s + i_kv * sk_h + o_d[None, :]
        p_vb = p_v + o_row[:, None] * sv_s + i_kv * sv_h + o_d[None, :]
        b_k = tl.load(p_kb, mask=m_kd, other=0.0)
        b_v = tl.load(p_vb, mask=m_kd, other=0.0)
        qk = tl.dot(b_q, tl.trans(b_k), out_dtype=tl.float32) * qk_scale  # [M, N]
        delta = q_pos[:, None] - o_s[None, :]
        ok = (delta >= 0) & m_s[None, :]
        if window > 0:
            ok = ok & (delta < window)
        qk = tl.where(ok, qk, float("-inf"))
        m_i, l_i, acc = online_softmax_step(qk, b_v, m_i, l_i, acc)
    if SPLIT:
        o_part = (o_q * (tl.num_programs(1) * G) + o_h) * n_split + tl.program_id(2)
        tl.store(p_m + o_part, m_i, mask=m_r)
        tl.store(p_l + o_part, l_i, mask=m_r)
        m_acc = m_qd & (m_i > float("-inf"))[:, None]  # a row with no key here: m, l only
        tl.store(p_acc + o_part[:, None] * D + o_d[None, :], acc, mask=m_acc)
    else:
        l_i = tl.where(l_i == 0.0, 1.0, l_i)  # padding rows only
        out = acc / l_i[:, None]
        p_ob = p_o + o_q[:, None] * so_t + o_h[:, None] * so_h + o_d[None, :]
        tl.store(p_ob, out.to(p_o.dtype.element_ty), mask=m_qd)


def paged_prefill_config(d: int) -> PrefillConfig:
    """prefill_config's tiles with one pipeline stage more: the loop's loads are a chain
    (table entries -> slots -> K/V tiles), and with 3 stages Triton's pipeliner issues the
    table load a tile ahead of the K/V copies instead of waiting on it each iteration; the
    shared memory stays that of 2 stages plus the table's few hundred bytes (sm_90 compile,
    Triton 3.9: tools/compile_kernels.py)."""
    c = prefill_config(d)
    return c._replace(num_stages=c.num_stages + 1)


def prefill_tile_map(q_lens: list[int], n_head: int, n_head_kv: int, head_dim: int,
                     device: torch.device | str, block_m: int | None = None) -> torch.Tensor:
    """The (sequence, M tile) pairs of a packed prefill of chunks of ``q_lens`` tokens, int32
    ``[n_tiles, 2]`` on ``device``: sequence b has cdiv(len_b * G, BLOCK_M) tiles (G = n_head /
    n_head_kv, BLOCK_M from the head size's tile rule). Listed from the last M tile index down
    (the tiles with the most keys start first, a shorter tail). Made on the host once per
    set of lengths; ``paged_prefill_attention`` needs one made for its q's heads and D (and
    for its ``cfg``'s block_m where it is given one: ``block_m``)."""
    if n_head_kv <= 0 or n_head % n_head_kv:
        raise ValueError(f"prefill_tile_map: {n_head} query heads do not group over {n_head_kv}")
    if any(n < 0 for n in q_lens):
        raise ValueError(f"prefill_tile_map: negative chunk length in {q_lens}")
    g = n_head // n_head_kv
    block_m = block_m or paged_prefill_config(head_dim).block_m
    tiles = [(b, j) for b, n in enumerate(q_lens) for j in range(triton.cdiv(n * g, block_m))]
    tiles.sort(key=lambda bj: -bj[1])  # stable: sequences in order within a tile index
    return torch.tensor(tiles, dtype=torch.int32).reshape(-1, 2).to(device)


def paged_prefill_split(n_tiles: int, n_head_kv: int, s: int, head_dim: int) -> int:
    """Key splits of a paged prefill of ``n_tiles`` M tiles (``prefill_tile_map``'s length)
    over tables of ``s`` = MAXB * block_size positions: decode's rule
    (decode_attention.split_count), n_tiles * Hkv * n_split ~ TARGET_PROGRAMS (~4 programs
    per SM of an H200), at most a key tile each of s; 1 once the grid alone is that large
    (n_tiles * Hkv > TARGET_PROGRAMS / 2). Shapes only: a graph's captured count stays valid
    for any starts. llama 8B (Hkv 8, D 128): 5 tiles (150 tokens) -> 13; 8 (the 256-token
    graph) -> 8; 34 or more (1,057 tokens or more) -> 1."""
    return split_count(n_tiles * n_head_kv, s, paged_prefill_config(head_dim).block_n, head_dim)


def _check_int(op: str, name: str, t: torch.Tensor, shape: tuple, device: torch.device) -> None:
    if t.dtype != torch.int32 or tuple(t.shape) != shape or t.device != device:
        raise ValueError(f"{op}: {name} must be int32 {list(shape)} on {device}, got {t.dtype} "
                         f"{list(t.shape)} on {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous")


def paged_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_tables: torch.Tensor,
    cu_q: torch.Tensor,
    q_start: torch.Tensor,
    tile_map: torch.Tensor,
    block_size: int,
    scale: float,
    window: int = 0,
    out: torch.Tensor | None = None,
    *,
    n_split: int | None = None,
    cfg: PrefillConfig | None = None,
) -> torch.Tensor:
    """Causal attention of B sequences' prefill chunks, packed, over a paged KV cache.

    q: ``[T, Hq, D]`` (fp16/bf16 on the GPU, D <= 256; strided views allowed, last dim
    contiguous), sequence b's rows ``cu_q[b] .. cu_q[b+1]-1`` (cu_q int32 ``[B+1]``, cu_q[0] =
    0, cu_q[B] <= T) at positions from ``q_start[b]`` (int32 ``[B]``); k, v: the pools
    ``[n_slots, Hkv, D]`` (same dtype as each other) holding keys 0 .. q_start[b] + len_b - 1
    of every sequence through ``block_tables`` int32 ``[B, MAXB]`` (q_start[b] + len_b <=
    MAXB * block_size, block_size a power of two); ``tile_map`` from
    ``prefill_tile_map(lens, Hq, Hkv, D, device)``. Everything but the tile map's length is
    read on the device: nothing is read back. window: sliding window W (0 = none). Returns
    ``[T, Hq, D]`` in q's dtype (or ``out``); rows past cu_q[B] are not written.
    ``n_split``: the key splits per (tile, kv head); None: ``paged_prefill_split``'s rule from
    the tile count (1: one launch writing the output; more: partials in an fp32 workspace of
    T * Hq * n_split * (D + 2) * 4 bytes, then the combine launch; under the rule, which keeps
    n_tiles * Hkv * n_split <= 528, that is at most BLOCK_M * (D + 2) * 4 * 528 ~ 35 MB).
    ``cfg``: the tile (default ``paged_prefill_config(D)``; the tile map must be made with its
    block_m), for ``bench/sweep_paged_prefill.py``.
    """
    op = "paged_prefill_attention"
    out = check_attention_io(op, q, k, v, window, out, q.device, "T")
    n_t, hq, d = q.shape
    hkv = k.shape[1]
    if d > MAX_HEAD_DIM:
        raise ValueError(f"{op}: head size {d} > {MAX_HEAD_DIM}")
    if block_tables.dim() != 2:
        raise ValueError(f"{op}: block_tables must be [B, MAXB], got {list(block_tables.shape)}")
    n_b = block_tables.shape[0]
    bs_shift = check_block_tables(op, block_tables, block_size, n_b, k)
    _check_int(op, "cu_q", cu_q, (n_b + 1,), q.device)
    _check_int(op, "q_start", q_start, (n_b,), q.device)
    if tile_map.dim() != 2 or tile_map.shape[1] != 2:
        raise ValueError(f"{op}: tile_map must be [n_tiles, 2], got {list(tile_map.shape)}")
    _check_int(op, "tile_map", tile_map, tuple(tile_map.shape), q.device)
    n_tiles = tile_map.shape[0]
    if n_split is None:
        n_split = paged_prefill_split(n_tiles, hkv, block_tables.shape[1] * block_size, d)
    if not isinstance(n_split, int) or n_split < 1:
        raise ValueError(f"{op}: n_split must be an int >= 1, got {n_split!r}")
    if n_t == 0 or n_tiles == 0:
        return out
    g = hq // hkv
    cfg = cfg or paged_prefill_config(d)
    if cfg.block_m < 16 or cfg.block_n < 16:
        raise ValueError(f"{op}: tile {cfg} needs block_m and block_n of at least 16")
    split = {}
    if n_split > 1:
        f32 = dict(dtype=torch.float32, device=q.device)
        part_m = torch.empty((n_t, hq, n_split), **f32)
        part_l = torch.empty((n_t, hq, n_split), **f32)
        part_acc = torch.empty((n_t, hq, n_split, d), **f32)
        split = dict(SPLIT=True, n_split=n_split, p_m=part_m, p_l=part_l, p_acc=part_acc)
    _paged_prefill_kernel[(n_tiles, hkv, n_split)](
        q, k, v, out, block_tables, cu_q, q_start, tile_map,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), block_tables.stride(0),
        d, scale, window, bs_shift,
        G=g, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=max(16, triton.next_power_of_2(d)),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **split,
    )  # fmt: skip
    if n_split > 1:  # rows past cu_q[B] (a padded graph's) are neither merged nor written
        combine_splits(part_m, part_l, part_acc, out, n_rows=cu_q[n_b:], sparse=True)
    return out
