"""The device side of the batch's sampling: the static inputs and outputs of
``deimos.kernels.triton.sample_batch.sample_rows`` for a fixed number of rows, filled from the
sequences' requests before a step and read after it.

Per row: the request's settings, its draw u (the request's ``Sampler.next_uniform``: every
sampled step takes one, whichever path samples it) and its penalty window as (id, count) pairs
(at most ``PENALTY_WIDTH`` distinct ids; a row with more is left to the host), and for a
grammar's row its allowed tokens as bit words (``Constrained.mask_words``, read by the
sampler's window kernel: its choice is then the device's, exact, as any other row's;
a row with another logits processor is left to the host). Padding rows are greedy with no
penalties. One host-to-device copy before a step (a pinned buffer laid out as the device's,
``packed_views``), two when a row has a mask; the
kernels (captured in the decode graph) leave ids and flags in a device buffer, and ``fetch``,
after the replay, copies them into one of ``RING`` pinned slots with an event: a step's
choices can be read while the next step, launched already, runs and overwrites the device
buffer.
"""

from __future__ import annotations

import numpy as np
import torch

from deimos.engine.request import masks_only
from deimos.kernels.sample_batch import PENALTY_WIDTH
from deimos.kernels.token_mask import n_words
from deimos.kernels.triton.sample_batch import EXACT, HOST, SampleScratch, SamplingRows, sample_rows

RING = 4  # pinned output slots: more than the steps ever in flight


def packed_views(parts: list[tuple[str, torch.dtype, tuple[int, ...]]], device: torch.device,
                 pin: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One zeroed byte buffer on ``device`` (pinned on the host with ``pin``) holding every
    part ``(name, dtype, shape)`` at an offset aligned to 8 bytes: (the buffer, the parts'
    views by name). Two calls with the same parts lay them out alike, so one copy of the
    whole buffer moves every part."""
    offsets, end = [], 0
    for _, dtype, shape in parts:
        offsets.append(end)
        n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        end += -(-n // 8) * 8
    buf = torch.zeros(max(end, 8), dtype=torch.uint8, device=device, pin_memory=pin)
    views = {}
    for (name, dtype, shape), off in zip(parts, offsets):
        n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        views[name] = buf[off:off + n].view(dtype).view(shape)
    return buf, views


class DeviceRows:
    def __init__(self, rows: int, n_vocab: int, device: torch.device, width: int = PENALTY_WIDTH):
        self.n_rows = rows
        self.width = width
        dev = torch.device(device)
        # the per-row inputs: views of one device buffer, filled from a pinned buffer of the
        # same layout by one copy a step
        parts = [("f64", torch.float64, (4, rows)),  # temperature, top_p, min_p, u
                 ("pen_ids", torch.int64, (rows, width)),
                 ("f32", torch.float32, (3, rows)),  # repeat, frequency, presence
                 ("top_k", torch.int32, (rows,)),
                 ("masked", torch.int32, (rows,)),  # which rows read an allowed-token mask
                 ("counts", torch.int32, (rows, width))]  # fmt: skip
        self._dev, d = packed_views(parts, dev)
        self._host, h = packed_views(parts, torch.device("cpu"), pin=True)
        self.rows = SamplingRows(d["f64"][0], d["top_k"], d["f64"][1], d["f64"][2],
                                 d["f32"][0], d["f32"][1], d["f32"][2], d["f64"][3],
                                 d["pen_ids"], d["counts"])  # fmt: skip
        self._masked = d["masked"]
        self._hn = [h[k].numpy() for k in ("f64", "f32", "counts", "pen_ids")]
        self._hkn = h["top_k"].numpy()
        self._hmn = h["masked"].numpy()
        pin = dict(pin_memory=True)
        self.ids = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.flags = torch.zeros(rows, dtype=torch.int32, device=dev)
        self._ring = [torch.zeros(2 * rows, dtype=torch.int64, device="cpu", **pin) for _ in range(RING)]
        self._ring_n = [t.numpy() for t in self._ring]
        self._ring_done = [torch.cuda.Event() for _ in range(RING)]
        self._ring_meta: list[tuple[list[float], set[int]] | None] = [None] * RING
        self._fetched = 0
        self._out_dev = torch.zeros(2 * rows, dtype=torch.int64, device=dev)
        self._copied = torch.cuda.Event()
        self._copied.record()
        # allowed-token masks (a grammar's rows, ``Constrained.mask_words``): bit words, and
        # which rows have one (sample_rows reads them)
        self._words = torch.zeros((rows, n_words(n_vocab)), dtype=torch.int32, device=dev)
        self._hw = torch.zeros_like(self._words, device="cpu", **pin)
        self._hwn = self._hw.numpy().view(np.uint32)
        self.scratch = SampleScratch(rows, n_vocab, width, dev)
        self.loaded = False
        self._us: list[float] = []
        self._host_rows: set[int] = set()
        self.mask_errors: dict[int, BaseException] = {}  # the last load's failed masks, by row

    def load(self, wanting, passengers: frozenset[int] = frozenset()) -> None:
        """Fill the inputs for the sequences ``wanting`` (rows 0..len-1; the rest padding).
        ``passengers``: rows whose outputs are not read: greedy, and no draw taken from their
        request's stream (a seed's tokens stay those of the unchained steps)."""
        self._copied.synchronize()  # the last copies out of the pinned buffers are done
        f64, f32, cnt, ids = self._hn
        f64[:] = 0.0
        f32[:] = 1.0
        f32[1:] = 0.0
        cnt[:] = 0
        ids[:] = 0
        topk = self._hkn
        topk[:] = 0
        masked = self._hmn
        masked[:] = 0
        self._us = []
        self._host_rows = set()
        self.mask_errors = {}
        for i, seq in enumerate(wanting):
            if i in passengers:
                self._us.append(0.0)
                continue
            req = seq.request
            if req.logits_processors and not self._mask(req, i):
                self._host_rows.add(i)
            p = req.sampling
            s = req.sampler
            u = s.next_uniform()
            self._us.append(u)
            f64[0, i] = p.temperature
            f64[1, i] = p.top_p
            f64[2, i] = p.min_p
            f64[3, i] = u
            topk[i] = p.top_k
            if p.penalties_enabled:
                window = s.penalty_counts()
                if len(window) > self.width:
                    self._host_rows.add(i)
                    continue
                f32[0, i] = p.repetition_penalty
                f32[1, i] = p.frequency_penalty
                f32[2, i] = p.presence_penalty
                for j, (tok, c) in enumerate(window.items()):
                    ids[i, j] = tok
                    cnt[i, j] = c
        self._dev.copy_(self._host, non_blocking=True)
        if masked.any():
            last = int(np.flatnonzero(masked)[-1]) + 1
            self._words[:last].copy_(self._hw[:last], non_blocking=True)
        self._copied.record()
        self.loaded = True

    def _mask(self, req, i: int) -> bool:
        """Row ``i``'s allowed tokens from its processors' ``mask_words`` (each a grammar's,
        ANDed), to be applied on the device; False leaves the row to the host (a processor
        that only transforms logits: logit_bias; logprobs asked for, which report the logits
        before processing; or a processor that failed here: the host path raises it again)."""
        procs = req.logits_processors
        if req.top_logprobs is not None or not masks_only(procs):
            return False
        words = self._hwn[i]
        try:
            procs[0].mask_words(req.output_ids, words)
            for p in procs[1:]:
                more = np.empty_like(words)
                p.mask_words(req.output_ids, more)
                words &= more
        except Exception as e:  # noqa: BLE001 - reported by the host path, in the request's error
            self.mask_errors[i] = e
            return False
        self._hmn[i] = 1
        return True

    def run(self, logits: torch.Tensor) -> torch.Tensor:
        """The batch's sampling on ``logits`` [n, V], n <= rows (a decode graph: n = rows)."""
        n = min(logits.shape[0], self.n_rows)
        rows = SamplingRows(*(t[:n] for t in self.rows)) if n < self.n_rows else self.rows
        sample_rows(logits[:n], rows, self.ids[:n], self.flags[:n], self.scratch, self._words,
                    self._masked)
        self._out_dev[:n].copy_(self.ids[:n])
        self._out_dev[self.n_rows : self.n_rows + n].copy_(self.flags[:n])
        return self.ids

    def fetch(self) -> int:
        """After the step ran (was enqueued): copy its choices out; a ticket for ``read``."""
        slot = self._fetched % RING
        self._ring[slot].copy_(self._out_dev, non_blocking=True)
        self._ring_done[slot].record()
        self._ring_meta[slot] = (self._us, self._host_rows)
        self.loaded = False
        self._fetched += 1
        return self._fetched - 1

    def read(self, ticket: int, n: int) -> tuple[list[int], list[int], list[float]]:
        """The ids, flags and draws of the first ``n`` rows of the step of ``ticket`` (waits
        for that step only)."""
        if not self._fetched - RING < ticket < self._fetched:
            raise RuntimeError(f"DeviceRows: ticket {ticket} is not among the last {RING} steps")
        slot = ticket % RING
        self._ring_done[slot].synchronize()
        out = self._ring_n[slot]
        ids = out[:n].tolist()
        flags = out[self.n_rows : self.n_rows + n].tolist()
        us, host_rows = self._ring_meta[slot]
        for i in host_rows:
            if i < n and flags[i] == EXACT:
                flags[i] = HOST
        return ids, flags, us[:n]
