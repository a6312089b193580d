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

The draw u of each row comes from its request's ``Sampler`` (a counter-based stream of its seed),
so a seed gives the same tokens on every path and device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deimos.engine.request import EngineError
from deimos.engine.sequence import Sequence
from deimos.kernels.sampling import logprobs


def _host_only(seq: Sequence) -> bool:
    return bool(seq.request.logits_processors)


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

    # ---- graph capture and replay -------------------------------------------------------

    def graph_hook(self, rows: int) -> Callable[[torch.Tensor], None] | None:
        """What a decode graph of ``rows`` rows captures after the model step."""
        if self._device_rows is None:
            return None
        state = self._device_rows(rows, self.n_vocab, self.device)
        self._graph_state[rows] = state
        return state.run

    def prepare(self, rows: int, wanting: list[Sequence]) -> None:
        """Before a decode graph of ``rows`` rows replays: its rows' settings and draws."""
        state = self._graph_state.get(rows)
        if state is not None:
            state.load(wanting)

    def launched(self, rows: int) -> int | None:
        """After a decode graph of ``rows`` rows was replayed: the ticket of its choices."""
        state = self._graph_state.get(rows)
        return state.fetch() if state is not None and state.loaded else None

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
        out: list[tuple[int | None, BaseException | None]] = []
        for i, seq in enumerate(wanting):
            req = seq.request
            try:
                if device_ids is not None and not _host_only(seq) and flags[i] == 0:
                    token = device_ids[i]
                elif device_ids is not None and flags[i] == 2:
                    raise EngineError("cannot sample from the model's logits: logits contain NaN")
                else:
                    token = self._host(seq, logits[i], None if us is None else us[i])
                if req.top_logprobs is not None:
                    req.token_logprobs.append(logprobs(logits[i].float(), token, req.top_logprobs))
                out.append((token, None))
            except EngineError as e:
                out.append((None, e))
        return out

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
