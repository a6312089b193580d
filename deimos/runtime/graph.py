"""Forward steps as CUDA graphs: a model's step of a fixed number of tokens over one KV
cache, captured once and replayed.

- ``DecodeGraph``: the one-token decode step, replayed every generated token.
- ``PrefillGraphs``: prompt chunks, padded up to a bucket length (16, 32, ... 512), one graph
  per bucket, captured the first time a chunk needs it; the logits are taken at the last real
  token. Without them a short prefill is bound by the host: ~700 kernel launches for a 0.6B
  model at ~35 us of Python each (measured on the H200), against ~4 ms of GPU work.

A graph reads its tokens, positions (and the row whose logits are wanted) from static device
tensors filled from one pinned host buffer before each replay (one small copy); every
intermediate lives in the graph's private memory pool, so a replay allocates nothing and
makes no host synchronisation: the caller syncs once, when it reads the sampled token.
Nothing in a step depends on its position on the host (deimos.models.gpu.ops: cache rows
written at the device positions, attention bounded by positions read on the device), so a
graph is captured once per (model, cache, length) and never patched or re-captured.
Padding tokens of a prefill chunk write cache rows past the chunk, which later steps
overwrite before anything reads them; a chunk is padded only while the cache has the room.

The decode graph ends with the greedy choice on the device (kernels/triton/greedy.py): its
argmax becomes the next replay's token and the position advances, so a greedy request runs
as replays enqueued one after another while the host reads each token a step behind
(``DecodeGraph.start_chain`` / ``launch_chained`` / ``chained_token``; engine/generator.py).

The cache's host bookkeeping (``begin``/``commit``) stays outside the graphs, here. The
graphs of one generator share one memory pool: they run one at a time, and each keeps only
its logits alive between replays, so the pool holds the largest step's intermediates once.
"""

from __future__ import annotations

import numpy as np
import torch

from deimos.models.batch import Batch
from deimos.models.blocks import DecoderModel
from deimos.runtime.kv_cache import KVCache

PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512)


class StepGraph:
    """One step of exactly ``n`` tokens (the real ones first, then padding)."""

    def __init__(self, model: DecoderModel, kv: KVCache, n: int, warmup: int = 2,
                 pool: tuple | None = None):
        device = model.device
        if device.type != "cuda":
            raise ValueError(f"StepGraph: the model is on {device}, CUDA graphs need a CUDA device")
        self.model = model
        self.kv = kv
        self.n = n
        self.warmup = warmup
        # tokens, positions and the logits row: views of one device buffer, one copy a step
        self._dev = torch.zeros(2 * n + 1, dtype=torch.long, device=device)
        self.tokens = self._dev[:n]
        self.positions = self._dev[n : 2 * n]
        self.logits_at = self._dev[2 * n :] if n > 1 else None
        self._host = torch.zeros(2 * n + 1, dtype=torch.long).pin_memory()
        self._host_np = self._host.numpy()  # numpy writes: no torch op on the host per step
        self._offsets = np.arange(n, dtype=np.int64)
        self._copied = torch.cuda.Event()  # the last copies out of _host are done
        self._graph: torch.cuda.CUDAGraph | None = None
        self._logits: torch.Tensor | None = None
        self.pool = pool  # a memory pool shared with graphs that never run at the same time
        self.replays = 0

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def fits(self, start: int) -> bool:
        return start + self.n <= self.kv.capacity

    def _load(self, tokens: list[int], start: int) -> None:
        n, h = self.n, self._host
        self._copied.synchronize()  # the previous copies may still read the pinned buffer
        a = self._host_np
        a[: len(tokens)] = tokens
        a[len(tokens) : n] = 0
        a[n : 2 * n] = self._offsets + start
        a[2 * n] = len(tokens) - 1
        self._dev.copy_(h, non_blocking=True)
        self._copied.record()

    @torch.inference_mode()
    def _capture(self) -> None:
        # warm-up and capture write this step's rows at the positions loaded now, which are
        # free (at and past the cache's length): nothing valid is overwritten
        batch = Batch(self.tokens, self.positions, self.kv, self.logits_at)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compiles the kernels, settles the allocator
            for _ in range(self.warmup):
                logits = self.model.step(batch, self.kv.length)[0]
                self._after_step(logits, self._dev.clone())
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self._logits = self.model.step(batch, self.kv.length)[0]
            self._after_step(self._logits, self._dev)
        self._graph = graph

    def _after_step(self, logits: torch.Tensor, feed: torch.Tensor) -> None:
        """What a subclass adds to the captured step after the logits (``feed``: the step's
        own input buffer); the warm-up calls it on a scratch copy of the inputs."""

    def capture(self) -> None:
        """Capture now (at the cache's current length, whose rows are free) instead of at
        the first run; nothing is committed."""
        if self._graph is None:
            if not self.fits(self.kv.length):
                raise ValueError(f"StepGraph: no room to capture {self.n} rows")
            self._load([0] * self.n, self.kv.length)
            self._capture()

    def run(self, tokens: list[int]) -> torch.Tensor:
        """Runs ``tokens`` (1..n of them) at the cache's next positions and commits them;
        returns the logits float32 ``[n_vocab]`` of the last one on the device (a static
        tensor: valid until this graph's next replay)."""
        if not 1 <= len(tokens) <= self.n:
            raise ValueError(f"StepGraph: {len(tokens)} tokens for a graph of {self.n}")
        start = self.kv.begin(self.positions[: len(tokens)])  # the room check (no sync)
        if not self.fits(start):
            raise ValueError(f"StepGraph: {self.n} rows from {start} pass the cache's {self.kv.capacity}")
        self._load(tokens, start)
        if self._graph is None:
            self._capture()
        self._graph.replay()
        self.replays += 1
        self.kv.commit(len(tokens))
        return self._logits


class DecodeGraph(StepGraph):
    """The one-token step. It ends with the greedy choice on the device (greedy.py): the
    argmax is written as the next replay's token and the position advanced, so greedy
    decoding can run as a chain of replays (``start_chain``, ``launch_chained``,
    ``chained_token``) with the host reading each token while the next step runs. A plain
    ``step`` loads its token and position from the host as before (the chain's writes are
    overwritten); the greedy kernel costs it a few microseconds."""

    RING = 4  # pinned slots for chained tokens: more than the steps ever in flight

    def __init__(self, model: DecoderModel, kv: KVCache, warmup: int = 2, pool: tuple | None = None):
        super().__init__(model, kv, 1, warmup, pool)
        # imported here: defining the Triton kernels reads TRITON_INTERPRET, which a process
        # that only imports this module (CPU tests) must not have fixed yet
        from deimos.kernels.triton.greedy import GreedyState, greedy_next

        self._greedy_next = greedy_next
        device = model.device
        self._greedy = GreedyState(model.config.n_vocab, device)
        self._token = torch.zeros(1, dtype=torch.long, device=device)
        self._ring = torch.zeros(self.RING, dtype=torch.long).pin_memory()
        self._ring_np = self._ring.numpy()
        self._ring_slots = [self._ring[i : i + 1] for i in range(self.RING)]  # copy targets
        self._ring_done = [torch.cuda.Event() for _ in range(self.RING)]
        self._launched = 0

    def _after_step(self, logits: torch.Tensor, feed: torch.Tensor) -> None:
        self._greedy_next(logits, self._greedy, self._token, feed)

    def step(self, token: int) -> torch.Tensor:
        """``token`` at the cache's next position, committed; its logits ``[n_vocab]``."""
        return self.run([token])

    def start_chain(self, token: int) -> None:
        """The next ``launch_chained`` feeds ``token`` at the cache's next position; each one
        after it feeds the greedy choice of the one before."""
        self._load([token], self.kv.begin(self.positions))  # the room check
        if self._graph is None:
            self._capture()

    def launch_chained(self) -> int:
        """Enqueue one step of the chain (no host synchronisation) and commit its cache row;
        returns the ticket that ``chained_token`` reads its greedy choice with."""
        self.kv.begin(self.positions)  # the room check (device positions: no sync)
        self._graph.replay()
        self.replays += 1
        self.kv.commit(1)
        slot = self._launched % self.RING
        self._ring_slots[slot].copy_(self._token, non_blocking=True)
        self._ring_done[slot].record()
        self._launched += 1
        return self._launched - 1

    def chained_token(self, ticket: int) -> int:
        """The greedy token the step of ``ticket`` chose (waits for that step only). At most
        RING - 1 later steps may have been launched since."""
        if not self._launched - self.RING < ticket < self._launched:
            raise ValueError(f"DecodeGraph: ticket {ticket} is not among the last {self.RING} steps")
        slot = ticket % self.RING
        self._ring_done[slot].synchronize()
        token = int(self._ring_np[slot])
        if token < 0:
            raise ValueError("logits contain NaN")
        return token


class PrefillGraphs:
    """Prompt chunks through the smallest bucket graph that holds them."""

    def __init__(self, model: DecoderModel, kv: KVCache, buckets: tuple[int, ...] = PREFILL_BUCKETS,
                 pool: tuple | None = None):
        self.model = model
        self.kv = kv
        self.graphs = {n: StepGraph(model, kv, n, pool=pool) for n in buckets}

    def capture_all(self, progress=None) -> None:
        """Every bucket now (the cache must have the room): the graphs' memory is then
        taken once, before the first request, and no request pays a capture.
        ``progress(label)`` is called before each capture."""
        for n, graph in sorted(self.graphs.items()):
            if progress is not None:
                progress(f"prefill graph {n}")
            if graph.fits(self.kv.length):  # a bucket longer than the context is never used
                graph.capture()

    @property
    def max_tokens(self) -> int:
        return max(self.graphs)

    def run(self, tokens: list[int]) -> torch.Tensor | None:
        """The chunk's last logits, or None when no bucket holds it within the cache's room
        (the caller runs it eagerly)."""
        for n in sorted(self.graphs):
            if len(tokens) <= n:
                graph = self.graphs[n]
                return graph.run(tokens) if graph.fits(self.kv.length) else None
        return None
