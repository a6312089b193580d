"""Logits to token on the GPU (Triton): greedy argmax and top-k candidates.
Oracle: deimos.kernels.sampling (``torch.argmax``'s first maximum; ``_topk``'s order).

Both reduce ``logits [B, V]`` (float32) in two or more stages over blocks of the vocabulary, so
nothing sorts V (262,144 for gemma3).

argmax: stage 1, grid (n_blocks, B): each program's maximum and the lowest id holding it;
stage 2, grid (B,): the same over the partials. Ties go to the lowest id, like the CPU sampler.

top-k (k <= 256): every (logit, id) becomes one int64 key whose order is the wanted order:
    bits 63..32: the float's bits made order-preserving as a signed int32 (negative floats get
                 their magnitude bits flipped), so bigger logit = bigger key;
    bits 31..0:  0xFFFFFFFF - id, so of two equal logits the lower id is the bigger key.
Keys are distinct, so "the K biggest keys" is exactly ``_topk``'s answer, cut ties included.
Stage 1 keeps the K_PAD (k rounded up to a power of two) biggest keys of each BLOCK_V block
(``_store_top_keys``: a 64-step bitwise search for the K_PAD-th key, then a prefix-sum
compaction; nothing is sorted); each merge pass does the same over MERGE partial lists, until
one list is left (V = 262,144, BLOCK_V = 4096: 64 lists -> 4 -> 1); torch sorts those K_PAD.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

ARGMAX_BLOCK = 4096
TOPK_BLOCK = 4096  # vocabulary entries per stage-1 program
TOPK_MERGE = 16  # partial lists per merge program
MAX_K = 256
_ID_MASK = tl.constexpr(0xFFFFFFFF)


@triton.jit
def _argmax_block_kernel(p_x, p_val, p_idx, V, stride_b, N_BLOCKS, BLOCK: tl.constexpr):
    i_blk = tl.program_id(0)
    i_b = tl.program_id(1).to(tl.int64)
    o_v = i_blk * BLOCK + tl.arange(0, BLOCK)
    b_x = tl.load(p_x + i_b * stride_b + o_v, mask=o_v < V, other=float("-inf"))
    mx = tl.max(b_x, axis=0)
    idx = tl.min(tl.where(b_x == mx, o_v, 2147483647), axis=0)
    tl.store(p_val + i_b * N_BLOCKS + i_blk, mx)
    tl.store(p_idx + i_b * N_BLOCKS + i_blk, idx)


@triton.jit
def _argmax_final_kernel(p_val, p_idx, p_out, N_BLOCKS, BLOCK: tl.constexpr):
    i_b = tl.program_id(0).to(tl.int64)
    o_j = tl.arange(0, BLOCK)
    m_j = o_j < N_BLOCKS
    b_v = tl.load(p_val + i_b * N_BLOCKS + o_j, mask=m_j, other=float("-inf"))
    b_i = tl.load(p_idx + i_b * N_BLOCKS + o_j, mask=m_j, other=2147483647)
    mx = tl.max(b_v, axis=0)
    tl.store(p_out + i_b, tl.min(tl.where(b_v == mx, b_i, 2147483647), axis=0).to(tl.int64))


INT64_MIN = tl.constexpr(-9223372036854775807 - 1)


@triton.jit
def _value_cut(ordered, K_PAD: tl.constexpr):
    """T = the K_PAD-th largest of ``ordered`` (int32 [N], N >= K_PAD), found bit by bit from
    the top (31 counting passes): the sign first, then, as in two's complement setting a lower
    bit always raises the value, each bit kept when at least K_PAD values are >= the
    candidate. Returns (above T: fewer than K_PAD; equal to T: with those above at least
    K_PAD; how many of the ties fill K_PAD)."""
    n_pos = tl.sum((ordered >= 0).to(tl.int32), axis=0)
    t = tl.where(n_pos >= K_PAD, 0, INT32_MIN).to(tl.int32)
    one = tl.full([], 1, tl.int32)
    for i in range(31):
        cand = t | (one << (30 - i))
        n_ge = tl.sum((ordered >= cand).to(tl.int32), axis=0)
        t = tl.where(n_ge >= K_PAD, cand, t)
    above = ordered > t
    tie = ordered == t
    return above, tie, K_PAD - tl.sum(above.to(tl.int32), axis=0)


@triton.jit
def _store_top_keys(key, p_out, K_PAD: tl.constexpr):
    """Store the K_PAD largest of ``key`` (int64 [N], N >= K_PAD, distinct apart from INT64_MIN
    padding) to p_out[0:K_PAD], in no particular order.

    T = the K_PAD-th largest value (the keys' upper 32 bits: ``_value_cut``). Every key above
    T is kept; of those whose value ties at T (rare: equal logits), the
    biggest lower halves (the lowest ids) fill the rest, by a second search over the lower
    32 bits that runs only when there are more ties than room. The kept keys are compacted
    with a prefix sum. No sort anywhere (tl.topk's bitonic network also works, but Triton's
    interpreter runs its int64 compare-and-swap element by element: minutes per call)."""
    hi = (key >> 32).to(tl.int32)
    above, tie, need = _value_cut(hi, K_PAD)
    sel = above | tie
    if tl.sum(tie.to(tl.int32), axis=0) > need:  # the ties' biggest lower halves (distinct)
        lo = key & 0xFFFFFFFF
        t2 = tl.full([], 0, tl.int64)
        one64 = tl.full([], 1, tl.int64)
        for i in range(32):
            cand2 = t2 | (one64 << (31 - i))
            n_ge2 = tl.sum((tie & (lo >= cand2)).to(tl.int32), axis=0)
            t2 = tl.where(n_ge2 >= need, cand2, t2)
        sel = above | (tie & (lo >= t2))
    pos = tl.cumsum(sel.to(tl.int32), axis=0) - 1
    tl.store(p_out + pos, key, mask=sel & (pos < K_PAD))


INT32_MIN = tl.constexpr(-2147483647 - 1)


@triton.jit
def _order_bits(b_x, m_v):
    """Each logit ``b_x`` (float32) as an int32 whose signed order is the float order (the
    order key's upper half); INT32_MIN where ``m_v`` is false."""
    b_x = tl.where(b_x == 0.0, 0.0, b_x)  # -0.0 as +0.0: equal logits, ordered by id
    bits = b_x.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negative: magnitude bits flipped
    return tl.where(m_v, ordered, INT32_MIN)


@triton.jit
def _order_keys(b_x, o_v, m_v):
    """The int64 order key of each logit ``b_x`` (float32) at id ``o_v`` (module docstring);
    INT64_MIN where ``m_v`` is false (padding: below every real key)."""
    key = (_order_bits(b_x, m_v).to(tl.int64) << 32) | (_ID_MASK - o_v.to(tl.int64))
    return tl.where(m_v, key, INT64_MIN)


@triton.jit
def _store_top_block_keys(ordered, key, p_out, K_PAD: tl.constexpr):
    """``_store_top_keys`` for one block of the vocabulary, where position order is id order:
    ``ordered`` (int32 [N], ``_order_bits``) and ``key`` (int64 [N], ``_order_keys``) of the
    same logits, N >= K_PAD. The K_PAD-th largest value T is searched over the 32 value bits
    only (32 counting passes instead of 64); every key above T is kept, and of those tied at T
    the first positions, i.e. the lowest ids, i.e. the biggest keys: the same K_PAD keys."""
    above, tie, need = _value_cut(ordered, K_PAD)
    sel = above | (tie & (tl.cumsum(tie.to(tl.int32), axis=0) <= need))  # exactly K_PAD
    pos = tl.cumsum(sel.to(tl.int32), axis=0) - 1
    tl.store(p_out + pos, key, mask=sel)


@triton.jit
def _topk_block_kernel(p_x, p_keys, V, stride_b, N_BLOCKS,
                       BLOCK: tl.constexpr, K_PAD: tl.constexpr):  # fmt: skip
    i_blk = tl.program_id(0)
    i_b = tl.program_id(1).to(tl.int64)
    o_v = i_blk * BLOCK + tl.arange(0, BLOCK)
    m_v = o_v < V
    b_x = tl.load(p_x + i_b * stride_b + o_v, mask=m_v, other=0.0)
    key = _order_keys(b_x, o_v, m_v)
    _store_top_keys(key, p_keys + (i_b * N_BLOCKS + i_blk) * K_PAD, K_PAD)


@triton.jit
def _topk_merge_kernel(p_in, p_out, N_IN, N_OUT,
                       MERGE: tl.constexpr, K_PAD: tl.constexpr):  # fmt: skip
    key, p_o = merge_inputs(p_in, p_out, N_IN, N_OUT, MERGE, K_PAD)
    _store_top_keys(key, p_o, K_PAD)


@triton.jit
def merge_inputs(p_in, p_out, N_IN, N_OUT, MERGE: tl.constexpr, K_PAD: tl.constexpr):
    """A merge program's (row, output list): the keys of its MERGE input lists (INT64_MIN past
    the last list) and where its K_PAD best go."""
    i_o = tl.program_id(0)
    i_b = tl.program_id(1).to(tl.int64)
    o_e = tl.arange(0, MERGE * K_PAD)
    m_e = i_o * MERGE + o_e // K_PAD < N_IN
    key = tl.load(p_in + (i_b * N_IN + i_o * MERGE) * K_PAD + o_e, mask=m_e, other=INT64_MIN)
    return key, p_out + (i_b * N_OUT + i_o) * K_PAD


def _check_logits(logits: torch.Tensor, who: str) -> torch.Tensor:
    if logits.dim() not in (1, 2) or logits.shape[-1] == 0:
        raise ValueError(f"{who}: logits must be [V] or [B, V], got shape {tuple(logits.shape)}")
    if logits.dtype != torch.float32:
        raise ValueError(f"{who}: logits must be float32, got {logits.dtype}")
    x = logits.reshape(1, -1) if logits.dim() == 1 else logits
    if x.stride(1) != 1:
        raise ValueError(f"{who}: logits' last dimension must be contiguous")
    if x.shape[1] >= 2**31:
        raise ValueError(f"{who}: vocabulary of {x.shape[1]} does not fit int32 ids")
    return x


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy token: logits float32 ``[V]`` or ``[B, V]`` -> int64 ``[]`` or ``[B]`` on the
    device, the first maximum (ties to the lowest id). NaN logits give an unspecified id."""
    x = _check_logits(logits, "argmax")
    n_b, v = x.shape
    n_blocks = triton.cdiv(v, ARGMAX_BLOCK)
    part_v = torch.empty((n_b, n_blocks), dtype=torch.float32, device=x.device)
    part_i = torch.empty((n_b, n_blocks), dtype=torch.int32, device=x.device)
    out = torch.empty(n_b, dtype=torch.int64, device=x.device)
    _argmax_block_kernel[(n_blocks, n_b)](
        x, part_v, part_i, v, x.stride(0), n_blocks, BLOCK=ARGMAX_BLOCK, num_warps=8
    )
    _argmax_final_kernel[(n_b,)](
        part_v, part_i, out, n_blocks, BLOCK=triton.next_power_of_2(n_blocks), num_warps=4
    )
    return out[0] if logits.dim() == 1 else out


class TopK(NamedTuple):
    values: torch.Tensor  # float32 [..., k], descending
    ids: torch.Tensor  # int64 [..., k]; equal values in ascending id order


def topk_passes(v: int, k_pad: int) -> list[int]:
    """Number of lists after stage 1 and after each merge pass (the last is 1)."""
    n = [triton.cdiv(v, TOPK_BLOCK)]
    while n[-1] > 1:
        n.append(triton.cdiv(n[-1], TOPK_MERGE))
    return n


def topk(logits: torch.Tensor, k: int) -> TopK:
    """The k largest logits and their ids, without sorting the vocabulary.

    logits: float32 ``[V]`` or ``[B, V]``; 1 <= k <= min(256, V). Order and ties as
    deimos.kernels.sampling's ``_topk``: descending values, equal values by ascending id, a tie
    across the k-th place keeps the lowest ids. Returns ``TopK`` of ``[k]`` or ``[B, k]``:
    top-k / top-p / min-p then run on these k candidates (host or device).
    """
    x = _check_logits(logits, "topk")
    n_b, v = x.shape
    if not 1 <= k <= min(MAX_K, v):
        raise ValueError(f"topk: k = {k} not in 1..{min(MAX_K, v)}")
    k_pad = max(2, triton.next_power_of_2(k))
    counts = topk_passes(v, k_pad)
    keys = torch.empty((n_b, counts[0], k_pad), dtype=torch.int64, device=x.device)
    _topk_block_kernel[(counts[0], n_b)](
        x, keys, v, x.stride(0), counts[0], BLOCK=TOPK_BLOCK, K_PAD=k_pad, num_warps=8
    )
    for n_in, n_out in zip(counts, counts[1:]):
        merged = torch.empty((n_b, n_out, k_pad), dtype=torch.int64, device=x.device)
        _topk_merge_kernel[(n_out, n_b)](
            keys, merged, n_in, n_out, MERGE=TOPK_MERGE, K_PAD=k_pad, num_warps=8
        )
        keys = merged
    # the last list holds the K_PAD best keys unordered: sort those few (descending key =
    # descending logit, then ascending id)
    keys = torch.sort(keys[:, 0, :], dim=1, descending=True).values[:, :k]
    ids = 0xFFFFFFFF - (keys & 0xFFFFFFFF)
    hi = (keys >> 32).to(torch.int32)
    bits = torch.where(hi < 0, hi ^ 0x7FFFFFFF, hi)
    values = bits.view(torch.float32)
    if logits.dim() == 1:
        return TopK(values[0], ids[0])
    return TopK(values, ids)
