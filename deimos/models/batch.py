"""What one forward step consumes: the tokens, their positions, where logits are wanted,
and the sequence's KV cache. Passed explicitly to every layer; there is no global context."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class KVStore(Protocol):
    """Per-sequence attention cache (deimos.runtime.kv_cache.KVCache). A step: ``begin``
    (room check, returns the start), every layer ``write``s its keys and values and reads
    them back (``view``, or the whole per-layer tensors ``k``/``v`` for kernels that take
    positions on the device), then ``commit``."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    def begin(self, positions: torch.Tensor) -> int: ...

    def commit(self, n: int) -> None: ...

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def view(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


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
