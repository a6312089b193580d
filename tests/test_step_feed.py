"""A decode graph's own inputs (deimos.kernels.triton.step_feed) against the torch reference
(deimos.kernels.step_feed): the slots from shuffled block tables at positions on and around
block boundaries, the feed of sampled ids (a flagged row's -1 becomes token 0). Without CUDA
the kernels run in Triton's interpreter."""

from __future__ import annotations

from kernel_device import DEVICE  # noqa: I001  (first: sets TRITON_INTERPRET)

import pytest
import torch

from deimos.kernels.step_feed import decode_slots_reference, feed_reference
from deimos.kernels.triton.step_feed import decode_slots, feed


@pytest.mark.parametrize("b", [1, 5, 64])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_slots_match_the_reference(b: int, block_size: int) -> None:
    g = torch.Generator().manual_seed(b * block_size)
    maxb = 7
    tables = torch.randperm(b * maxb + 1, generator=g)[1:].view(b, maxb).to(torch.int32)
    edges = torch.tensor([0, block_size - 1, block_size, 3 * block_size + 1, maxb * block_size - 1])
    pos = torch.where(torch.arange(b) < len(edges), edges[torch.arange(b) % len(edges)],
                      torch.randint(0, maxb * block_size, (b,), generator=g))
    want = decode_slots_reference(tables, pos, block_size)
    out = torch.full((b,), -7, dtype=torch.int64, device=DEVICE)
    got = decode_slots(tables.to(DEVICE), pos.to(DEVICE), block_size, out)
    assert torch.equal(got.cpu(), want)


def test_feed_matches_the_reference() -> None:
    ids = torch.tensor([5, -1, 0, 151935, -1], dtype=torch.int64)
    tok_w, pos_w = torch.zeros(5, dtype=torch.int64), torch.tensor([0, 9, 16, 1023, 4], dtype=torch.int64)
    tok_g, pos_g = tok_w.clone().to(DEVICE), pos_w.clone().to(DEVICE)
    feed_reference(ids, tok_w, pos_w)
    feed(ids.to(DEVICE), tok_g, pos_g)
    assert torch.equal(tok_g.cpu(), tok_w) and torch.equal(pos_g.cpu(), pos_w)
    assert tok_w.tolist() == [5, 0, 0, 151935, 0] and pos_w.tolist() == [1, 10, 17, 1024, 5]


def test_step_feed_bad_input() -> None:
    t = torch.zeros(2, 3, dtype=torch.int32, device=DEVICE)
    p = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="tables must be contiguous int32"):
        decode_slots(t.long(), p, 16, p.clone())
    with pytest.raises(ValueError, match="positions must be contiguous"):
        decode_slots(t, p.int(), 16, p.clone())
    with pytest.raises(ValueError, match="out must be contiguous"):
        decode_slots(t, p, 16, torch.zeros(3, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="feed: ids must be contiguous"):
        feed(p.int(), p.clone(), p.clone())
    with pytest.raises(ValueError, match=r"feed: tokens must be contiguous torch.int64 \[B\]"):
        feed(p.clone(), torch.zeros(2, 2, dtype=torch.int64, device=DEVICE), p.clone())

