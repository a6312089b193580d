"""Stop a degenerate loop: the output's tail is one span of tokens repeated verbatim.

A small model sampled at llama.cpp's defaults sometimes falls into a cycle (SmolLM2-135M on
"Write a haiku about the sea." with seed 5 repeats a 34-token couplet until ``max_tokens``).
The check looks only at exact, back-to-back copies at the very end of the output: a list, a
refrain or a table repeats a *shape* with different tokens, or a short span a few times,
and neither reaches the threshold; a cycle repeats the same tokens until it fills it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LoopGuard:
    """Finish a request (reason ``"repetition"``) when its last ``min_tokens`` or more output
    tokens are ``copies`` or more back-to-back copies of one span of at most ``max_period``
    tokens."""

    min_tokens: int = 64
    copies: int = 2
    max_period: int = 256

    def __post_init__(self) -> None:
        if self.min_tokens < 2 or self.copies < 2 or self.max_period < 1:
            raise ValueError(f"LoopGuard needs min_tokens >= 2, copies >= 2 and max_period >= 1, "
                             f"got {self}")

    def period(self, tokens: Sequence[int]) -> int | None:
        """The repeated span's length when ``tokens`` ends in a loop, else None."""
        n = len(tokens)
        if n < self.min_tokens:
            return None
        last = tokens[-1]
        for p in range(1, min(self.max_period, n // self.copies) + 1):
            if tokens[-1 - p] != last:  # cheap reject: most periods fail on the last token
                continue
            # is the last ``need`` tokens' tail ``p``-periodic (tokens[i] == tokens[i - p])?
            need = max(self.min_tokens, self.copies * p)
            tail = range(n - 1, n - need + p - 1, -1)
            if need <= n and all(tokens[i] == tokens[i - p] for i in tail):
                return p
        return None
