"""Forward steps as CUDA graphs: a model step of a fixed shape over the paged KV pool, captured
once and replayed.

- decode buckets: B sequences of one token each (B in DECODE_BUCKETS up to the engine's
  ``max_seqs``; a batch is padded up to the next bucket), the batch's sampling captured in the
  same graph (deimos.kernels.triton.sample_batch) so a replay hands back token ids;
- prefill buckets: one sequence's prompt chunk padded up to 16, 32, ... 512 tokens, the logits
  of its last real token;
- verify buckets (speculative decoding): one sequence's last token and its drafts padded up to
  VERIFY_BUCKETS rows, the logits of every row (rows past the real ones repeat the last). Without them a short prefill is bound by the host: ~700 kernel
  launches for a 0.6B model at ~35 us of Python each (measured on the H200), against ~4 ms of
  GPU work.

A graph reads everything that changes between replays from static device tensors filled from
pinned host buffers before each replay (two small copies: int64 and int32 inputs); every
intermediate lives in the graphs' shared memory pool (they never run at once), so a replay
allocates nothing and makes no host synchronisation. Nothing in a step depends on host values
(deimos.models.gpu.ops), so a graph is captured once per shape and never patched.

Padding: a padded decode row has token 0 at position 0 with an all-zero block table, so it
reads and writes only the pool's scratch block 0; a prefill chunk's padding tokens are stored
at scratch slots too, and a hybrid's recurrent layers skip them (the token offsets end at the
real rows). Their outputs are never read.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from deimos.kernels.triton.step_feed import decode_slots
from deimos.kernels.triton.step_feed import feed as feed_step
from deimos.models.batch import Batch, SeqLayout
from deimos.models.blocks import DecoderModel

DECODE_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128)
PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512)
VERIFY_BUCKETS = (8, 17)  # a verification's rows: 1 + drafts (up to speculate.K_LIMIT = 16)


class StepGraph:
    """A step of ``n_seqs`` sequences and ``n_tokens`` tokens: decode (every sequence one
    token, ``n_seqs == n_tokens``) or one prefill chunk (``n_seqs == 1``), the logits of
    ``n_logits`` rows (default: one a sequence; a verification's chunk: every row).

    Inputs (``load``): int64 tokens, positions, slots [n_tokens] and logits rows [n_logits];
    int32 block tables [n_seqs, max_blocks], first positions [n_seqs], token offsets
    [n_seqs + 1]. ``after(logits)`` (optional) is captured after the model step, e.g. the
    batch's sampling; its buffers are the caller's. In a decode graph, when ``after`` returns
    the chosen ids (int64 [n_seqs]), the graph also writes them as its own next tokens and
    advances its positions, and it computes its slots from the tables and positions on the
    device: a ``replay(chained=True)`` then feeds the previous replay's choices without the
    host knowing them (only the tables are copied in)."""

    def __init__(self, model: DecoderModel, pool, n_tokens: int, n_seqs: int, max_blocks: int,
                 after: Callable[[torch.Tensor], None] | None = None, mempool: tuple | None = None,
                 warmup: int = 2, tile_map: torch.Tensor | None = None,
                 n_logits: int | None = None) -> None:
        device = model.device
        if device.type != "cuda":
            raise ValueError(f"StepGraph: the model is on {device}, CUDA graphs need a CUDA device")
        self.model = model
        self.pool = pool
        self.n_tokens, self.n_seqs, self.max_blocks = n_tokens, n_seqs, max_blocks
        self.decode = n_seqs == n_tokens
        self.n_logits = n_seqs if n_logits is None else n_logits
        if self.decode and self.n_logits != n_seqs:
            raise ValueError("StepGraph: a decode graph has one logits row a sequence")
        self.after = after
        self.mempool = mempool
        self.warmup = warmup
        n, b = n_tokens, n_seqs
        self._i64 = torch.zeros(3 * n + self.n_logits, dtype=torch.long, device=device)
        self._i32 = torch.zeros(b * max_blocks + b + b + 1, dtype=torch.int32, device=device)
        self._h64 = torch.zeros_like(self._i64, device="cpu").pin_memory()
        self._h32 = torch.zeros_like(self._i32, device="cpu").pin_memory()
        self._h64n, self._h32n = self._h64.numpy(), self._h32.numpy()
        self._copied = torch.cuda.Event()
        self._copied.record()
        d64, d32 = self._i64, self._i32
        self.tokens, self.positions, self.slots = d64[:n], d64[n : 2 * n], d64[2 * n : 3 * n]
        self.logits_at = d64[3 * n :]
        tb = b * max_blocks
        self.tables = d32[:tb].view(b, max_blocks)
        self.q_start, self.cu_q = d32[tb : tb + b], d32[tb + b :]
        self.tile_map = tile_map
        self.layout = SeqLayout([1] * b if self.decode else [n], [0] * b, b if self.decode else 0,
                                self.slots, self.tables, self.q_start, self.cu_q, tile_map)
        self._graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.chainable = False
        self.replays = 0

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def host_buffers(self) -> tuple[np.ndarray, np.ndarray]:
        """The pinned host inputs to fill (after ``wait_host``) before ``replay``:
        (int64 [tokens | positions | slots | logits rows], int32 [tables | q_start | cu_q])."""
        self._copied.synchronize()  # the previous copies out of them are done
        return self._h64n, self._h32n

    def _upload(self) -> None:
        self._i64.copy_(self._h64, non_blocking=True)
        self._i32.copy_(self._h32, non_blocking=True)
        self._copied.record()

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture with the inputs loaded now (padding-like: every slot scratch)."""
        if self._graph is not None:
            return
        h64, h32 = self.host_buffers()
        h64[:] = 0
        h32[:] = 0
        n, b = self.n_tokens, self.n_seqs
        if self.decode:
            h32[b * self.max_blocks + b :] = np.arange(b + 1, dtype=np.int32)
            h64[3 * n :] = np.arange(b)
        else:
            h64[n : 2 * n] = np.arange(n)
            h64[2 * n : 3 * n] = np.arange(n) % self.pool.block_size  # scratch slots
            h32[-1] = n
            h64[3 * n :] = np.minimum(np.arange(self.n_logits), n - 1) if self.n_logits > 1 else n - 1
        self._upload()
        batch = Batch(self.tokens, self.positions, self.pool, self.layout, self.logits_at)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compiles the kernels, settles the allocator
            for _ in range(self.warmup):
                self._body(batch, feed=False)
        torch.cuda.current_stream().wait_stream(side)
        self._upload()  # the warm-up fed itself: start the capture from the loaded inputs
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            self.logits = self._body(batch, feed=True)
        self._graph = graph

    def _body(self, batch: Batch, feed: bool) -> torch.Tensor:
        if self.decode:  # slots from the tables at the (possibly device-fed) positions
            decode_slots(self.tables, self.positions, self.pool.block_size, self.slots)
        logits = self.model.step(batch)
        ids = self.after(logits) if self.after is not None else None
        if self.decode and ids is not None and feed:
            feed_step(ids, self.tokens, self.positions)
        self.chainable = self.decode and ids is not None
        return logits

    def replay(self, chained: bool = False,
               overrides: tuple[tuple[int, int, int], ...] = ()) -> torch.Tensor:
        """Copies the host inputs in and replays; the logits [n_logits, V] (static).
        ``chained``: the tokens and positions are the previous replay's own (only the int32
        inputs, the tables, are copied in), except the rows of ``overrides`` (row, token,
        position): those are set on the device, after the previous replay's feed."""
        if self._graph is None:
            raise RuntimeError("StepGraph.replay before capture")
        if chained:
            if not self.chainable:
                raise RuntimeError("StepGraph: this graph does not feed itself")
            self._i32.copy_(self._h32, non_blocking=True)
            self._copied.record()
            for row, token, position in overrides:  # fills: scalars ride in the launches
                self.tokens[row].fill_(token)
                self.positions[row].fill_(position)
        else:
            self._upload()
        self._graph.replay()
        self.replays += 1
        return self.logits
