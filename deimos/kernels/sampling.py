"""The sampler (torch), following llama.cpp's default sampler chain. It runs where the
logits are (every tensor it makes follows ``logits.device``; the draw's uniform number is
computed on the host either way, below): the engine hands it device logits unless a logits
processor or logprobs need host ones (engine/generator.py).

Order (llama.cpp common defaults, src/llama-sampler.cpp):
    penalties -> top_k -> top_p -> min_p -> temperature -> draw
``temperature == 0`` is greedy: argmax after penalties, ties to the lowest id.

The filters never sort the whole vocabulary (V is 262144 for gemma3):
- top_k is one top-k (``_topk``: on a GPU our Triton kernel up to k = 256, block-wise
  selection with no sort of V; else ``torch.topk``); greedy on a GPU is our Triton argmax;
- top_p without top_k grows a ``topk`` window (64, 256, 1024, 4096) until its cumulative
  probability (normalized over the full vocabulary, as llama.cpp's softmax is) reaches top_p;
  a flatter distribution falls back to a probability-weighted histogram of the logits that
  locates the cut's value bin in a few O(V) passes, then sorts only that bin;
- min_p is a threshold (``logit >= max + log(min_p)``) and needs no order at all.
Ties at a top_k/top_p boundary keep the lowest ids (llama.cpp's partial sort is unspecified).

The draw is counter-based and computed on the host: the n-th draw of a request seeded ``s`` is
``draw_uniform(s, n)`` (splitmix64, 53 bits), so the same seed gives the same stream wherever the
logits are and whoever samples (this sampler, or the batched device sampler of
deimos.kernels.triton.sample_batch, which takes each row's ``u`` from ``Sampler.next_uniform``).
"""

from __future__ import annotations

import math
import secrets
from collections import Counter, deque
from collections.abc import Sequence
from typing import NamedTuple

import torch

from deimos.kernels.sampling_params import SAMPLING_BOUNDS, Bound, SamplingError, SamplingParams

__all__ = ["SAMPLING_BOUNDS", "Bound", "Sampler", "SamplingError", "SamplingParams", "TokenLogprobs",
           "choose", "draw_uniform", "filter_candidates", "logprobs"]

_WINDOWS = (64, 256, 1024, 4096)
_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment: 2^64 / golden ratio, odd


def _mix64(z: int) -> int:
    """splitmix64's finalizer (Stafford's mix13): a bijection of 64-bit words."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def draw_uniform(seed: int, counter: int) -> float:
    """The ``counter``-th draw (0, 1, ...) of the stream seeded ``seed``: a float64 in [0, 1)
    with 53 random bits. splitmix64 of the mixed seed advanced ``counter + 1`` steps, so a
    draw depends on nothing but (seed, counter): pure Python, the same on every machine."""
    if seed < 0 or counter < 0:
        raise ValueError(f"draw_uniform: seed and counter must be >= 0, got {seed}, {counter}")
    z = _mix64((_mix64(seed & _M64) + (counter + 1) * _GOLDEN) & _M64)
    return (z >> 11) * 2.0**-53


def apply_penalties(logits: torch.Tensor, counts: Counter[int], p: SamplingParams) -> torch.Tensor:
    """llama.cpp's penalties sampler on a copy of ``logits`` [V] float32: for each token seen
    ``c`` times in the window, divide a positive logit by the repetition penalty (multiply a
    non-positive one), then subtract ``c * frequency + (c > 0) * presence``."""
    if not counts or not p.penalties_enabled:
        return logits
    ids = torch.tensor(list(counts.keys()), dtype=torch.long, device=logits.device)
    cnt = torch.tensor(list(counts.values()), dtype=torch.float32, device=logits.device)
    out = logits.clone()
    sel = out[ids]
    sel = torch.where(sel <= 0, sel * p.repetition_penalty, sel / p.repetition_penalty)
    sel = sel - (cnt * p.frequency_penalty + (cnt > 0).float() * p.presence_penalty)
    out[ids] = sel
    return out


def _topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest logits, descending, equal values ordered by id and a tie across the k-th
    place cut keeping the lowest ids (torch.topk promises neither). Sorts only k elements.
    On a GPU, k up to 256: our Triton top-k (deimos.kernels.triton.sampling, the same order
    and cut by construction), imported here so that a machine without one never loads it."""
    V = logits.numel()
    triton_ok = logits.dtype == torch.float32 and logits.is_contiguous() and 1 <= k <= min(256, V)
    if logits.is_cuda and triton_ok:
        from deimos.kernels.triton.sampling import topk

        return tuple(topk(logits, k))
    vals, ids = torch.topk(logits, min(k + 1, V))
    if k < V and vals[k] == vals[k - 1]:
        # rare: a tie straddles the cut; take every id above the k-th value, then the
        # lowest ids equal to it
        kth = vals[k - 1]
        above = torch.nonzero(logits > kth).squeeze(1)
        tied = torch.nonzero(logits == kth).squeeze(1)[: k - above.numel()]
        ids = torch.cat([above, tied])
    else:
        ids = ids[:k]
    ids = torch.sort(ids).values
    vals, order = torch.sort(logits[ids], descending=True, stable=True)
    return vals, ids[order]


def _top_p_cut(probs: torch.Tensor, top_p: float) -> int | None:
    """How many leading (descending) probabilities to keep: up to and including the first
    index where the running sum reaches top_p, as in llama.cpp; None if it never does."""
    hit = torch.nonzero(torch.cumsum(probs, 0) >= top_p)
    return int(hit[0]) + 1 if hit.numel() else None


def _top_p_histogram(logits: torch.Tensor, lse: torch.Tensor, top_p: float) -> torch.Tensor:
    """Ids of the top-p set of the whole vocabulary without sorting it: bucket the logits into
    4096 value bins (monotone in the logit), sum probability per bin, find the bin where the
    running mass from the top reaches top_p, and sort only that bin's members."""
    x = logits.double()
    probs = torch.exp(x - lse)
    finite = torch.isfinite(x)  # masked tokens (-inf, e.g. from a grammar) have no mass
    lo, hi = float(x[finite].min()), float(x[finite].max())
    n_bins = 4096
    scale = n_bins / (hi - lo) if hi > lo else 0.0
    b = ((torch.where(finite, x, lo) - lo) * scale).long().clamp_(0, n_bins - 1)
    mass = torch.bincount(b, weights=probs, minlength=n_bins)
    from_top = torch.flip(torch.cumsum(torch.flip(mass, (0,)), 0), (0,))  # mass of bins >= j
    j = int(torch.nonzero(from_top >= top_p)[-1]) if bool((from_top >= top_p).any()) else 0
    above = torch.nonzero(b > j).squeeze(1)
    member = torch.nonzero(b == j).squeeze(1)  # ascending ids
    _, order = torch.sort(x[member], descending=True, stable=True)
    member = member[order]
    n = _top_p_cut(torch.cat([probs[above].sum().reshape(1), probs[member]]), top_p)
    need = member.numel() if n is None else max(n - 1, 1)
    return torch.cat([above, member[:need]])


def filter_candidates(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Token ids surviving top_k -> top_p -> min_p on ``logits`` [V] (penalties already applied,
    temperature not yet). Order of the returned ids is unspecified."""
    V = logits.numel()
    ids: torch.Tensor | None = None  # None: the whole vocabulary
    vals: torch.Tensor | None = None  # logits of ids, descending when ids came from topk
    if 0 < p.top_k < V:
        vals, ids = _topk(logits, p.top_k)

    min_logit = None
    if p.min_p > 0:
        # the maximum survives every filter, so this is the threshold llama.cpp applies
        min_logit = logits.max() + math.log(p.min_p)

    if p.top_p < 1:
        if ids is not None:
            n = _top_p_cut(torch.softmax(vals.double(), 0), p.top_p)
            if n is not None:
                ids, vals = ids[:n], vals[:n]
        else:
            lse = torch.logsumexp(logits.double(), 0)
            # min_p keeps a prefix of the sorted order too: no window needs to exceed it
            cap = V if min_logit is None else int((logits >= min_logit).sum())
            for w in _WINDOWS:
                k = min(w, cap)
                vals, ids = _topk(logits, k)
                n = _top_p_cut(torch.exp(vals.double() - lse), p.top_p)
                if n is not None:
                    ids, vals = ids[:n], vals[:n]
                    break
                if k == cap:  # min_p's set is smaller than the top-p set
                    break
            else:
                ids = _top_p_histogram(logits, lse, p.top_p)
                vals = logits[ids]

    if min_logit is not None:
        if ids is None:
            ids = torch.nonzero(logits >= min_logit).squeeze(1)
        else:
            keep = vals >= min_logit
            keep[torch.argmax(vals)] = True  # at least one token
            ids = ids[keep]
    if ids is None:
        ids = torch.arange(V, device=logits.device)
    return ids


class TokenLogprobs(NamedTuple):
    token: int
    logprob: float
    top_ids: list[int]  # the k most likely tokens, most likely first
    top_logprobs: list[float]


def logprobs(logits: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """Log-probability of ``token`` and the ``k`` most likely alternatives under the model's
    distribution ``log_softmax(logits)`` (before penalties, filters and temperature)."""
    if logits.dim() != 1:
        raise ValueError(f"logits must be 1-D [V], got shape {tuple(logits.shape)}")
    if not 0 <= token < logits.numel():
        raise ValueError(f"token {token} is outside the vocabulary (0..{logits.numel() - 1})")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    lp = torch.log_softmax(logits.float(), 0)
    if k:
        vals, ids = _topk(lp, min(k, lp.numel()))
    else:
        vals, ids = lp[:0], torch.zeros(0, dtype=torch.long)
    return TokenLogprobs(token, float(lp[token]), ids.tolist(), vals.tolist())


def choose(logits: torch.Tensor, p: SamplingParams, u: float) -> int:
    """The token ``Sampler.sample`` picks from ``logits`` [V] float32 (penalties already
    applied) with the draw ``u`` in [0, 1): greedy is the first maximum; else top_k -> top_p ->
    min_p, softmax at the temperature in float64 over the kept ids (in ``filter_candidates``'
    order), and the first id whose cumulative probability exceeds ``u`` times the total."""
    if p.greedy:  # first maximum: ties to the lowest id
        if logits.is_cuda:
            from deimos.kernels.triton.sampling import argmax

            return int(argmax(logits))
        return int(torch.argmax(logits))
    ids = filter_candidates(logits, p)
    probs = torch.softmax(logits[ids].double() / p.temperature, 0)
    cum = torch.cumsum(probs, 0)
    target = cum[-1:] * u  # float64, on cum's device: no copy
    i = min(int(torch.searchsorted(cum, target, right=True)), ids.numel() - 1)
    return int(ids[i])


class Sampler:
    """One request's sampler: its seed and draw counter (``draws``: how many draws it has
    made; the next is ``draw_uniform(seed, draws)``) and its penalty history."""

    __slots__ = ("_counts", "_window", "draws", "params", "seed", "vocab_size")

    def __init__(self, params: SamplingParams, vocab_size: int) -> None:
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be > 0, got {vocab_size}")
        self.params = params
        self.vocab_size = vocab_size
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.draws = 0
        n = params.penalty_last_n
        self._window: deque[int] = deque(maxlen=None if n == -1 else n)
        self._counts: Counter[int] = Counter()

    def accept(self, token: int) -> None:
        """Record a token (prompt or generated) in the penalty window."""
        if not 0 <= token < self.vocab_size:
            raise ValueError(f"token {token} is outside the vocabulary (0..{self.vocab_size - 1})")
        if self.params.penalty_last_n == 0:
            return
        if self._window.maxlen is not None and len(self._window) == self._window.maxlen:
            old = self._window[0]
            self._counts[old] -= 1
            if not self._counts[old]:
                del self._counts[old]
        self._window.append(token)
        self._counts[token] += 1

    def accept_many(self, tokens: Sequence[int], checked: bool = False) -> None:
        """``accept`` of each of ``tokens`` in turn (a prompt), without a Python step per
        token: only the window's last ``penalty_last_n`` tokens are kept. ``checked``: the
        caller has already checked that every token is in the vocabulary (the engine's
        ``add``): no second pass over a long prompt."""
        if not tokens:
            return
        if not checked:
            lo, hi = min(tokens), max(tokens)
            if lo < 0 or hi >= self.vocab_size:
                bad = lo if lo < 0 else hi
                raise ValueError(
                    f"token {bad} is outside the vocabulary (0..{self.vocab_size - 1})")
        if self.params.penalty_last_n == 0:
            return
        n = self._window.maxlen
        if n is None:
            self._window.extend(tokens)
            self._counts.update(tokens)
            return
        if len(tokens) < n:  # the window's oldest go one by one, as accept does
            for t in tokens:
                self.accept(t)
            return
        self._window = deque(tokens[len(tokens) - n:], maxlen=n)
        self._counts = Counter(self._window)

    def penalized(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` after the penalty step (a copy when anything changes)."""
        self._check(logits)
        return apply_penalties(logits, self._counts, self.params)

    def next_uniform(self) -> float:
        """The ``u`` of this request's next draw (advances the draw counter)."""
        u = draw_uniform(self.seed, self.draws)
        self.draws += 1
        return u

    def penalty_counts(self) -> dict[int, int]:
        """Token id -> count in the penalty window, as the penalties see it (empty when the
        penalties are off): what a batched row's pen_ids / pen_counts hold."""
        return dict(self._counts) if self.params.penalties_enabled else {}

    def sample(self, logits: torch.Tensor, u: float | None = None) -> int:
        """Draw the next token from ``logits`` [V] float32 with the uniform ``u`` in [0, 1)
        (None: ``next_uniform()``; greedy draws nothing). Does not call ``accept``."""
        if u is not None and not 0.0 <= u < 1.0:
            raise ValueError(f"u must be in [0, 1), got {u!r}")
        logits = self.penalized(logits)
        if u is None and not self.params.greedy:
            u = self.next_uniform()
        return choose(logits, self.params, 0.0 if u is None else u)

    def _check(self, logits: torch.Tensor) -> None:
        if logits.dim() != 1 or logits.numel() != self.vocab_size:
            raise ValueError(
                f"logits must have shape [{self.vocab_size}], got {tuple(logits.shape)}"
            )
        if logits.dtype != torch.float32:
            raise ValueError(f"logits must be float32, got {logits.dtype}")
        if math.isnan(float(logits.max())):  # max propagates NaN: one pass
            raise ValueError("logits contain NaN")
