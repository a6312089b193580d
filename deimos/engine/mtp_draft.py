"""MTP drafting: speculative decoding's drafts from the model's own MTP ("nextn") layers
(qwen35, qwen35moe, qwen3next files that carry them; deimos.models.mtp).

The MTP head predicts the token after next from the main model's post-norm hidden row and the
token just chosen. Its cache position p holds the row (x_p, h_{p-1}) (h_{-1} = 0), so for a
sequence whose last token x_e is not yet computed by the main model:
- the engine hands the drafter the main model's hidden rows of every step (``observe``: the
  rows of positions start .. start + n - 1; the runner computes them when ``wants_hidden``);
- ``propose`` catches the head's cache up on positions it lacks (tokens x_p with h_{p-1}, only
  rows the main model computed for the sequence's own tokens: those past ``n_computed`` belong to
  rejected drafts), then drafts: (x_e, h_{e-1}) gives d_1 and h'; (d_1, h') gives d_2; and so
  on, greedily; the draft rows are forgotten afterwards (the cache is truncated back to e).
A sequence admitted on a cached prefix (the prefix cache) has no hidden rows for it: the
drafter computes them once, with the main model on a cache of its own (``_fill``). The head's
cache and the hidden rows are per sequence (``MTPDraft`` in ``seq.spec.drafter``). On the GPU
the steps that give hidden rows run eagerly (deimos.engine.runner: no CUDA graph returns them
yet), and so does the head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from deimos.models.deltanet import HybridKV, RecurrentState
from deimos.models.mtp import MTPState
from deimos.runtime.kv_cache import KVCache

if TYPE_CHECKING:
    from deimos.engine.sequence import Sequence
    from deimos.models.blocks import DecoderModel

CHUNK = 512  # rows the head's catch-up (and a cached prefix's fill) computes at once


@dataclass(slots=True)
class MTPDraft:
    """One sequence's MTP drafting: ``state``, the head's cache (rows of positions 0 ..
    state.length - 1); ``hidden`` [capacity, D] float32, the main model's post-norm rows by
    position, valid for positions 0 .. ``known`` - 1."""

    state: MTPState
    hidden: torch.Tensor
    known: int = 0


class MTPDrafter:
    """Greedy drafts from MTP layer ``head`` of ``model`` (deimos.engine.speculate's Drafter)."""

    wants_hidden = True  # the runner returns each step's hidden rows (``observe``)

    def __init__(self, model: DecoderModel, n_ctx: int, k_max: int, head: int = 0) -> None:
        cfg = model.config
        if not cfg.n_mtp_layers:
            raise ValueError(f"speculative method mtp needs MTP (nextn) layers: this {cfg.arch} "
                             "file has none ('nextn_predict_layers' is 0 or absent)")
        load = getattr(model, "load_mtp", None)
        if load is None:
            raise ValueError(f"speculative method mtp: this {cfg.arch} model has no MTP head")
        load()  # the kernel path builds the MTP layers now (their weights to the device)
        self.model = model
        self.capacity = n_ctx + k_max + 1
        self.head = head

    def _draft(self, seq: Sequence) -> MTPDraft:
        st = seq.spec.drafter
        if st is None:
            cfg = self.model.config
            st = seq.spec.drafter = MTPDraft(
                self.model.mtp.new_state(self.capacity, self.head),
                torch.zeros(self.capacity, cfg.n_embd, dtype=torch.float32, device=self.model.device))
        return st

    def observe(self, seq: Sequence, start: int, rows: torch.Tensor) -> None:
        """The main model's hidden rows [n, D] of ``seq``'s positions start .. start + n - 1
        (rows past what the sequence keeps are overwritten when those positions run again)."""
        if seq.spec is None:
            return
        st = self._draft(seq)
        if start > st.known:  # the sequence started on a cached prefix: its rows, once
            self._fill(seq, st, start)
        n = rows.shape[0]
        st.hidden[start : start + n] = rows.float()
        st.known = start + n

    def propose(self, seq: Sequence, k: int) -> list[int]:
        st = self._draft(seq)
        e = len(seq.tokens) - 1  # the last token's position (the main model has not run it)
        if min(st.known, seq.n_computed) < e:  # no hidden row of e - 1 (not seen: no guess)
            return []
        mtp = self.model.mtp
        state = st.state
        if state.length > e:  # rows of positions that may since hold other tokens
            state.truncate(e)
        with torch.inference_mode():
            while state.length < e:  # catch up: (x_p, h_{p-1}) for p = length .. e - 1
                a = state.length
                b = min(e, a + CHUNK)
                hid = st.hidden[max(a - 1, 0) : b - 1]
                if a == 0:
                    hid = torch.cat((torch.zeros_like(st.hidden[:1]), hid))
                mtp.forward(state, torch.tensor(seq.tokens[a:b], device=self.model.device), hid)
            tok, h, drafts = seq.tokens[e], st.hidden[e - 1], []
            for _ in range(k):
                out = mtp.draft(h, tok, state)
                tok, h = int(torch.argmax(out.logits)), out.hidden
                drafts.append(tok)
        state.truncate(e)
        return drafts

    def _fill(self, seq: Sequence, st: MTPDraft, end: int) -> None:
        """The main model's hidden rows of positions 0 .. end - 1, computed on a cache of its
        own (the engine computed none of them: a cached prefix)."""
        cfg, dev = self.model.config, self.model.device
        kv, rec = KVCache(cfg, end, device=dev), RecurrentState.zeros(cfg, dev)
        with torch.inference_mode():
            for a in range(0, end, CHUNK):
                b = min(end, a + CHUNK)
                batch = kv.batch(torch.tensor(seq.tokens[a:b], device=dev),
                                 torch.tensor([b - a - 1], device=dev))
                batch.kv = HybridKV(batch.kv, [rec])
                _, rows = self.model.step(batch, hidden_at=torch.arange(b - a, device=dev))
                kv.commit(b - a)
                st.hidden[a:b] = rows
        st.known = end

    def release(self, seq: Sequence) -> None:
        if seq.spec is not None:
            seq.spec.drafter = None
