"""The paged KV cache's memory: per layer, keys and values of ``n_blocks * block_size`` slots.

Which sequence owns which block is the block manager's business (deimos.engine.block_manager);
the pool is only memory, read and written through the slots a step's ``SeqLayout`` names.
Block 0 is never handed to a sequence: it is the scratch block that CUDA-graph padding rows
write into. Float32 on the CPU (the reference), float16 on other devices unless ``dtype`` says.

Sizing (``pool_blocks``): from a token budget, or from the GPU's free memory measured at start
(``torch.cuda.mem_get_info``), whichever the engine config asks for.
"""

from __future__ import annotations

import torch

from deimos.models.config import ModelConfig

SCRATCH_BLOCK = 0


class KVPool:
    def __init__(self, config: ModelConfig, n_blocks: int, block_size: int, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None) -> None:
        if n_blocks < 2:
            raise ValueError(f"KVPool: needs at least 2 blocks (one is scratch), got {n_blocks}")
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"KVPool: block_size must be a power of two, got {block_size}")
        if dtype is None:
            dtype = torch.float32 if torch.device(device).type == "cpu" else torch.float16
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.n_blocks = n_blocks
        self.block_size = block_size
        rows = n_blocks * block_size
        self.k = [torch.empty((rows, config.n_head_kv, config.head_dim), dtype=dtype, device=device)
                  for _ in range(config.n_layer)]
        self.v = [torch.empty((rows, config.n_head_kv, config.head_dim_v), dtype=dtype, device=device)
                  for _ in range(config.n_layer)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


def bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """KV bytes one cached token takes over all layers."""
    size = torch.empty(0, dtype=dtype).element_size()
    return config.n_layer * config.n_head_kv * (config.head_dim + config.head_dim_v) * size


def step_bytes(config: ModelConfig, max_batch_tokens: int) -> int:
    """An upper bound on what a step of ``max_batch_tokens`` tokens allocates besides the
    weights and the KV pool (its activations: 64 float32 rows of the model's width a token; a
    30B-A3B prompt chunk of 512 measured ~40 of them, bench/mem_breakdown.py)."""
    return 64 * max_batch_tokens * config.n_embd * 4


def pool_blocks(config: ModelConfig, block_size: int, dtype: torch.dtype, *, tokens: int | None = None,
                gib: float | None = None, free_bytes: int | None = None, fraction: float = 0.9,
                reserve_bytes: int = 0, max_tokens: int | None = None) -> int:
    """Blocks for a pool: ``tokens`` (a token budget) or ``gib`` (a memory budget) when given,
    else ``fraction`` of ``free_bytes`` after ``reserve_bytes``, capped at ``max_tokens``.
    Always at least two blocks (one is scratch) plus what the budget holds."""
    per_block = bytes_per_token(config, dtype) * block_size
    if tokens is not None:
        n = -(-tokens // block_size)
    elif gib is not None:
        n = int(gib * 2**30) // per_block
    elif free_bytes is not None:
        n = int(max(0, free_bytes - reserve_bytes) * fraction) // per_block
        if max_tokens is not None:
            n = min(n, -(-max_tokens // block_size))
    else:
        raise ValueError("pool_blocks: give tokens, gib or free_bytes")
    return max(2, n + 1)
