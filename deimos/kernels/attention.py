"""Causal attention with grouped-query heads and an optional sliding window (reference, torch)."""

from __future__ import annotations

import torch


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Attention of new queries over cached keys.

    q: [T, Hq, D]; k: [S, Hkv, D]; v: [S, Hkv, Dv]; q_pos: [T], k_pos: [S] absolute positions.
    Query t sees key s when k_pos[s] <= q_pos[t] and, with a window W > 0, q_pos[t] - k_pos[s] < W
    (llama.cpp's standard SWA mask). Returns [T, Hq, Dv].
    """
    n_q, n_kv = q.shape[1], k.shape[1]
    if n_q % n_kv:
        raise ValueError(f"causal_attention: {n_q} query heads do not group over {n_kv} kv heads")
    group = n_q // n_kv
    acc = torch.promote_types(q.dtype, torch.float32)  # float64 stays float64 (the yardstick)
    kf = k.to(acc).repeat_interleave(group, dim=1)  # [S, Hq, D]
    vf = v.to(acc).repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q.to(acc), kf) * scale
    delta = q_pos[:, None] - k_pos[None, :]  # [T, S]
    allowed = delta >= 0
    if window > 0:
        allowed &= delta < window
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hts,shd->thd", probs, vf).to(q.dtype)


def slots_of(block_table_row: torch.Tensor, n: int, block_size: int) -> torch.Tensor:
    """Pool rows of positions 0..n-1 of one sequence in a paged KV cache: position s lives in
    slot ``block_table_row[s // block_size] * block_size + s % block_size``. Returns int64 [n]."""
    if n > block_table_row.shape[0] * block_size:
        raise ValueError(f"slots_of: {n} positions need more than the table's "
                         f"{block_table_row.shape[0]} blocks of {block_size}")  # fmt: skip
    pos = torch.arange(n, device=block_table_row.device)
    return block_table_row.long()[pos // block_size] * block_size + pos % block_size


def paged_attention_reference(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    q_positions: torch.Tensor,
    block_table_row: torch.Tensor,
    block_size: int,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Attention of one sequence's queries over a paged KV cache: its keys 0..max(q_positions)
    gathered from the pools ``k_pool, v_pool [n_slots, Hkv, D]`` through ``block_table_row``,
    then ``causal_attention``. q: [T, Hq, D] at ``q_positions`` [T]. Returns [T, Hq, D]."""
    n = int(q_positions.max()) + 1 if q_positions.numel() else 0
    slots = slots_of(block_table_row.to(k_pool.device), n, block_size)
    k_pos = torch.arange(n, device=q.device)
    return causal_attention(q, k_pool[slots], v_pool[slots], q_positions, k_pos, scale, window)
