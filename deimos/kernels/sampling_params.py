"""Sampling settings and their checks, without torch (the CLI builds its flags from them
before anything heavy is imported). ``Bound`` is the one range check behind
``SamplingParams``, the CLI's flags and the server's request fields."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Bound:
    """The values one sampling setting accepts, and what its special value means. The one
    check behind ``SamplingParams``, the CLI's flags and the server's request fields, so a
    bad value reads the same everywhere; each surface names the setting its own way (the
    field, ``--flag``, the request's field)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # lo itself excluded
    integer: bool = False
    note: str = ""  # e.g. "0 means greedy"

    def problem(self, value: object) -> str | None:
        """None if ``value`` is accepted, else what is wrong with it (no name: the caller's)."""
        if self.integer:
            if isinstance(value, bool) or not isinstance(value, int):
                return f"must be an integer, got {value!r}"
        elif (isinstance(value, bool) or not isinstance(value, (int, float))
              or not math.isfinite(value)):  # fmt: skip
            return f"must be a finite number, got {value!r}"
        below = self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo)
        above = self.hi is not None and value > self.hi
        if not (below or above):
            return None
        lo, hi = (None if b is None else str(b) if isinstance(b, int) else f"{b:g}"
                  for b in (self.lo, self.hi))
        if hi is None:
            rule = f"must be {'>' if self.lo_open else '>='} {lo}"
        elif lo is None:
            rule = f"must be <= {hi}"
        else:
            rule = f"must be in {'(' if self.lo_open else '['}{lo}, {hi}]"
        return f"{rule}{f' ({self.note})' if self.note else ''}, got {value!r}"


# SamplingParams' fields as the sampler accepts them (a server may narrow them: OpenAI's ranges)
SAMPLING_BOUNDS: dict[str, Bound] = {
    "temperature": Bound(lo=0, note="0 means greedy"),
    "top_k": Bound(lo=0, integer=True, note="0 means off"),
    "top_p": Bound(lo=0, hi=1, lo_open=True, note="1 means off"),
    "min_p": Bound(lo=0, hi=1, note="0 means off"),
    "repetition_penalty": Bound(lo=0, lo_open=True, note="1 means off"),
    "presence_penalty": Bound(note="0 means off"),
    "frequency_penalty": Bound(note="0 means off"),
    "penalty_last_n": Bound(lo=-1, integer=True, note="-1 means the whole context, 0 none"),
    "seed": Bound(lo=0, hi=2**64 - 1, integer=True),
}


class SamplingError(ValueError):
    """A sampling setting out of range; ``field`` is SamplingParams' name for it, ``problem``
    the shared wording (``Bound.problem``)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")
        self.field = field
        self.problem = problem


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; defaults are llama.cpp's (common/common.h)."""

    temperature: float = 0.8  # 0 = greedy
    top_k: int = 40  # 0 = off
    top_p: float = 0.95  # 1 = off
    min_p: float = 0.05  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64  # tokens of history the penalties see; -1 = all, 0 = none
    seed: int | None = None  # None = random

    def __post_init__(self) -> None:
        for name, bound in SAMPLING_BOUNDS.items():
            value = getattr(self, name)
            if name == "seed" and value is None:
                continue
            problem = bound.problem(value)
            if problem is not None:
                raise SamplingError(name, problem)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalties_enabled(self) -> bool:
        return self.penalty_last_n != 0 and not (
            self.repetition_penalty == 1 and self.presence_penalty == 0
            and self.frequency_penalty == 0
        )
