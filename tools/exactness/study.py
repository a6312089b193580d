"""The exactness study (issue 13, docs/exactness.md): every path's log-probabilities against
the float64 yardstick, per position, on the sequences of ``sequences.py``.

Per path and group: KLD to float64 (mean, p99, max; deimos.eval.kld, exact: no floor), top-1
agreement, and at each top-1 disagreement the yardstick's own margin between the two tokens
(a near-tie flips on noise). Per sequence: the mean KLD of every path, so that each case where
Deimos is farther from float64 than llama.cpp is listed. At the first generated token: the
largest error of the logits relative to the top token over the yardstick's top 8 (the issue's
measure).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from deimos.eval.kld import PositionStats, compare_positions, log_softmax, summarize

from .sequences import Sequence

TOP_REL = 8  # the yardstick's top tokens over which relative-logit errors are taken


@dataclass
class PathResult:
    stats: dict[str, list[PositionStats]] = field(default_factory=lambda: defaultdict(list))
    per_sequence: list[dict] = field(default_factory=list)
    flips: list[dict] = field(default_factory=list)  # top-1 disagreements
    first_gen_rel: list[float] = field(default_factory=list)


def relative_logit_error(ref: np.ndarray, test: np.ndarray, k: int = TOP_REL) -> float:
    """max over the reference's top k of |(test_i - test_top) - (ref_i - ref_top)| (one row)."""
    top = np.argsort(-ref, kind="stable")[:k]
    return float(np.max(np.abs((test[top] - test[top[0]]) - (ref[top] - ref[top[0]]))))


def compare(seq: Sequence, ref_logits: np.ndarray, test_logits: np.ndarray, res: PathResult) -> None:
    ref_lp, test_lp = log_softmax(ref_logits), log_softmax(test_logits)
    s = compare_positions(ref_lp, test_lp, np.asarray(seq.next_tokens))
    res.stats[seq.group].append(s)
    res.per_sequence.append({"group": seq.group, "id": seq.id, "n": s.n,
                             "kld_mean": float(s.kld.mean()), "kld_max": float(s.kld.max()),
                             "same_top": float(s.same_top.mean())})
    for i in np.nonzero(~s.same_top)[0]:
        r = ref_logits[i].astype(np.float64)
        a, b = int(np.argmax(r)), int(np.argmax(test_logits[i]))
        res.flips.append({"group": seq.group, "id": seq.id, "position": seq.positions[i],
                          "ref_top": a, "test_top": b, "ref_margin": float(r[a] - r[b]),
                          "kld": float(s.kld[i])})
    if seq.first_gen is not None:
        i = seq.positions.index(seq.first_gen)
        res.first_gen_rel.append(relative_logit_error(ref_logits[i].astype(np.float64),
                                                      test_logits[i].astype(np.float64)))


def summary(res: PathResult) -> dict:
    out = {}
    groups = {**res.stats, "all": [s for v in res.stats.values() for s in v]}
    for g, parts in groups.items():
        s = PositionStats.concat(parts)
        k = summarize(s)
        out[g] = {"n": s.n, "kld_mean": k.kld.value, "kld_p99": k.kld_percentiles["99"],
                  "kld_max": k.kld_percentiles["max"], "same_top": k.same_top.value,
                  "flips": int((~s.same_top).sum())}
    if res.first_gen_rel:
        x = np.asarray(res.first_gen_rel)
        out["first_gen_rel_logit"] = {"n": int(x.size), "median": float(np.median(x)),
                                      "max": float(x.max())}
    return out
