"""Many byte ranges copied by one launch (Triton): ``copy_ranges(desc, word)`` with ``desc`` an
int64 [n, 3] device tensor of (source address, destination address, bytes). Program (i, j)
copies block j of range i in ``word``-byte loads (``range_word``: every address and length a
multiple of it). Sources may be pinned host memory, read by the device over PCIe (unified
addressing): an expert cache's promotions of a step (runtime.expert_cache), a dozen ranges
each, cost the host one descriptor upload and one launch instead of a copy-engine call per
range. Reference: deimos.kernels.copy_ranges."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deimos.kernels.copy_ranges import range_word

__all__ = ["BLOCK_BYTES", "copy_ranges", "range_word"]

BLOCK_BYTES = 16384  # bytes a program copies
_WORD_DTYPE = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@triton.jit
def _copy_ranges(p_desc, p_word, WORD: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64)
    src = tl.load(p_desc + 3 * i).to(p_word.dtype)
    dst = tl.load(p_desc + 3 * i + 1).to(p_word.dtype)
    n = tl.load(p_desc + 3 * i + 2) // WORD  # words
    o = j * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    tl.store(dst + o, tl.load(src + o, mask=m), mask=m)


def copy_ranges(desc: torch.Tensor, word: int, max_bytes: int) -> None:
    """Enqueue the copies of ``desc`` (int64 [n, 3] on the device, byte addresses and lengths,
    each a multiple of ``word``) on the current stream; ``max_bytes``: the longest range (the
    grid's second axis)."""
    if desc.dtype != torch.int64 or desc.dim() != 2 or desc.shape[1] != 3 or not desc.is_contiguous():
        raise ValueError(f"copy_ranges: want contiguous int64 [n, 3], got {desc.dtype} {tuple(desc.shape)}")
    if word not in _WORD_DTYPE:
        raise ValueError(f"copy_ranges: word must be 1, 2, 4 or 8 bytes, got {word}")
    if not desc.shape[0] or max_bytes <= 0:
        return
    block = BLOCK_BYTES // word
    dummy = torch.empty(0, dtype=_WORD_DTYPE[word], device=desc.device)  # the loads' type
    _copy_ranges[(desc.shape[0], triton.cdiv(max_bytes // word, block))](desc, dummy, WORD=word, BLOCK=block)
