"""What one forward step consumes: the tokens, their positions, where logits are wanted,
and the sequence's KV cache. Passed explicitly to every layer; there is no global context."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class KVStore(Protocol):
    """Per-sequence attention cache. The model writes the step's keys and values of a layer
    and reads back everything cached for that layer (this step included)."""

    def append(
        self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """k: [T, Hkv, D], v: [T, Hkv, Dv] at ``positions`` [T] -> (k_all [S, Hkv, D], v_all, k_pos [S])."""
        ...


@dataclass
class Batch:
    tokens: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute positions in the sequence
    kv: KVStore
    logits_at: torch.Tensor | None = None  # [N] indices into T whose logits are returned; None: the last

    def __post_init__(self) -> None:
        if self.tokens.ndim != 1 or self.tokens.shape != self.positions.shape:
            raise ValueError(
                f"Batch: tokens {tuple(self.tokens.shape)} and positions {tuple(self.positions.shape)} "
                "must be equal 1-D shapes"
            )
        if self.tokens.numel() == 0:
            raise ValueError("Batch: no tokens")
