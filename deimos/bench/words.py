"""Seeded prompts of random common English words for ``deimos bench serve``.

The words are among the most frequent in English, lower case: a BPE or SentencePiece
vocabulary of any modern model holds nearly each of them (with its leading space) as one
token, so a prompt's token count is close to linear in its word count and varies little
between prompts of the same length. That is what lets one calibration (deimos.bench.serve)
fix the word count for a target number of prompt tokens.

Each prompt is drawn from its own generator keyed by (seed, tag, index): prompts differ from
their first words on, so no server's prefix cache can serve one from another, and a run is
reproducible whatever the order its requests are sent in.
"""

from __future__ import annotations

import random

_TEXT = """
the of and to in is was that for it with as his on be at by had are but from or have an they
which one you were her all she there would their we him been has when who will more no if out
so said what up its about into than them can only other new some could time these two may then
do first any my now such like our over man me even most made after also did many before must
through back years where much your way well down should because each just those people how too
little state good very make world still own see men work long get here between both life being
under never day same another know while last might us great old year off come since against go
came right used take three small house light water place city night land story family point
young hand part high green river garden friend school table window music paper money letter
morning mountain summer winter road field book door tree voice child sea word fire stone bird
song color bread horse ship animal island forest street market evening question answer number
"""
WORDS = tuple(_TEXT.split())


def prompt_text(seed: int, tag: str, index: int, n_words: int) -> str:
    """``n_words`` words drawn from WORDS by a generator keyed by (seed, tag, index)."""
    if n_words < 1:
        raise ValueError(f"prompt_text: n_words must be >= 1, got {n_words}")
    rng = random.Random(f"{seed}/{tag}/{index}")  # str seeds hash by SHA-512: stable everywhere
    return " ".join(rng.choices(WORDS, k=n_words))
