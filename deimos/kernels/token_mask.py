"""Allowed-token masks as bit words (a grammar's ``JsonConstraint`` writes them: bit j of
word w allows token 32 w + j) and the logit a forbidden token gets. The batch sampler on the
device reads them (deimos.kernels.triton.sample_batch.sample_rows; oracle
deimos.kernels.sample_batch.sample_rows_reference); the host's ``Constrained`` processor
(deimos.server.processors) applies the same mask to a row's logits.
"""

from __future__ import annotations

import numpy as np

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
