"""Routed experts of a mixture-of-experts layer: torch references (float64), the oracles of
the Triton kernels (kernels/triton/moe_route.py: ``moe_route``, ``moe_combine``;
quant/triton/moe_gemv.py: ``moe_gemv``; quant/triton/moe_gemm.py: ``moe_align``, ``moe_gemm``).

Routing (qwen3moe, llama.cpp's ``build_moe_ffn``): p = softmax(logits) over the E experts, the
k largest taken (ties: the lowest expert id first), their weights p renormalized to sum 1 when
asked. Token t's choice j is the pair p = t * k + j.

Expert weights: one stack of S slots of n rows each (slot s = rows s n .. s n + n - 1);
``slot_of[e]`` is expert e's slot, -1 when the expert is not on the device: its pairs' rows are
0 (computed elsewhere and added by the caller).
"""

from __future__ import annotations

import torch

X_ROWS = ("token", "pair")  # activation row of pair p: p // k (gate/up) or p (down)


def moe_route_reference(logits: torch.Tensor, k: int, renorm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits ``[T, E]`` -> (weights float64 ``[T, k]``, ids int64 ``[T, k]``): softmax in
    float64, the k largest logits in descending order (equal logits: lower id first)."""
    x = logits.detach().double().cpu()
    order = torch.sort(x, dim=1, descending=True, stable=True).indices[:, :k]
    p = torch.softmax(x, dim=1).gather(1, order)
    if renorm:
        p = p / p.sum(dim=1, keepdim=True)
    return p, order


def pair_rows(n_pairs: int, k: int, x_rows: str) -> torch.Tensor:
    """int64 ``[n_pairs]``: the activation row each pair reads (``X_ROWS``)."""
    if x_rows not in X_ROWS:
        raise ValueError(f"x_rows must be one of {X_ROWS}, got {x_rows!r}")
    p = torch.arange(n_pairs)
    return p // k if x_rows == "token" else p


def moe_experts_reference(w: torch.Tensor, n: int, x: torch.Tensor, ids: torch.Tensor,
                          slot_of: torch.Tensor, x_rows: str) -> torch.Tensor:
    """The selected experts' products, float64 ``[T * k, n]``: row p = W_slot(ids[p]) x_row(p),
    0 for an expert whose slot is -1.

    w ``[S * n, K]`` (any float: the dequantized stack), x ``[T, K]`` (token) or
    ``[T * k, K]`` (pair), ids ``[T, k]``, slot_of ``[E]``."""
    ids = ids.detach().cpu().long()
    t, k = ids.shape
    slots = slot_of.detach().cpu().long()[ids.reshape(-1)]
    wd = w.detach().cpu().double()
    xd = x.detach().cpu().double()[pair_rows(t * k, k, x_rows)]
    out = torch.zeros(t * k, n, dtype=torch.float64)
    for p, s in enumerate(slots.tolist()):
        if s >= 0:
            out[p] = wd[s * n : (s + 1) * n] @ xd[p]
    return out


def moe_max_tiles(n_pairs: int, n_expert: int, block_m: int) -> int:
    """An upper bound of the tiles of ``block_m`` pairs when ``n_pairs`` pairs are grouped by
    expert and each expert's run is padded to whole tiles: sum over e of ceil(c_e / block_m) <
    n_pairs / block_m + E, and every tile holds a pair."""
    return min(n_pairs // block_m + n_expert, n_pairs)


def moe_align_reference(ids: torch.Tensor, n_expert: int, block_m: int
                        ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Pairs grouped by expert: (order int32 ``[max_tiles * block_m]``: expert 0's pairs in
    increasing pair id, padded with -1 to whole tiles, then expert 1's, ..., -1 after the last
    tile; tile_expert int32 ``[max_tiles]``: each tile's expert, -1 past the last; the number
    of tiles). Ids outside [0, E) are left out."""
    flat = ids.detach().cpu().reshape(-1).long()
    max_tiles = moe_max_tiles(flat.numel(), n_expert, block_m)
    order = torch.full((max_tiles * block_m,), -1, dtype=torch.int32)
    tile_expert = torch.full((max_tiles,), -1, dtype=torch.int32)
    tile = 0
    for e in range(n_expert):
        pairs = torch.nonzero(flat == e).reshape(-1)
        tiles = -(-pairs.numel() // block_m)
        order[tile * block_m : tile * block_m + pairs.numel()] = pairs.int()
        tile_expert[tile : tile + tiles] = e
        tile += tiles
    return order, tile_expert, tile


def moe_combine_reference(y: torch.Tensor, weights: torch.Tensor,
                          add: torch.Tensor | None = None) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] y[t k + j] (+ add[t]), float64 ``[T, D]``; y ``[T * k, D]``."""
    t, k = weights.shape
    yd = y.detach().cpu().double().reshape(t, k, -1)
    out = (weights.detach().cpu().double()[:, :, None] * yd).sum(dim=1)
    return out if add is None else out + add.detach().cpu().double()
