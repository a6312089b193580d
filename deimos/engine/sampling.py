"""Choosing the next token of every sequence that has logits after a step.

Three paths, per row:
- device, in the graph: a decode graph captures the batch's sampling (deimos.kernels.triton.
  sample_batch.sample_rows) after the model step, its settings and each row's random draw u
  loaded with the step's inputs; the host reads B ids and B flags (one small copy);
- device, eager: the same kernels on an eager step's logits;
- host: the request's own ``Sampler`` on the row (exact llama.cpp chain) for rows that need the
  host: a logits processor (a JSON-schema mask), or a row the device's 256-candidate window
  cannot decide (flagged by the kernel: it then samples with the same u, so the choice is the
  one the device would have made with an unbounded window).
Logprobs, when a request asks, are computed from the raw logits row on the device.

Rows verifying drafts (deimos.engine.speculate) are chosen on the host path, one at a time after
the tokens before them were accepted (``verify``): the request's ``Sampler`` distribution
(``target_distribution``) with the speculative acceptance rule; greedy rows without penalties
all at once (``greedy_rows``, the same argmax).

The draw u of each row comes from its request's ``Sampler`` (a counter-based stream of its seed),
so a seed gives the same tokens on every path and device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deimos.engine.request import EngineError, masks_only
from deimos.engine.sequence import Sequence
from deimos.kernels.sample_batch import EXACT, NAN_ROW
from deimos.kernels.sampling import Sampler, choose, filter_candidates, logprobs


def _host_only(seq: Sequence) -> bool:
    """Whether ``seq``'s tokens are chosen on the host: a logits processor the device cannot
    apply (only a grammar's allowed-token mask, ``mask_words``, is applied there)."""
    return not masks_only(seq.request.logits_processors)


def _row(result, i: int) -> torch.Tensor:
    """Row ``i`` of a step's logits: its host copy where ``BatchSampler.hold`` made one (the
    device rows were overwritten by a chained step since)."""
    held = result.held.get(i)
    if held is None:
        return result.logits[i]
    buf, done = held
    done.synchronize()
    return buf


def target_distribution(sampler: Sampler, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distribution ``sampler.sample(row)`` draws from at its current history: token ids
    [n] int64 and their probabilities [n] float64 (penalties, top-k -> top-p -> min-p, softmax at
    the temperature over the kept ids, as ``deimos.kernels.sampling.choose``; greedy: the first
    maximum with probability 1). Raises ValueError on a bad row (NaN...)."""
    logits = sampler.penalized(row)
    p = sampler.params
    if p.greedy:
        return (torch.tensor([choose(logits, p, 0.0)], dtype=torch.long),
                torch.ones(1, dtype=torch.float64))
    ids = filter_candidates(logits, p)
    return ids, torch.softmax(logits[ids].double() / p.temperature, 0)


def accept_draft(ids: torch.Tensor, probs: torch.Tensor, draft: int, u: float,
                 resample: Callable[[], float]) -> tuple[int, bool]:
    """Speculative rejection sampling of a deterministic draft (q one-hot at ``draft``).

    ``ids`` [n] int64, ``probs`` [n] float64: the target distribution p (the plain sampler's,
    ``target_distribution``; any scale). ``u`` in [0, 1): the draw that accepts ``draft`` when
    u < p(draft); on a rejection ``resample()`` gives the draw of the token taken from p with
    ``draft`` removed, renormalized. The token returned follows p exactly (its probability:
    p(t) for t != draft is (1 - p(d)) * p(t) / (1 - p(d))). Returns (token, accepted)."""
    if ids.ndim != 1 or ids.shape != probs.shape or not ids.numel():
        raise ValueError(f"accept_draft: ids {tuple(ids.shape)} and probs {tuple(probs.shape)} "
                         "must be equal non-empty 1-D shapes")
    probs = probs.double()
    total = float(probs.sum())
    hit = torch.nonzero(ids == draft)
    at = int(hit[0, 0]) if hit.numel() else None
    p_draft = float(probs[at]) / total if at is not None else 0.0
    if u < p_draft:
        return draft, True
    rest = probs.clone()
    if at is not None:
        rest[at] = 0.0
    cum = torch.cumsum(rest, 0)
    if not float(cum[-1]) > 0.0:  # every bit of mass is the draft's (rounding put u past it)
        return draft, True
    target = cum[-1:] * resample()
    i = min(int(torch.searchsorted(cum, target, right=True)), ids.numel() - 1)
    return int(ids[i]), False


class BatchSampler:
    def __init__(self, n_vocab: int, device: torch.device, max_rows: int) -> None:
        self.n_vocab = n_vocab
        self.device = torch.device(device)
        self.max_rows = max_rows
        self._device_rows = None  # deimos.kernels.triton.sample_batch, when on a GPU
        if self.device.type == "cuda":
            from deimos.engine.device_sampling import DeviceRows

            self._device_rows = DeviceRows

        self._graph_state: dict[int, object] = {}  # decode bucket -> its static sampling state
        self._eager = None  # the eager steps' sampling state (made at the first)
        self._held: list[torch.Tensor] = []  # pinned rows for ``hold``, used in turn
        self._held_at = 0
        self._resampler = None  # ``resample``'s sampling state and its logits rows
        self._resample_in: torch.Tensor | None = None

    # ---- graph capture and replay -------------------------------------------------------

    def graph_hook(self, rows: int) -> Callable[[torch.Tensor], None] | None:
        """What a decode graph of ``rows`` rows captures after the model step."""
        if self._device_rows is None:
            return None
        state = self._device_rows(rows, self.n_vocab, self.device)
        self._graph_state[rows] = state
        return state.run

    def prepare(self, rows: int, wanting: list[Sequence],
                passengers: frozenset[int] = frozenset()) -> None:
        """Before a decode graph of ``rows`` rows replays: its rows' settings and draws (none
        for the ``passengers``, whose outputs are not read)."""
        state = self._graph_state.get(rows)
        if state is not None:
            state.load(wanting, passengers)

    def launched(self, rows: int) -> int | None:
        """After a decode graph of ``rows`` rows was replayed: the ticket of its choices."""
        state = self._graph_state.get(rows)
        return state.fetch() if state is not None and state.loaded else None

    def hold(self, result, rows: list[int]) -> None:
        """Copies the logits ``rows`` of ``result`` (a decode graph's static output) to pinned
        host memory, enqueued now: the chained step launched next overwrites that output, and
        ``choose`` reads these copies, waiting for ``result``'s step only (its host work then
        runs while the next step does). Two slots a row, used in turn: a copy is read before
        the step after next holds again."""
        if not rows:
            return
        logits = result.logits
        while len(self._held) < 2 * len(rows):
            self._held.append(torch.empty(logits.shape[1], dtype=logits.dtype, pin_memory=True))
        done = torch.cuda.Event()
        for i in rows:
            buf = self._held[self._held_at % len(self._held)]
            self._held_at += 1
            buf.copy_(logits[i], non_blocking=True)
            result.held[i] = (buf, done)
        done.record()

    def resample(self, result, rows: list[tuple[int, Sequence]]) -> None:
        """After a chained launch (``result``): its deferred rows (``Engine._deferred``: a
        grammar's mask or penalties, which needed the token read since) sampled now on the
        device from that launch's logits, each with its mask, penalty window and draw; each
        choice written as the row's next input (the graph's feed, which the next launch
        reads) and kept for ``choose``. Enqueued before the next launch overwrites the
        logits."""
        k = len(rows)
        state = self._resampler
        if state is None or state.n_rows < k:
            n = max(k, 4)
            state = self._resampler = self._device_rows(n, self.n_vocab, self.device)
            self._resample_in = torch.empty((n, self.n_vocab), dtype=torch.float32,
                                            device=self.device)
        state.load([seq for _, seq in rows])
        x = self._resample_in
        for j, (i, _) in enumerate(rows):
            x[j].copy_(result.logits[i])
        state.run(x[:k])
        feed = result.graph.tokens
        chosen = state.ids[:k].clamp(min=0)  # a flagged row's -1: its request fails at the read
        for j, (i, _) in enumerate(rows):
            feed[i : i + 1].copy_(chosen[j : j + 1])
        result.resampled = (state, state.fetch(), {i: j for j, (i, _) in enumerate(rows)})
        result.resample_errors = {rows[j][0]: e for j, e in state.mask_errors.items()}

    # ---- after a step ------------------------------------------------------------------

    def choose(self, result, device: torch.device) -> list[tuple[int | None, BaseException | None]]:
        logits = result.logits
        wanting = result.wanting
        n = len(wanting)
        graph = result.graph
        state = self._graph_state.get(graph.n_seqs) if graph is not None and graph.decode else None
        device_ids = flags = us = None
        if state is not None and result.ticket is not None:
            device_ids, flags, us = state.read(result.ticket, n)
        elif self._device_rows is not None and n and not all(map(_host_only, wanting)):
            eager = self._eager  # one state for every eager step: up to max_rows rows
            if eager is None or eager.n_rows < n:
                eager = self._eager = self._device_rows(max(n, self.max_rows), self.n_vocab, self.device)
            eager.load(wanting)
            eager.run(logits[:n])
            device_ids, flags, us = eager.read(eager.fetch(), n)
        late = None  # the rows chosen after the launch (resample): their places, ids, flags
        if result.resampled is not None:
            st, ticket, place = result.resampled
            late = place, *st.read(ticket, len(place))[:2]
        out: list[tuple[int | None, BaseException | None]] = []
        for i, seq in enumerate(wanting):
            if i in result.passengers:  # not read (Engine._read skips the row)
                out.append((None, None))
                continue
            req = seq.request
            try:
                if late is not None and i in late[0]:
                    out.append((self._late(result, i, late), None))
                    continue
                if device_ids is not None and not _host_only(seq) and flags[i] == 0:
                    token = device_ids[i]
                elif device_ids is not None and flags[i] == NAN_ROW:
                    raise EngineError("cannot sample from the model's logits: logits contain NaN")
                else:
                    token = self._host(seq, _row(result, i), None if us is None else us[i])
                if req.top_logprobs is not None:
                    req.token_logprobs.append(logprobs(_row(result, i).float(), token,
                                                       req.top_logprobs))
                out.append((token, None))
            except EngineError as e:
                out.append((None, e))
        return out

    @staticmethod
    def _late(result, i: int, late) -> int:
        """Row ``i``'s token chosen by ``resample``; EngineError where it could not be (its
        logits were overwritten by the next launch since: no host fallback)."""
        place, ids, flags = late
        j = place[i]
        if flags[j] == EXACT:
            return ids[j]
        if flags[j] == NAN_ROW:
            raise EngineError("cannot sample from the model's logits: logits contain NaN")
        err = result.resample_errors.get(i)
        raise EngineError(f"the request's grammar could not mask its next token: {err}"
                          if err is not None else "the device could not sample the row")

    # ---- verifying drafts ----------------------------------------------------------------

    def greedy_rows(self, seq: Sequence, rows: torch.Tensor) -> list[int | None] | None:
        """Every row's choice at once when it depends on no earlier choice (greedy, no
        penalties or processors): the first maximum of each row of ``rows`` [n, V] (None for a
        row holding NaN); None when the rows must be chosen one at a time (``verify``)."""
        p = seq.request.sampling
        if not p.greedy or p.penalties_enabled or seq.request.logits_processors:
            return None
        rows = rows.float()
        ids, bad = torch.stack((torch.argmax(rows, 1), torch.isnan(rows).any(1).long())).tolist()
        return [None if b else t for t, b in zip(ids, bad)]

    def verify(self, seq: Sequence, row: torch.Tensor, draft: int | None) -> tuple[int, bool]:
        """The token at a verified row [V] and whether it is ``draft``, accepted: greedy, the
        plain choice; sampled, the speculative rejection rule on the plain distribution (two
        draws of the request's stream at most). ``draft`` None (the row after the last draft):
        the plain choice. Call after every earlier row's token was accepted (penalties)."""
        req = seq.request
        if draft is None or req.sampling.greedy:
            token = self._host(seq, row, None)
            return token, token == draft
        s = req.sampler
        try:
            ids, probs = target_distribution(s, row.float())
        except ValueError as e:
            raise EngineError(f"cannot sample from the model's logits: {e}") from e
        return accept_draft(ids, probs, draft, s.next_uniform(), s.next_uniform)

    def _host(self, seq: Sequence, row: torch.Tensor, u: float | None) -> int:
        """The request's Sampler on one row (on the row's device; a logits processor gets a
        host copy). ``u``: the draw the device path already took for this row (every sampled
        step takes one), else None (the sampler takes its next)."""
        req = seq.request
        processed = row.float()
        if req.logits_processors:
            processed = processed.cpu()
            for proc in req.logits_processors:
                processed = proc(req.output_ids, processed)
        try:
            return req.sampler.sample(processed, u=u)
        except ValueError as e:  # the request's sampling was checked: the logits are at fault
            raise EngineError(f"cannot sample from the model's logits: {e}") from e
