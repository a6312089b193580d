"""Allowed-token masks as bit words (a grammar's ``JsonConstraint`` writes them: bit j of
word w allows token 32 w + j), and their oracle: every token a row's mask forbids gets the
logit ``NEG`` before the sampler sees the row, as the host's ``Constrained`` processor does
(deimos.server.processors). Kernel: deimos.kernels.triton.token_mask.mask_rows."""

from __future__ import annotations

import numpy as np
import torch

# A masked logit: not -inf, which would make the top-p histogram's min-max range infinite;
# exp(NEG - max) is exactly 0 in float64, so a masked token is never drawn.
NEG = -1e30


def n_words(n_vocab: int) -> int:
    """Mask words a row of ``n_vocab`` tokens takes."""
    return (n_vocab + 31) // 32


def bits_of(words: np.ndarray, n_vocab: int) -> np.ndarray:
    """bool [n_vocab]: the tokens ``words`` (uint32 or int32, little-endian) allow."""
    bits = np.unpackbits(np.ascontiguousarray(words).view(np.uint8), bitorder="little")
    return bits[:n_vocab].view(np.bool_)


def set_ids(words: np.ndarray, ids) -> None:
    """``words`` (uint32) allowing exactly the token ``ids``."""
    words[:] = 0
    for t in ids:
        words[t >> 5] |= np.uint32(1 << (t & 31))


def mask_rows_reference(logits: torch.Tensor, words: torch.Tensor,
                        masked: torch.Tensor) -> torch.Tensor:
    """``logits`` [B, V] float32 with each row b whose ``masked[b]`` is nonzero set to NEG
    wherever its ``words[b]`` (int32 [B, >= n_words(V)]) forbid (a new tensor)."""
    out = logits.clone()
    v = logits.shape[1]
    for b in range(logits.shape[0]):
        if int(masked[b]):
            allowed = torch.from_numpy(bits_of(words[b].cpu().numpy(), v).copy())
            out[b][~allowed.to(out.device)] = NEG
    return out
