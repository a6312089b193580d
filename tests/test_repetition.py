"""The loop guard (engine/repetition.py) on token sequences, and on the default model.

Oracles: sequences whose periodic tail is known by construction; a real degenerate answer
(SmolLM2-135M, "Write a haiku about the sea.", seed 5, recorded before the guard existed:
a 38-token couplet repeated until max_tokens); repetition that is not a loop (a list, a
refrain, a short run of one token) must not trigger.
"""

from __future__ import annotations

import pytest

from deimos.engine.repetition import LoopGuard

# SmolLM2-135M-Instruct Q4_1, CPU, chat template, llama.cpp's default sampling, seed 5
LOOPING_HAIKU = [
    49, 1425, 787, 501, 21202, 787, 283, 24776, 787, 501, 6292, 28, 253, 8139, 787, 501, 21202,
    787, 283, 24776, 28, 198, 49, 1425, 787, 501, 21202, 787, 283, 24776, 787, 283, 1873, 8119,
    198, 198, 49, 1425, 787, 501, 21202, 787, 283, 24776, 787, 501, 6292, 28, 253, 8139, 787,
    501, 21202, 787, 283, 24776, 787, 283, 1873, 8119, 198, 504, 5065, 506, 253, 9154, 8664, 28,
    624, 2606, 288, 2419, 198, 198, 788, 260, 1911, 282, 260, 3426, 28, 260, 3426, 506, 253,
    9154, 8664, 28, 198, 49, 1425, 787, 501, 21202, 787, 283, 24776, 787, 501, 8119, 28, 253,
    8139, 787, 501, 21202, 787, 283, 24776, 787, 198, 198, 788, 260, 1911, 282, 260, 3426, 28,
    260, 3426, 506, 253, 9154, 8664, 28, 198, 49, 1425, 787, 501, 21202, 787, 283, 24776, 787,
    501, 8119, 28, 253, 8139, 787, 501, 21202, 787, 283, 24776, 787, 198, 198, 60, 344, 370,
    284, 37424, 28, 198, 788, 260, 1911, 282, 260, 3426, 28, 260, 3426, 506, 253, 9154, 8664,
]


def first_trigger(guard: LoopGuard, tokens: list[int]) -> tuple[int, int] | None:
    """(output length, period) at the first token the guard stops, as the generator asks."""
    for n in range(1, len(tokens) + 1):
        p = guard.period(tokens[:n])
        if p is not None:
            return n, p
    return None


def test_a_real_loop_stops_after_its_second_copy():
    assert first_trigger(LoopGuard(), LOOPING_HAIKU) == (148, 38)
    # the two copies before the cut are the same 38 tokens
    assert LOOPING_HAIKU[148 - 38:148] == LOOPING_HAIKU[148 - 76:148 - 38]


@pytest.mark.parametrize("period", [1, 3, 7, 32, 100])
def test_any_period_stops_once_the_loop_covers_min_tokens(period):
    span = list(range(1000, 1000 + period))
    tokens = [5, 6, 7] + span * (200 // period + 3)
    n, p = first_trigger(LoopGuard(), tokens)
    assert p == period
    assert n - 3 == max(64, 2 * period)  # exactly when min_tokens and two copies are reached


def test_repetition_that_is_not_a_loop_does_not_stop():
    guard = LoopGuard()
    # a numbered list: the same shape every line, a different number each time
    numbered = [t for i in range(40) for t in (100 + i, 13, 500, 501, 502, 198)]
    assert first_trigger(guard, numbered) is None
    # a refrain sung twice (2 x 20 tokens) between verses
    refrain = list(range(300, 320))
    song = list(range(10, 40)) + refrain * 2 + list(range(40, 70)) + refrain * 2
    assert first_trigger(guard, song) is None
    # a short run of one token (a separator line, "!!!!!"), and 63 of them
    assert first_trigger(guard, [1, 2, 3] + [9] * 63) is None
    assert first_trigger(guard, [1, 2, 3] + [9] * 64) == (67, 1)


def test_guard_settings_are_checked():
    with pytest.raises(ValueError, match="copies >= 2"):
        LoopGuard(copies=1)
    three = LoopGuard(min_tokens=8, copies=3)
    assert three.period([4, 5, 6, 7] * 2 + [4, 5]) is None  # 10 tokens, but 2.5 copies
    assert three.period([4, 5, 6, 7] * 3) == 4
