"""A decode graph's own inputs on the device (reference, torch): each row's cache slot from its
block table and position, and, after the step's sampling, the chosen ids fed back as the next
replay's tokens with the positions advanced (deimos.runtime.graph.StepGraph). The Triton
versions, one launch each: deimos.kernels.triton.step_feed."""

from __future__ import annotations

import torch


def decode_slots_reference(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """int64 ``[B]``: row b's key slot, ``tables[b, pos // block_size] * block_size + pos %
    block_size`` with ``pos = positions[b]`` (tables int32 ``[B, MAXB]``, positions int64
    ``[B]``)."""
    blk = torch.gather(tables, 1, (positions // block_size).view(-1, 1).to(torch.int64))
    return blk.view(-1).to(torch.int64) * block_size + positions % block_size


def feed_reference(ids: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> None:
    """In place: ``tokens = max(ids, 0)`` (a flagged row's negative id becomes token 0: the
    host overrides that row before its next replay) and ``positions += 1``."""
    tokens.copy_(ids.clamp(min=0))
    positions.add_(1)
