"""What one forward step consumes: the tokens of one or more sequences, their positions, where
their keys and values live in the paged KV cache, and where logits are wanted. Passed
explicitly to every layer; there is no global context.

A step packs the tokens of B sequences one after another. The first ``n_decode`` sequences
contribute one token each (decode); the others a chunk of their prompt (prefill), each chunk
continuing what the cache already holds for that sequence. Every token's key and value are
stored at its *slot*, a row of the layer's pool (``PagedKV``): position s of a sequence lives in
row ``table[s // block_size] * block_size + s % block_size`` of its block table.

The device tensors are what the kernels (and a CUDA graph) read; the host lists describe the
same layout for the CPU reference and for choosing shapes. A CUDA graph is captured for a fixed
(T, B, n_decode): replays change only the device tensors' contents.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class PagedKV(Protocol):
    """The KV pool (deimos.runtime.kv_pool.KVPool): per layer ``[n_slots, Hkv, D]`` rows."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    block_size: int


@dataclass
class SeqLayout:
    q_lens: list[int]  # host: tokens of each sequence in the step, decode sequences first
    q_starts: list[int]  # host: position of each sequence's first token in the step
    n_decode: int  # the first n_decode sequences have one token each
    slots: torch.Tensor  # [T] int64: the cache row of each token
    tables: torch.Tensor  # [B, MAXB] int32: each sequence's block table (padded)
    q_start: torch.Tensor  # [B] int32: q_starts on the device
    cu_q: torch.Tensor  # [B + 1] int32: token offsets of the sequences (0, ..., T)
    tile_map: torch.Tensor | None = None  # the GPU prefill's (sequence, tile) list, or None

    @property
    def n_seqs(self) -> int:
        return len(self.q_lens)


@dataclass
class Batch:
    tokens: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute positions in their sequences
    kv: PagedKV
    seqs: SeqLayout
    logits_at: torch.Tensor | None = None  # [N] indices into T whose logits are returned; None: the last

    def __post_init__(self) -> None:
        if self.tokens.ndim != 1 or self.tokens.shape != self.positions.shape:
            raise ValueError(
                f"Batch: tokens {tuple(self.tokens.shape)} and positions {tuple(self.positions.shape)} "
                "must be equal 1-D shapes"
            )
        if self.tokens.numel() == 0:
            raise ValueError("Batch: no tokens")
        if sum(self.seqs.q_lens) != self.tokens.shape[0]:
            raise ValueError(f"Batch: the sequences hold {sum(self.seqs.q_lens)} tokens, the step "
                             f"{self.tokens.shape[0]}")
        if any(n != 1 for n in self.seqs.q_lens[: self.seqs.n_decode]):
            raise ValueError("Batch: every decode sequence has exactly one token")

