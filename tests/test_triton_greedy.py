"""The device greedy choice that ends a decode graph (deimos.kernels.triton.greedy) against
torch.argmax: ties to the lowest id, NaN reported as -1, the next step's token and position
written, the counter left at zero so the same launch repeats (as a graph replays it)."""

from __future__ import annotations

import pytest
import torch

from kernel_device import DEVICE  # noqa: I001  (first: sets TRITON_INTERPRET)

from deimos.kernels.triton.greedy import GreedyState, greedy_next, greedy_reference  # noqa: E402


def _run(logits: torch.Tensor, state: GreedyState, feed: torch.Tensor) -> int:
    token = torch.full((1,), 99, dtype=torch.int64, device=DEVICE)
    greedy_next(logits, state, token, feed)
    return int(token)


@pytest.mark.parametrize("v", [5, 2048, 4097, 151936])
def test_greedy_matches_argmax(v: int) -> None:
    g = torch.Generator().manual_seed(v)
    state = GreedyState(v, DEVICE)
    feed = torch.tensor([7, 40], dtype=torch.int64, device=DEVICE)
    for trial in range(3):  # the same buffers again: the counter was reset
        x = torch.randn(v, generator=g)
        if trial == 1:  # a tie across slices: the lower id wins
            x[v // 3] = x[v - 1] = x.max() + 1
        if trial == 2:
            x[:] = x.round()  # many ties within a slice
        want = int(torch.argmax(x))
        assert greedy_reference(x) == want
        assert _run(x.to(DEVICE), state, feed) == want
        assert feed.tolist() == [want, 41 + trial]
    assert int(state.count) == 0


def test_greedy_nan_and_bad_input() -> None:
    state = GreedyState(3000, DEVICE)
    feed = torch.tensor([5, 0], dtype=torch.int64, device=DEVICE)
    x = torch.randn(3000)
    x[2999] = float("nan")
    assert greedy_reference(x) == -1
    assert _run(x.to(DEVICE), state, feed) == -1
    assert feed.tolist() == [0, 1]  # the next step gets a valid id
    x[2999] = float("-inf")
    assert _run(x.to(DEVICE), state, feed) == int(torch.argmax(x))
    with pytest.raises(ValueError, match=r"logits must be \[3000\]"):
        greedy_next(torch.zeros(2999, device=DEVICE), state, feed[:1], feed)
    with pytest.raises(ValueError, match="int64"):
        greedy_next(x.to(DEVICE), state, feed[:1].int(), feed)
