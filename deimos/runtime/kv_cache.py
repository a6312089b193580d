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

    def begin(self, positions: torch.Tensor) -> int:
        """A step of ``positions`` [T] is about to be written: returns its start (the current
        length) after checking the room. Positions on a device are trusted to start at the
        cache's length (reading them would cost a device-to-host sync); host positions are
        checked."""
        n = positions.shape[0]
        start = self.length
        if positions.device.type == "cpu" and n and int(positions[0]) != start:
            raise ValueError(f"KVCache: step starts at position {int(positions[0])}, cache holds {start}")
        if start + n > self.capacity:
            raise ContextFullError(f"context full: {start + n} tokens > context size {self.capacity}")
        return start

    def commit(self, n: int) -> None:
        """The step begun at the current length wrote ``n`` positions in every layer."""
        if self.length + n > self.capacity:
            raise ContextFullError(f"context full: {self.length + n} tokens > context size {self.capacity}")
        self.length += n

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k ``[T, Hkv, D]`` and v of ``layer`` at positions ``start`` .. ``start + T - 1``.
        (The GPU path stores them in its RoPE kernel, at positions read on the device.)"""
        self.k[layer][start : start + k.shape[0]] = k
        self.v[layer][start : start + v.shape[0]] = v

    def view(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys, values and their positions ``[0, end)`` of ``layer``."""
        return self.k[layer][:end], self.v[layer][:end], self._pos[:end]
