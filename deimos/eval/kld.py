"""KL-divergence and token-probability statistics of a test model against a reference model,
over log-probability arrays: the numbers ``llama-perplexity --kl-divergence`` prints.

Every function is pure and takes numpy arrays of log-probabilities ``[N, n_vocab]`` (N scored
positions, rows normalized: ``logsumexp(row) == 0``), of any float dtype; they compute in
float64. ``next_tokens [N]`` is the token that follows each position in the text.

Per position ``i`` (P = reference, Q = test, t = next_tokens[i]):

    KLD_i      = sum_v P(v) (log P(v) - log Q(v))       (nats; >= 0, 0 iff P == Q)
    same_top_i = argmax P == argmax Q                    (first maximum, as llama.cpp)
    delta_p_i  = Q(t) - P(t)                             (the text's next token, as llama.cpp)
    nll_i      = -log Q(t),  nll_ref_i = -log P(t)

``floor``: terms whose reference log-probability is at or below it are left out of the KLD
sum. llama.cpp stores the reference's log-probabilities as 16-bit steps over the top 16 nats
of each row and drops everything else (``floor=-16``, what the log-prob files of
``deimos.eval.logits_file`` hold too); the exact KLD is ``floor=None``.

``summarize`` turns the per-position values into llama.cpp's summary: means with their
uncertainty (standard error, ``sqrt((mean(x^2) - mean(x)^2) / (n - 1))``), the percentiles
(linear interpolation between sorted values, as llama.cpp and numpy's default), RMS of
delta_p, the fraction of same top tokens with its binomial uncertainty, and the perplexities
of both models with the correlation of their per-token log-likelihoods.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# what llama.cpp prints, besides maximum, median and minimum (percent)
KLD_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 10.0, 5.0, 1.0, 0.1)
DELTA_P_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 75.0, 25.0, 10.0, 5.0, 1.0, 0.1)

_ROWS = 64  # rows per step: bounds the float64 temporaries ([64, 262144] = 134 MB)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Rows of ``logits [N, V]`` -> log-probabilities [N, V] float64."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))


def _check(ref_logp: np.ndarray, test_logp: np.ndarray, next_tokens: np.ndarray | None = None):
    if ref_logp.ndim != 2 or ref_logp.shape != test_logp.shape:
        raise ValueError(f"log-probabilities: reference {ref_logp.shape} and test "
                         f"{test_logp.shape} must be equal [positions, n_vocab] shapes")
    if next_tokens is not None:
        t = np.asarray(next_tokens)
        if t.shape != (ref_logp.shape[0],):
            raise ValueError(f"next_tokens {t.shape}: one per position, {ref_logp.shape[0]}")
        if t.size and (t.min() < 0 or t.max() >= ref_logp.shape[1]):
            raise ValueError(f"next_tokens outside the vocabulary [0, {ref_logp.shape[1]})")


def kld_per_position(ref_logp: np.ndarray, test_logp: np.ndarray,
                     floor: float | None = None) -> np.ndarray:
    """KL(P_ref || P_test) of every row: [N] float64 (see the module docstring for ``floor``)."""
    _check(ref_logp, test_logp)
    out = np.empty(ref_logp.shape[0], dtype=np.float64)
    for i in range(0, ref_logp.shape[0], _ROWS):
        r = np.asarray(ref_logp[i:i + _ROWS], dtype=np.float64)
        q = np.asarray(test_logp[i:i + _ROWS], dtype=np.float64)
        terms = np.exp(r) * (r - q)
        if floor is not None:
            terms = np.where(r > floor, terms, 0.0)
        out[i:i + _ROWS] = terms.sum(axis=-1)
    return out


def same_top(ref_logp: np.ndarray, test_logp: np.ndarray) -> np.ndarray:
    """[N] bool: the two models' most likely tokens are the same (first maximum of a tie)."""
    _check(ref_logp, test_logp)
    return np.argmax(ref_logp, axis=-1) == np.argmax(test_logp, axis=-1)


def token_logp(logp: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """[N] float64: row i's log-probability of ``tokens[i]``."""
    t = np.asarray(tokens, dtype=np.int64)
    return np.asarray(logp[np.arange(t.shape[0]), t], dtype=np.float64)


def delta_p(ref_logp: np.ndarray, test_logp: np.ndarray, next_tokens: np.ndarray) -> np.ndarray:
    """[N] float64: Q(t) - P(t) for the next token t of each position."""
    _check(ref_logp, test_logp, next_tokens)
    return np.exp(token_logp(test_logp, next_tokens)) - np.exp(token_logp(ref_logp, next_tokens))


@dataclass(frozen=True)
class PositionStats:
    """The per-position values of a comparison, all [N]; ``concat`` joins chunks."""

    kld: np.ndarray
    delta_p: np.ndarray
    same_top: np.ndarray  # bool
    nll: np.ndarray  # the test model's -log Q(t)
    nll_ref: np.ndarray  # the reference's -log P(t)

    @property
    def n(self) -> int:
        return int(self.kld.shape[0])

    @staticmethod
    def concat(parts: list[PositionStats]) -> PositionStats:
        if not parts:
            raise ValueError("PositionStats.concat: nothing to join")
        return PositionStats(*(np.concatenate([getattr(p, f) for p in parts])
                               for f in ("kld", "delta_p", "same_top", "nll", "nll_ref")))


def compare_positions(ref_logp: np.ndarray, test_logp: np.ndarray, next_tokens: np.ndarray,
                      floor: float | None = None) -> PositionStats:
    """Every per-position value of ``test_logp`` against ``ref_logp`` at once."""
    _check(ref_logp, test_logp, next_tokens)
    lq, lp = token_logp(test_logp, next_tokens), token_logp(ref_logp, next_tokens)
    return PositionStats(kld_per_position(ref_logp, test_logp, floor), np.exp(lq) - np.exp(lp),
                         same_top(ref_logp, test_logp), -lq, -lp)


# ---- summary statistics (llama.cpp's) -----------------------------------------------------


def mean_and_uncertainty(values: np.ndarray) -> tuple[float, float]:
    """(mean, standard error of the mean); the error is 0 for 10 values or fewer, as llama.cpp."""
    x = np.asarray(values, dtype=np.float64)
    n = x.shape[0]
    if n < 1:
        return 0.0, 0.0
    mean = float(x.mean())
    var = float((x * x).mean()) - mean * mean
    return mean, (math.sqrt(var / (n - 1)) if var > 0 and n > 10 else 0.0)


def percentile(values: np.ndarray, percent: float) -> float:
    """Linear interpolation between the sorted values (llama.cpp's ``percentile``)."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), percent))


def _covariance(a: np.ndarray, b: np.ndarray) -> float:
    """Covariance of the two means (llama.cpp: 0 below 10 values)."""
    n = a.shape[0]
    if n < 10:
        return 0.0
    return float((a * b).mean() - a.mean() * b.mean()) / (n - 1)


@dataclass(frozen=True)
class Estimate:
    value: float
    unc: float  # one standard error

    def to_json(self) -> dict[str, float]:
        return {"value": self.value, "unc": self.unc}


@dataclass(frozen=True)
class KLDSummary:
    n: int
    ppl: Estimate  # the test model's perplexity
    ppl_ref: Estimate
    cor_ln_ppl: float  # correlation of the two mean log-likelihoods
    ln_ppl_ratio: Estimate  # ln(PPL(Q) / PPL(ref))
    ppl_ratio: Estimate
    ppl_diff: Estimate
    kld: Estimate
    kld_percentiles: dict[str, float]  # "max", "99.9", ..., "median", ..., "min"
    delta_p: Estimate
    delta_p_percentiles: dict[str, float]
    rms_delta_p: Estimate
    same_top: Estimate  # fraction of positions

    def to_json(self) -> dict:
        out: dict = {"n": self.n, "cor_ln_ppl": self.cor_ln_ppl,
                     "kld_percentiles": self.kld_percentiles,
                     "delta_p_percentiles": self.delta_p_percentiles}
        for name in ("ppl", "ppl_ref", "ln_ppl_ratio", "ppl_ratio", "ppl_diff", "kld", "delta_p",
                     "rms_delta_p", "same_top"):
            out[name] = getattr(self, name).to_json()
        return out


def _percentiles(values: np.ndarray, percents: tuple[float, ...]) -> dict[str, float]:
    """max, the percents above 50, median, those below, min: llama.cpp's order."""
    x = np.sort(np.asarray(values, dtype=np.float64))
    out = {"max": float(x[-1])}
    out.update({f"{p:g}": percentile(x, p) for p in percents if p > 50})
    out["median"] = float(np.median(x))
    out.update({f"{p:g}": percentile(x, p) for p in percents if p <= 50})
    out["min"] = float(x[0])
    return out


def summarize(s: PositionStats) -> KLDSummary:
    """llama.cpp's KL-divergence report of the per-position values ``s`` (N >= 2)."""
    if s.n < 2:
        raise ValueError(f"KLD statistics need at least 2 scored positions, got {s.n}")
    n = s.n
    ln_q, ln_q_unc = mean_and_uncertainty(s.nll)
    ln_p, ln_p_unc = mean_and_uncertainty(s.nll_ref)
    cov = _covariance(s.nll, s.nll_ref)
    cor = cov / (ln_q_unc * ln_p_unc) if ln_q_unc > 0 and ln_p_unc > 0 else math.nan
    ratio = ln_q - ln_p
    ratio_unc = math.sqrt(max(ln_q_unc ** 2 + ln_p_unc ** 2 - 2.0 * cov, 0.0))
    ppl, ppl_ref = math.exp(ln_q), math.exp(ln_p)
    ppl_unc, ppl_ref_unc = ppl * ln_q_unc, ppl_ref * ln_p_unc
    diff_unc = math.sqrt(max(ppl_unc ** 2 + ppl_ref_unc ** 2 - 2.0 * ppl * ppl_ref * cov, 0.0))
    mse, mse_unc = mean_and_uncertainty(s.delta_p ** 2)
    rms = math.sqrt(mse)
    top = float(np.mean(s.same_top))
    return KLDSummary(
        n=n, ppl=Estimate(ppl, ppl_unc), ppl_ref=Estimate(ppl_ref, ppl_ref_unc), cor_ln_ppl=cor,
        ln_ppl_ratio=Estimate(ratio, ratio_unc),
        ppl_ratio=Estimate(math.exp(ratio), math.exp(ratio) * ratio_unc),
        ppl_diff=Estimate(ppl - ppl_ref, diff_unc),
        kld=Estimate(*mean_and_uncertainty(s.kld)),
        kld_percentiles=_percentiles(s.kld, KLD_PERCENTILES),
        delta_p=Estimate(*mean_and_uncertainty(s.delta_p)),
        delta_p_percentiles=_percentiles(s.delta_p, DELTA_P_PERCENTILES),
        rms_delta_p=Estimate(rms, 0.5 / rms * mse_unc if rms > 0 else 0.0),
        same_top=Estimate(top, math.sqrt(top * (1.0 - top) / (n - 1))),
    )
