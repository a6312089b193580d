"""A contiguous KV cache for one sequence: per layer, keys and values of positions 0..n-1.

Positions are written in order; rewriting from an earlier position (``truncate``) is how a
session reuses the common prefix of a new prompt. Device-agnostic: float32 on the CPU (the
reference), float16 on other devices unless ``dtype`` says otherwise.
"""

from __future__ import annotations

import torch

from deimos.models.config import ModelConfig


class ContextFullError(ValueError):
    """The sequence would grow past the cache's capacity (the context size)."""


class KVCache:
    def __init__(self, config: ModelConfig, capacity: int, device: str = "cpu",
                 dtype: torch.dtype | None = None) -> None:
        if capacity <= 0:
            raise ValueError(f"KVCache: capacity must be positive, got {capacity}")
        if dtype is None:
            dtype = torch.float32 if torch.device(device).type == "cpu" else torch.float16
        self.dtype = dtype
        self.capacity = capacity
        shape_k = (capacity, config.n_head_kv, config.head_dim)
        shape_v = (capacity, config.n_head_kv, config.head_dim_v)
        self.k = [torch.empty(shape_k, dtype=dtype, device=device) for _ in range(config.n_layer)]
        self.v = [torch.empty(shape_v, dtype=dtype, device=device) for _ in range(config.n_layer)]
        self.length = 0  # positions [0, length) hold valid entries for every layer
        self._pos = torch.arange(capacity, device=device)

    def truncate(self, length: int) -> None:
        """Forget everything from position ``length`` on."""
        if not 0 <= length <= self.length:
            raise ValueError(f"KVCache.truncate: {length} outside [0, {self.length}]")
        self.length = length

    def append(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        n = positions.shape[0]
        # positions on a device are trusted to start at the cache's length (reading them would
        # cost a device-to-host sync per layer); host positions are checked
        start = int(positions[0]) if positions.device.type == "cpu" else self.length
        if start != self.length:  # every layer of a step sees the same length
            raise ValueError(f"KVCache: step starts at position {start}, cache holds {self.length}")
        end = start + n
        if end > self.capacity:
            raise ContextFullError(f"context full: {end} tokens > context size {self.capacity}")
        self.k[layer][start:end] = k
        self.v[layer][start:end] = v
        if layer == len(self.k) - 1:
            self.length = end
        return self.k[layer][:end], self.v[layer][:end], self._pos[:end]
