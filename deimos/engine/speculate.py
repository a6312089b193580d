"""Speculative decoding: drafts of a sequence's next tokens, verified in one batched step.

    engine = Engine(model, EngineConfig(n_ctx=4096, spec=SpecConfig("ngram", k_max=6)))

A drafter (``Drafter.propose(seq, k)``) guesses up to k tokens that follow a decoding sequence.
The scheduler packs the sequence's last token and its drafts into the step beside the other
sequences' decodes and prompt chunks (k + 1 rows with logits at each; deimos.engine.runner),
and the engine walks those rows in order (``Engine._verify``):
- at row j the token is chosen from the distribution the plain sampler uses there (penalties
  counting the tokens accepted before it, top-k/top-p/min-p, temperature, the request's seed
  stream), and the draft d is accepted: greedy, when d is that token; sampled, by the standard
  rejection rule for a deterministic draft (q one-hot at d; deimos.engine.sampling.accept_draft):
  with probability p(d), and on the first rejection the token is drawn from p with d removed
  and renormalized, so that every emitted token follows p exactly;
- the accepted drafts and then the correction (or, after k accepted drafts, a bonus token drawn
  at the last row) go out through the plain path one by one: a stop token, max_tokens, the loop
  guard or a full context ends the run at that token;
- the cache keeps the accepted prefix: the sequence's n_computed ends there, the rows of
  rejected drafts are overwritten later, blocks taken only for them go back, and only computed
  (accepted) tokens are ever sealed into the prefix cache.
A verification gives 1 (a plain decode's one token) to k + 1 tokens; how many drafts a sequence
asks for adapts to what it accepted (``SpecState``). A sequence asking for none decodes plainly
(on a GPU, in the chained decode graphs).

Drafters: ``NgramDrafter`` (prompt lookup: the tokens that followed the most recent earlier
occurrence of the sequence's last n tokens, n from ``ngram_max`` down to ``ngram_min``, in its
own prompt and outputs). A draft model or MTP heads implement the same ``propose``. Nothing
here touches tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from deimos.engine.sequence import Sequence

METHODS = ("ngram",)
K_LIMIT = 16  # drafts a verification may carry
NGRAM_LIMIT = 16
BACKOFF_MIN, BACKOFF_MAX = 4, 64  # plain tokens after a failed probe of one draft (doubling)
MISS_MAX = 16  # plain tokens after the drafter had nothing (doubling from 1)


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding's settings: ``method`` (ngram: prompt lookup), ``k_max`` (the most
    drafts one verification carries), the n-gram lengths the lookup tries (longest first)."""

    method: str = "ngram"
    k_max: int = 6
    ngram_min: int = 2
    ngram_max: int = 4

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, "
                             f"got {self.method!r}")
        for name, lo, hi in (("k_max", 1, K_LIMIT), ("ngram_min", 1, NGRAM_LIMIT),
                             ("ngram_max", 1, NGRAM_LIMIT)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"{name} must be an integer in {lo}..{hi}, got {v!r}")
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must be <= ngram_max ({self.ngram_max})")


@dataclass(slots=True)
class SpecState:
    """One sequence's speculation. ``k``: the drafts it asks for next; ``resume_at``: the
    output length before which it asks for none (decoding plainly); ``drafter``: the drafter's
    state for it (the n-gram index). The rule: after k accepted drafts ask for one more (up to
    k_max); after a partial run, one more than it accepted; after none, half as many; at zero,
    decode ``backoff`` tokens plainly (doubling while probes of one draft keep failing), then
    probe with one. A lookup that finds nothing waits 1, 2, 4, ... tokens before the next."""

    k: int
    resume_at: int = 0
    backoff: int = BACKOFF_MIN
    miss_skip: int = 1
    drafter: object | None = None

    def wanted(self, n_out: int) -> int:
        """Drafts to ask for when the output holds ``n_out`` tokens (0: decode plainly)."""
        return self.k if n_out >= self.resume_at else 0

    def found(self, n_drafts: int, n_out: int) -> None:
        """The drafter gave ``n_drafts`` drafts (0: it had none) at output length ``n_out``."""
        if n_drafts:
            self.miss_skip = 1
        else:
            self.resume_at = n_out + self.miss_skip
            self.miss_skip = min(MISS_MAX, 2 * self.miss_skip)

    def verified(self, drafted: int, accepted: int, n_out: int, k_max: int) -> None:
        """``accepted`` of ``drafted`` drafts were accepted; the output holds ``n_out`` now."""
        if accepted:
            self.backoff = BACKOFF_MIN
            self.k = min(k_max, self.k + 1) if accepted == drafted else accepted + 1
            return
        self.k //= 2
        if not self.k:
            self.k = 1
            self.resume_at = n_out + self.backoff
            self.backoff = min(BACKOFF_MAX, 2 * self.backoff)


class Drafter(Protocol):
    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to ``k`` tokens guessed to follow ``seq.tokens`` (fewer, or none: no guess).
        Per-sequence state lives in ``seq.spec.drafter``, never in the drafter."""
        ...


class NgramIndex:
    """Where each n-gram (n_min..n_max) of a growing token list last ended: one dict per n,
    token tuple -> end (exclusive), extended incrementally (each token indexed once)."""

    __slots__ = ("ends", "n_max", "n_min", "upto")

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min = n_min
        self.n_max = n_max
        self.ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(n_min, n_max + 1)]
        self.upto = 0  # every n-gram ending at or before this position is indexed

    def extend(self, tokens: list[int], end: int) -> None:
        """Index the n-grams of ``tokens`` that end after ``upto`` and at or before ``end``."""
        for n, table in zip(range(self.n_min, self.n_max + 1), self.ends):
            lo = max(self.upto + 1, n)
            if lo > end:
                continue
            # the grams tokens[e - n : e] for e in lo..end, built by zip (no Python loop)
            grams = zip(*(tokens[lo - n + i : end - n + i + 1] for i in range(n)))
            table.update(zip(grams, range(lo, end + 1)))
        self.upto = max(self.upto, end)

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """The ``k`` tokens that followed the most recent earlier occurrence of the longest
        n-gram ending ``tokens`` that occurred before; past the end of ``tokens`` the proposal
        continues from itself (a repeating span repeats on). Empty when none occurred."""
        n_tok = len(tokens)
        self.extend(tokens, n_tok - 1)  # earlier occurrences: ending before the last token
        for n in range(min(self.n_max, n_tok - 1), self.n_min - 1, -1):
            e = self.ends[n - self.n_min].get(tuple(tokens[n_tok - n :]))
            if e is not None:
                out: list[int] = []
                for i in range(k):
                    j = e + i
                    out.append(tokens[j] if j < n_tok else out[j - n_tok])
                return out
        return []


class NgramDrafter:
    """Prompt lookup: drafts copied from the sequence's own tokens (``NgramIndex``)."""

    def __init__(self, n_min: int = 2, n_max: int = 4) -> None:
        self.n_min = n_min
        self.n_max = n_max

    def propose(self, seq: Sequence, k: int) -> list[int]:
        st = seq.spec
        if st.drafter is None:
            st.drafter = NgramIndex(self.n_min, self.n_max)
        return st.drafter.lookup(seq.tokens, k)


def make_drafter(cfg: SpecConfig) -> Drafter:
    if cfg.method == "ngram":
        return NgramDrafter(cfg.ngram_min, cfg.ngram_max)
    raise ValueError(f"speculative method {cfg.method!r} has no drafter")
