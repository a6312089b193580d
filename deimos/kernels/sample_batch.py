"""Batched sampling: the rows' settings as device tensors (``SamplingRows``) and the torch
oracle of the device sampler (deimos.kernels.triton.sample_batch): a loop over rows through
the sampler's own code (``apply_penalties``, then ``choose``).

The device sampler sees each row's 256 best candidates (the window, in the order descending
logit, then ascending id) plus the row's logsumexp over the whole vocabulary. The filters keep
a prefix of that order, so it decides a row when it can see where the kept prefix ends:
- greedy, and top_k of 1..256: always;
- top_p over the whole vocabulary (top_k off): when its set ends within the 256;
- top_p after a top_k above 256: never (it normalizes over the k candidates, whose sum the
  window lacks) unless min_p keeps only the maximum;
- min_p: when its set has at most 255 tokens (the 256th candidate is seen below the threshold;
  a set of exactly 256 is flagged: the window holds it but cannot see that it ends there).
The kept set is the shortest prefix found, and the row is decided when every filter whose end
the window does not show provably keeps at least as many. Any other row (top_p / min_p sets
beyond the window, a top_k above 256 alone, no filter at all) is flagged for the host, which
samples it from the same logits with the same ``u``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

import torch

from deimos.kernels.sampling import Sampler, SamplingParams, _top_p_cut, apply_penalties, choose
from deimos.kernels.token_mask import NEG, bits_of

WINDOW = 256  # candidates the device keeps per row
PENALTY_WIDTH = 64  # distinct penalized ids a row the engine's device sampler takes
EXACT, HOST, NAN_ROW = 0, 1, 2  # out_flags values


class SamplingRows(NamedTuple):
    """B rows' sampling settings, all on one device (a CUDA graph's static inputs).

    temperature, top_p, min_p and u are float64 so that they hold the request's Python floats
    exactly (the filters compare against them in float64, as the sampler does); the penalties
    are float32, the precision the sampler applies them in."""

    temperature: torch.Tensor  # float64 [B]; 0 = greedy
    top_k: torch.Tensor  # int32 [B]; 0 = off
    top_p: torch.Tensor  # float64 [B]; 1 = off
    min_p: torch.Tensor  # float64 [B]; 0 = off
    repeat: torch.Tensor  # float32 [B]; 1 = off (llama.cpp's repetition penalty)
    frequency: torch.Tensor  # float32 [B]
    presence: torch.Tensor  # float32 [B]
    u: torch.Tensor  # float64 [B]; the row's draw in [0, 1) (Sampler.next_uniform)
    pen_ids: torch.Tensor  # int64 [B, L]; distinct ids of the row's penalty window
    pen_counts: torch.Tensor  # int32 [B, L]; their counts (0: unused entry)


_DTYPES = dict(temperature=torch.float64, top_k=torch.int32, top_p=torch.float64,
               min_p=torch.float64, repeat=torch.float32, frequency=torch.float32,
               presence=torch.float32, u=torch.float64, pen_ids=torch.int64,
               pen_counts=torch.int32)  # fmt: skip


def empty_rows(n_rows: int, width: int, device: torch.device | str = "cpu") -> SamplingRows:
    """``n_rows`` neutral rows (greedy, no penalties) with room for ``width`` penalized ids:
    the static inputs of a graph, or the padding of a batch."""
    if n_rows < 1 or width < 1:
        raise ValueError(f"empty_rows: need n_rows >= 1 and width >= 1, got {n_rows}, {width}")
    one = dict(top_p=1.0, repeat=1.0)
    return SamplingRows(**{
        name: torch.full((n_rows, width) if name.startswith("pen_") else (n_rows,),
                         one.get(name, 0), dtype=dt, device=device)
        for name, dt in _DTYPES.items()})  # fmt: skip


def rows_for(samplers: Sequence[Sampler | None], width: int,
             us: Sequence[float] | None = None) -> SamplingRows:
    """Host (CPU) rows for ``samplers`` (None: a padding row, greedy). ``us``: each row's
    draw; None takes each non-greedy sampler's ``next_uniform()`` (greedy rows draw nothing,
    their u is 0). ``width`` (L) must hold every sampler's penalty window."""
    if us is not None and len(us) != len(samplers):
        raise ValueError(f"rows_for: {len(us)} draws for {len(samplers)} rows")
    rows = empty_rows(len(samplers), width)
    for b, s in enumerate(samplers):
        if s is None:
            continue
        p = s.params
        rows.temperature[b], rows.top_k[b], rows.top_p[b], rows.min_p[b] = (
            p.temperature, p.top_k, p.top_p, p.min_p)
        rows.repeat[b], rows.frequency[b], rows.presence[b] = (
            p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
        if us is not None:
            rows.u[b] = us[b]
        elif not p.greedy:
            rows.u[b] = s.next_uniform()
        counts = s.penalty_counts()
        if len(counts) > width:
            raise ValueError(f"rows_for: row {b} has {len(counts)} penalized ids > width {width}")
        if counts:
            rows.pen_ids[b, : len(counts)] = torch.tensor(list(counts), dtype=torch.int64)
            rows.pen_counts[b, : len(counts)] = torch.tensor(list(counts.values()),
                                                             dtype=torch.int32)
    return rows


def copy_rows(dst: SamplingRows, src: SamplingRows, non_blocking: bool = False) -> None:
    """Fill ``dst`` (e.g. a graph's static rows) from ``src`` of the same shapes. With
    ``non_blocking`` and pinned host ``src`` the copies are queued on the stream: keep ``src``
    unchanged until they have run."""
    for d, s in zip(dst, src):
        d.copy_(s, non_blocking=non_blocking)


def row_params(rows: SamplingRows, b: int) -> tuple[SamplingParams, Counter[int], float]:
    """Row ``b`` as the sampler sees it: its settings, its penalty counts, its draw."""
    counts = Counter({int(i): int(c) for i, c in zip(rows.pen_ids[b].tolist(),
                                                     rows.pen_counts[b].tolist()) if c > 0})
    p = SamplingParams(
        temperature=float(rows.temperature[b]), top_k=int(rows.top_k[b]),
        top_p=float(rows.top_p[b]), min_p=float(rows.min_p[b]),
        repetition_penalty=float(rows.repeat[b]), frequency_penalty=float(rows.frequency[b]),
        presence_penalty=float(rows.presence[b]), penalty_last_n=-1, seed=0,
    )  # fmt: skip
    return p, counts, float(rows.u[b])


def always_decided(p: SamplingParams) -> bool:
    """Whether the device's window decides every row sampled with ``p``, whatever its logits:
    greedy, or top_k of 1..WINDOW (module docstring)."""
    return p.greedy or 1 <= p.top_k <= WINDOW


def window_decides(logits: torch.Tensor, p: SamplingParams, window: int = WINDOW) -> bool:
    """Whether the device's ``window`` best candidates decide this row (module docstring):
    ``logits`` [V] float32 after penalties. Computed here from the whole sorted row."""
    v = logits.numel()
    k = p.top_k if 0 < p.top_k < v else 0
    if p.greedy or 1 <= k <= window:
        return True
    vals = torch.sort(logits, descending=True, stable=True).values
    found, lower = [], []  # kept-set sizes the window shows; lower bounds of the others
    if p.top_p < 1:
        if k:  # normalized over k > window candidates: any size, unseen
            lower.append(1)
        else:
            lse = torch.logsumexp(logits.double(), 0)
            n = _top_p_cut(torch.exp(vals[:window].double() - lse), p.top_p)
            (found if n is not None else lower).append(n if n is not None else window + 1)
    if p.min_p > 0:
        thr = vals[0] + math.log(p.min_p)  # float32, as filter_candidates computes it
        n = int((vals >= thr).sum())
        (found if n < window else lower).append(min(n, window))
    return bool(found) and min(found) <= min(lower, default=v)


def sample_rows_reference(logits: torch.Tensor, rows: SamplingRows,
                          words: torch.Tensor | None = None,
                          masked: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``sample_rows`` writes: (ids int64 [B], flags int32 [B]) for ``logits`` [B, V]
    float32. A decided row's id is ``choose(apply_penalties(row, counts, params), params, u)``,
    the sampler's own path; a flagged row (HOST: the window cannot decide it; NAN_ROW: NaN in
    the row) has id -1. ``words`` / ``masked``: allowed-token masks (``token_mask``); a masked
    row's forbidden tokens get NEG after the penalties, and a NaN among them does not count."""
    x = logits.detach().float().cpu()
    n_b, v = x.shape
    ids = torch.full((n_b,), -1, dtype=torch.int64)
    flags = torch.zeros(n_b, dtype=torch.int32)
    for b in range(n_b):
        allowed = None
        if masked is not None and int(masked[b]):
            allowed = torch.from_numpy(bits_of(words[b].cpu().numpy(), v).copy())
        if bool(torch.isnan(x[b] if allowed is None else x[b][allowed]).any()):
            flags[b] = NAN_ROW
            continue
        p, counts, u = row_params(rows, b)
        row = apply_penalties(x[b], counts, p)
        if allowed is not None:
            row = torch.where(allowed, row, torch.tensor(NEG, dtype=row.dtype))
        if not window_decides(row, p):
            flags[b] = HOST
            continue
        ids[b] = choose(row, p, u)
    return ids, flags
