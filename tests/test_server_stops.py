"""Stop strings on streamed text (``StopMatcher``) against a direct oracle: the whole text cut
at the first occurrence of any stop string, for random texts split at random places."""

from __future__ import annotations

import random

import pytest

from deimos.server.stops import StopMatcher


def oracle(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


def stream(pieces: list[str], stops: list[str]) -> tuple[list[str], bool]:
    m = StopMatcher(stops)
    out = [m.feed(p) for p in pieces]
    if not m.stopped:
        out.append(m.flush())
    return out, m.stopped


@pytest.mark.parametrize("seed", range(200))
def test_random_splits_match_the_cut_text(seed):
    rng = random.Random(seed)
    alphabet = "ab,. \n"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
             for _ in range(rng.randint(0, 3))]
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 12))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    out, stopped = stream(pieces, stops)
    want, want_stop = oracle(text, stops)
    # emission is append-only, so this also says no stop string was ever partly emitted
    assert "".join(out) == want and stopped == want_stop


def test_held_back_text_is_released_when_it_is_not_a_stop():
    m = StopMatcher(["</end>"])
    assert m.feed("hello </e") == "hello "
    assert m.feed("nd") == ""
    assert m.feed("x") == "</endx"
    assert m.feed(" </end> more") == " " and m.stopped
    assert m.feed("after") == "" and m.flush() == ""


def test_earliest_stop_wins_and_empty_stops_are_refused():
    m = StopMatcher(["world", "lo w"])
    assert m.feed("hello world") == "hel" and m.stopped
    with pytest.raises(ValueError, match="non-empty"):
        StopMatcher(["ok", ""])
