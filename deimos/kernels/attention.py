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
