"""Allowed-token masks applied on the device (oracle: deimos.kernels.token_mask.
mask_rows_reference): a row's forbidden tokens get the logit NEG in place, inside a decode
step's CUDA graph, before the batch's sampler (deimos.engine.device_sampling). A grammar's row
is then sampled on the device like any other, from its mask's 19 KB (Qwen's 151,936 tokens)
instead of a 600 KB row of logits read back, masked and sampled on the host.

One launch, grid (blocks of BLOCK tokens, B): a program whose row has no mask returns at
once; the others read BLOCK / 32 words and store NEG at the forbidden tokens of their block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deimos.kernels.token_mask import NEG, n_words

BLOCK = 4096


@triton.jit
def _mask_kernel(p_x, stride_x, V, p_words, stride_w, p_masked, NEG_V: tl.constexpr,
                 BLOCK: tl.constexpr):  # fmt: skip
    i_b = tl.program_id(1).to(tl.int64)
    if tl.load(p_masked + i_b) != 0:
        o_v = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m_v = o_v < V
        word = tl.load(p_words + i_b * stride_w + (o_v >> 5), mask=m_v, other=-1)
        allowed = ((word >> (o_v & 31)) & 1) != 0
        tl.store(p_x + i_b * stride_x + o_v, tl.full([BLOCK], NEG_V, tl.float32),
                 mask=m_v & ~allowed)


def mask_rows(logits: torch.Tensor, words: torch.Tensor, masked: torch.Tensor) -> None:
    """In place: each row b of ``logits`` (float32 [B, V], unit column stride) whose
    ``masked[b]`` (int32 [>= B]) is nonzero gets NEG at every token its ``words[b]`` (int32
    [>= B, >= n_words(V)], unit column stride) forbid. No host synchronisation: capturable."""
    n_b, v = logits.shape
    if (logits.dtype != torch.float32 or logits.stride(1) != 1 or words.dtype != torch.int32
            or words.dim() != 2 or words.shape[0] < n_b or words.shape[1] < n_words(v)
            or words.stride(1) != 1 or masked.dtype != torch.int32 or masked.numel() < n_b):
        raise ValueError(f"mask_rows: logits float32 [B, V] = {tuple(logits.shape)} "
                         f"({logits.dtype}), words int32 [>= B, >= {n_words(v)}] "
                         f"({words.dtype} {tuple(words.shape)}), masked int32 [>= B] "
                         f"({masked.dtype} {tuple(masked.shape)})")
    _mask_kernel[(triton.cdiv(v, BLOCK), n_b)](
        logits, logits.stride(0), v, words, words.stride(0), masked, NEG_V=NEG, BLOCK=BLOCK,
        num_warps=4,
    )  # fmt: skip
