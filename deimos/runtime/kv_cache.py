"""A KV cache for one sequence: positions 0..n-1 in a pool of their own, blocks in order.

The engine's sequences share one ``KVPool`` through block tables (deimos.engine); this is the
one-sequence case the evaluation tools use (perplexity windows, the exactness study): block i
of the sequence is block i + 1 of its own pool (block 0 is the pool's scratch block), so slot =
position + block_size. Positions are written in order; ``truncate`` forgets a suffix.
Float32 on the CPU (the reference), float16 on other devices unless ``dtype`` says otherwise.
"""

from __future__ import annotations

import torch

from deimos.models.batch import Batch, SeqLayout
from deimos.models.config import ModelConfig
from deimos.runtime.kv_pool import KVPool

BLOCK_SIZE = 64


class ContextFullError(ValueError):
    """The sequence would grow past the cache's capacity (the context size)."""


class KVCache:
    def __init__(self, config: ModelConfig, capacity: int, device: str = "cpu",
                 dtype: torch.dtype | None = None) -> None:
        if capacity <= 0:
            raise ValueError(f"KVCache: capacity must be positive, got {capacity}")
        n_blocks = -(-capacity // BLOCK_SIZE)
        self.pool = KVPool(config, n_blocks + 1, BLOCK_SIZE, device, dtype)
        self.dtype = self.pool.dtype
        self.capacity = capacity
        self.block_size = BLOCK_SIZE
        self.k, self.v = self.pool.k, self.pool.v
        self.length = 0  # positions [0, length) hold valid entries for every layer
        self._table = torch.arange(1, n_blocks + 1, dtype=torch.int32, device=device).view(1, -1)

    def truncate(self, length: int) -> None:
        """Forget everything from position ``length`` on."""
        if not 0 <= length <= self.length:
            raise ValueError(f"KVCache.truncate: {length} outside [0, {self.length}]")
        self.length = length

    def batch(self, tokens: torch.Tensor, logits_at: torch.Tensor | None = None) -> Batch:
        """The step of ``tokens`` [T] (on the model's device) at the next positions, checked
        for room; ``commit`` after it ran."""
        n = tokens.shape[0]
        start = self.length
        if start + n > self.capacity:
            raise ContextFullError(f"context full: {start + n} tokens > context size {self.capacity}")
        device = tokens.device
        positions = torch.arange(start, start + n, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        layout = SeqLayout([n], [start], 1 if n == 1 else 0, positions + BLOCK_SIZE, self._table,
                           torch.tensor([start], **i32), torch.tensor([0, n], **i32))
        return Batch(tokens, positions, self.pool, layout, logits_at)

    def commit(self, n: int) -> None:
        if self.length + n > self.capacity:
            raise ContextFullError(f"context full: {self.length + n} tokens > context size {self.capacity}")
        self.length += n

    def forward(self, model, tokens: torch.Tensor, logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """Runs ``tokens`` through ``model`` at the next positions and commits them: the logits
        of ``logits_at`` (default: the last token)."""
        logits = model.step(self.batch(tokens, logits_at))
        self.commit(tokens.shape[0])
        return logits
