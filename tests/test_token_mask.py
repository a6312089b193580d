"""Allowed-token masks on the device (deimos.kernels.triton.token_mask.mask_rows) against
their oracle (deimos.kernels.token_mask.mask_rows_reference): rows with a mask get NEG exactly
where their words forbid, rows without one are untouched, bit by bit; and a grammar's mask
(JsonConstraint.mask_words) forbids what its host processor forbids."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_device import DEVICE

from deimos.kernels.token_mask import NEG, bits_of, mask_rows_reference, n_words, set_ids
from deimos.kernels.triton.token_mask import mask_rows


@pytest.mark.parametrize("v", [1000, 4096, 5000])
def test_mask_rows_matches_the_reference(v: int) -> None:
    g = torch.Generator().manual_seed(v)
    logits = torch.randn(4, v, generator=g)
    words = torch.randint(-2**31, 2**31 - 1, (4, n_words(v) + 2), generator=g, dtype=torch.int64)
    words = words.to(torch.int32)
    words[2] = 0  # a row that allows nothing
    masked = torch.tensor([1, 0, 1, 1], dtype=torch.int32)
    want = mask_rows_reference(logits, words, masked)
    got = logits.to(DEVICE)
    mask_rows(got, words.to(DEVICE), masked.to(DEVICE))
    got = got.cpu()
    assert torch.equal(got, want)
    assert torch.equal(got[1], logits[1])  # no mask: untouched
    assert (got[2] == NEG).all()
    # row 0: NEG exactly at its forbidden tokens (the bits read as the grammar writes them)
    allowed = torch.from_numpy(bits_of(words[0].numpy(), v).copy())
    assert torch.equal(got[0][allowed], logits[0][allowed]) and (got[0][~allowed] == NEG).all()


def test_set_ids_allows_exactly_those_ids() -> None:
    w = np.full(n_words(100), 0xFFFFFFFF, dtype=np.uint32)
    set_ids(w, [0, 31, 32, 99])
    assert np.flatnonzero(bits_of(w, 100)).tolist() == [0, 31, 32, 99]


def test_mask_rows_names_bad_shapes() -> None:
    logits = torch.zeros(2, 100, device=DEVICE)
    with pytest.raises(ValueError, match="words int32"):
        mask_rows(logits, torch.zeros(2, 3, dtype=torch.int32, device=DEVICE),
                  torch.zeros(2, dtype=torch.int32, device=DEVICE))
