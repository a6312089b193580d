"""The model runner: a scheduler's plan in, the logits of the sequences that need a token out.

It owns what a step needs on the device: the KV pool, the CUDA graphs (one per decode batch
bucket and per prefill chunk bucket, sharing one memory pool) and their static inputs. It sees
sequences only through their tokens, positions and block tables; which sequence runs when is
the scheduler's business, what is done with the logits the engine's.

A step packs the plan's decode sequences first (one token each), then its prefill chunks. It
replays a graph when the step has a graph's shape (decode only, up to the largest bucket; one
prefill chunk of at most 512 tokens) and runs the model eagerly otherwise (the CPU reference
always). Logits are computed only for the sequences whose step reaches the end of their
tokens (a decode, or a prompt's last chunk), and at every row of a sequence verifying drafts
(speculative decoding, deimos.engine.speculate: its last token and its drafts, packed after the
decodes like a prefill chunk; such a step runs eagerly, or on a verify graph when it verifies
one sequence and nothing else, an agent's usual step): those rows follow the others'.

A hybrid model on the kernel path keeps its recurrent states in a state pool (the engine's,
deimos.runtime.state_pool): a running sequence holds a slot from its first step (``_bind``:
zeros, or the snapshot it was admitted with) until it leaves (``release``). Steps read the rows'
slots on the device, so its decode and prefill steps replay graphs too. A padded prefill
chunk's recurrent layers see only its real rows (the graph's token offsets end at them: the
kernels' sequence is those rows, the padding advances no state); off the state pool (each
sequence's own states) its steps run eagerly. A prefill chunk with a snapshot row (the plan's
``snap_at``: a block boundary inside it) stores its state there into one of the pool's
snapshot slots in the same step (a prefill graph reads its row count and slot from the device
too), copied out after the step (``StepResult.snaps``); the CPU reference hands back copies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from deimos.engine.scheduler import StepPlan
from deimos.engine.sequence import Sequence
from deimos.models.batch import Batch, SeqLayout
from deimos.models.blocks import DecoderModel
from deimos.models.deltanet import HybridKV, RecurrentState, StateError
from deimos.runtime.graph import PREFILL_BUCKETS
from deimos.runtime.kv_pool import KVPool
from deimos.runtime.state_pool import SCRATCH_SLOT, SlotState, StatePool, StepSlots, state_pool_for


@dataclass
class StepInputs:
    """A plan's step as host arrays (what graphs copy in, or eager steps wrap)."""

    tokens: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    slots: np.ndarray  # int64 [T]
    tables: np.ndarray  # int32 [B, max_blocks]
    q_lens: list[int]
    q_starts: list[int]
    n_decode: int
    logits_at: np.ndarray  # int64 [N]: the rows of T whose logits are wanted
    wanting: list[Sequence]  # the N sequences those rows belong to, in order
    seqs: list[Sequence] | None = None  # the step's B sequences, in row order
    verify: list[tuple[Sequence, list[int]]] | None = None  # (sequence, drafts): logits rows after N
    snap_at: list[int] | None = None  # [B]: a row's snapshot after that many of its tokens (0: none)


def step_inputs(plan: StepPlan, block_size: int, max_blocks: int) -> StepInputs:
    drafts = {id(s): d for s, d in plan.verify}
    seqs: list[tuple[Sequence, int]] = ([(s, 1) for s in plan.decode]
                                        + [(s, 1 + len(d)) for s, d in plan.verify] + plan.prefill)
    n_tok = sum(n for _, n in seqs)
    tokens = np.empty(n_tok, dtype=np.int64)
    positions = np.empty(n_tok, dtype=np.int64)
    slots = np.empty(n_tok, dtype=np.int64)
    tables = np.zeros((len(seqs), max_blocks), dtype=np.int32)
    q_lens, q_starts, at, wanting, verify_at = [], [], [], [], []
    t = 0
    for b, (seq, n) in enumerate(seqs):
        start = seq.n_computed
        table = seq.table
        tables[b, : len(table)] = table
        if n == 1:  # a decode row: plain Python is faster than numpy for one token
            tokens[t] = seq.tokens[start]
            positions[t] = start
            slots[t] = table[start // block_size] * block_size + start % block_size
        else:
            pos = np.arange(start, start + n, dtype=np.int64)
            d = drafts.get(id(seq))
            tokens[t : t + n] = seq.tokens[start : start + n] if d is None else [seq.tokens[start], *d]
            positions[t : t + n] = pos
            first = start // block_size  # only the blocks the chunk writes, not the whole table
            blk = np.asarray(table[first : (start + n - 1) // block_size + 1], dtype=np.int64)
            slots[t : t + n] = blk[pos // block_size - first] * block_size + pos % block_size
        q_lens.append(n)
        q_starts.append(start)
        if id(seq) in drafts:  # a verification: logits at its last token and every draft
            verify_at.extend(range(t, t + n))
        elif start + n == len(seq.tokens):
            at.append(t + n - 1)
            wanting.append(seq)
        t += n
    snap_at = [plan.snap_at.get(s, 0) for s, _ in seqs] if plan.snap_at else None
    return StepInputs(tokens, positions, slots, tables, q_lens, q_starts, len(plan.decode),
                      np.asarray(at + verify_at, dtype=np.int64), wanting, [s for s, _ in seqs],
                      list(plan.verify), snap_at)


@dataclass
class StepResult:
    logits: torch.Tensor | None  # [N, V] float32 on the device, or None when N == 0
    wanting: list[Sequence]
    graph: object | None = None  # the graph that ran (its captured sampler outputs), or None
    ticket: int | None = None  # the decode graph's sampled choices (BatchSampler.launched)
    verify: list[tuple[Sequence, list[int]]] = field(default_factory=list)  # (sequence, drafts): rows after wanting's
    # with ``ModelRunner.want_hidden``: (sequence, first position, post-norm hidden rows [n, D])
    hidden: list[tuple[Sequence, int, torch.Tensor]] = field(default_factory=list)
    # (sequence, its recurrent state at the snapshot row the plan gave it): the step's snapshots
    snaps: list[tuple[Sequence, object]] = field(default_factory=list)
    # rows of ``wanting`` that rode a chained step with an input their host had not chosen
    # yet (Engine._continue): their rows are not read
    passengers: frozenset[int] = frozenset()
    # rows of ``logits`` copied to the host before a chained step overwrote them
    # (BatchSampler.hold): row -> (host copy, the event that marks it done)
    held: dict[int, tuple[torch.Tensor, object]] = field(default_factory=dict)
    # rows chosen after the launch (BatchSampler.resample): (sampling state, its ticket, row ->
    # its place there), and rows whose mask could not be made there (row -> the error)
    resampled: tuple[object, int, dict[int, int]] | None = None
    resample_errors: dict[int, BaseException] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model: DecoderModel, pool: KVPool, n_ctx: int, max_seqs: int,
                 cuda_graphs: bool = True,
                 decode_after: Callable[[int], Callable[[torch.Tensor], None] | None] | None = None,
                 decode_before: Callable[..., None] | None = None,
                 decode_launched: Callable[[int], int | None] | None = None,
                 states: StatePool | None = None, verify_graphs: bool = False) -> None:
        """``decode_after(B)``: what a decode graph of B rows captures after the model step
        (the batch's sampling), made once per bucket; None: logits only. ``decode_before(B,
        sequences[, passengers])``: called before such a graph replays (the sampling's
        inputs). ``states``: a hybrid model's state pool on the kernel path (default: one of
        ``max_seqs`` slots).
        ``verify_graphs``: graphs for a step that only verifies one sequence's drafts
        (speculative decoding; the models that have prefill graphs)."""
        self.model = model
        self.pool = pool
        self.n_ctx = n_ctx
        self.max_seqs = max_seqs
        self.block_size = pool.block_size
        self.max_blocks = -(-n_ctx // self.block_size)
        self.device = model.device
        self.decode_before = decode_before
        self.decode_launched = decode_launched
        self.last_decode = None  # the graph of the last decode replay
        self.want_hidden = False  # every row's hidden state too (MTP drafting; eager steps only)
        self.decode_graphs: dict[int, object] = {}
        self.prefill_graphs: dict[int, object] = {}
        self.verify_graphs: dict[int, object] = {}
        self.states = states if states is not None else state_pool_for(model, max_seqs)
        self._slots: dict[Sequence, SlotState] = {}  # the running sequences' state slots
        self._graph_slots: dict[object, StepSlots] = {}  # a graph's state slot ids (hybrids)
        self._graph_snaps: dict[object, StepSlots] = {}  # a prefill graph's snapshot rows
        self.use_graphs = (cuda_graphs and self.device.type == "cuda"
                           and model.graph_safe)  # fmt: skip
        if self.use_graphs:
            from deimos.kernels.triton.prefill_attention import prefill_tile_map
            from deimos.runtime.graph import DECODE_BUCKETS, VERIFY_BUCKETS, StepGraph

            mempool = torch.cuda.graph_pool_handle()  # the graphs never run at once
            cfg = model.config
            for b in DECODE_BUCKETS:
                if b > max_seqs:
                    break
                after = decode_after(b) if decode_after is not None else None
                self.decode_graphs[b] = self._graph(model, pool, b, b, after, mempool)
            for n in PREFILL_BUCKETS:
                # an offloaded MoE's chunks wait for the host; a hybrid's read its state slot
                if n > n_ctx or not getattr(model.ops, "prefill_graphs", True) \
                        or (cfg.is_hybrid and self.states is None):
                    break
                tiles = prefill_tile_map([n], cfg.n_head, cfg.n_head_kv, cfg.head_dim, self.device)
                self.prefill_graphs[n] = self._graph(model, pool, n, 1, None, mempool, snapshots=True,
                                                     tile_map=tiles)
            # a hybrid's verification rolls its states back by the rejected drafts: eager steps
            for n in VERIFY_BUCKETS if verify_graphs and self.prefill_graphs and not cfg.is_hybrid else ():
                tiles = prefill_tile_map([n], cfg.n_head, cfg.n_head_kv, cfg.head_dim, self.device)
                self.verify_graphs[n] = StepGraph(model, pool, n, 1, self.max_blocks, None, mempool,
                                                  tile_map=tiles, n_logits=n)

    def _graph(self, model, pool, n_tokens: int, n_seqs: int, after, mempool, snapshots: bool = False,
               **kw):
        """A StepGraph; a hybrid's recurrent layers read its rows' state slots from a
        ``StepSlots`` of its own (``_graph_slots``), loaded before each replay, and with
        ``snapshots`` (a prefill graph) their snapshot rows from another (``_graph_snaps``)."""
        from deimos.runtime.graph import StepGraph

        kv, slots, snap = pool, None, None
        if self.states is not None:
            slots = StepSlots(n_seqs, self.device)
            if snapshots and self.states.snap_slots:
                snap = StepSlots(n_seqs, self.device, width=2)
            kv = HybridKV(pool, [], self.states, slots.dev, snap=None if snap is None else snap.dev)
        graph = StepGraph(model, kv, n_tokens, n_seqs, self.max_blocks, after, mempool, **kw)
        if slots is not None:
            self._graph_slots[graph] = slots
        if snap is not None:
            self._graph_snaps[graph] = snap
        return graph

    def warm(self, progress=None) -> None:
        """Capture every graph now (compiling every kernel): GPU memory is taken once, before
        the first request, and no request pays a capture."""
        for label, graphs in (("prefill graph", self.prefill_graphs), ("decode graph", self.decode_graphs),
                              ("verify graph", self.verify_graphs)):
            for n, g in sorted(graphs.items()):
                if progress is not None:
                    progress(f"{label} {n}")
                g.capture()

    @torch.inference_mode()
    def profile(self, max_batch_tokens: int) -> int:
        """One eager step of the largest shape the scheduler makes (``max_seqs - 1`` decode rows
        beside a prompt chunk filling the token budget, every row's logits), on the scratch
        block: the step's peak memory is reserved by the caching allocator now, at load, so
        that serving does not grow it later (what vLLM's profile run measures). Returns the
        peak bytes allocated during the step (0 off a GPU)."""
        if self.device.type != "cuda":
            return 0
        x = self.profile_inputs(max_batch_tokens)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        self._eager(x)
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - base

    def profile_inputs(self, max_batch_tokens: int) -> StepInputs:
        """The profile step: decode rows at position 0 and prompt chunks of at most a context
        each filling the rest of the budget, all on block 0."""
        n_dec = max(0, min(self.max_seqs - 1, max_batch_tokens - 1))
        left = max(1, max_batch_tokens - n_dec)
        chunks = [min(left - i, self.n_ctx) for i in range(0, left, self.n_ctx)]
        return self.scratch_inputs(n_dec, chunks, [0] * len(chunks))

    def scratch_inputs(self, n_dec: int, chunks: list[int], starts: list[int]) -> StepInputs:
        """A step on the scratch block: ``n_dec`` decode rows at position 0, then prompt chunks
        of ``chunks`` tokens starting at positions ``starts`` (every table all block 0), each
        row's logits wanted."""
        pos = [np.zeros(n_dec, np.int64)] + [np.arange(s, s + c, dtype=np.int64) for c, s in zip(chunks, starts)]
        positions = np.concatenate(pos)
        ends = np.cumsum([1] * n_dec + chunks) - 1
        b = n_dec + len(chunks)
        return StepInputs(np.zeros(len(positions), np.int64), positions, positions % self.block_size,
                          np.zeros((b, self.max_blocks), np.int32), [1] * n_dec + chunks,
                          [0] * n_dec + list(starts), n_dec, ends.astype(np.int64), [])

    def warm_shapes(self, max_batch_tokens: int) -> list[StepInputs]:
        """The eager steps a server's first requests make beyond the graphs and the profile
        step, run once at load so that they compile their kernel variants there (Triton
        specializes on whether a size is a multiple of 16, and the tiles follow the row
        count): a long prompt's first chunk alone (a whole budget) and its next chunk (an odd
        count at an odd position: a cached prefix's continuation), and a chunk beside a few
        decode rows at an odd total; a hybrid's first one with a snapshot row; a short chunk
        beside each count of decode rows whose attention launches another kernel variant (the
        ops' ``eager_decode_rows``). Empty when the context is too short to hold them."""
        n = min(max_batch_tokens, self.n_ctx)
        prefill_max = max(PREFILL_BUCKETS)
        big = max(prefill_max + 1, n - 1) | 1  # past the prefill graphs, odd
        if big + 1 > self.n_ctx or big > max_batch_tokens:
            return []
        rest = min(big, self.n_ctx - big)
        shapes = [self.scratch_inputs(0, [n], [0])]
        if self.states is not None and self.states.snap_slots and n > self.block_size:
            # a hybrid's chunk crossing a block boundary: the kernels' snapshot variants
            shapes[0].snap_at = [(n - 1) // self.block_size * self.block_size]
        if rest > prefill_max:
            shapes.append(self.scratch_inputs(0, [rest], [big]))
        n_dec = min(3, self.max_seqs - 1)
        if n_dec:  # an odd total: 3 rows beside an even chunk
            shapes.append(self.scratch_inputs(n_dec, [big - n_dec - 2], [0]))
        # the decode attention's variants of other row counts, each beside a short chunk
        # (an odd total)
        rows = getattr(self.model.ops, "eager_decode_rows", None)
        if rows is not None and n_dec:
            for nd in rows(self.max_blocks * self.block_size, self.max_seqs - 1):
                chunk = 16 + (nd + 1) % 2
                if nd != n_dec and nd + chunk <= max_batch_tokens and chunk <= self.n_ctx:
                    shapes.append(self.scratch_inputs(nd, [chunk], [0]))
        return shapes

    @torch.inference_mode()
    def warm_eager(self, max_batch_tokens: int) -> None:
        """Run ``warm_shapes`` (GPU only; their outputs are dropped, their keys written to the
        scratch block)."""
        if self.device.type != "cuda":
            return
        for x in self.warm_shapes(max_batch_tokens):
            self._eager(x)
        torch.cuda.synchronize(self.device)

    def decode_graph_for(self, n: int):
        for b in sorted(self.decode_graphs):
            if b >= n:
                return self.decode_graphs[b]
        return None

    @torch.inference_mode()
    def _between_steps(self, n_tokens: int) -> None:
        """The model's work between two steps (an offloaded MoE's expert cache: finished
        promotions published, its size re-derived from free memory for a step of
        ``n_tokens``): before every step, chained decode steps included."""
        between = getattr(self.model.ops, "between_steps", None)
        if between is not None:
            between(n_tokens)

    def shed_memory(self) -> bool:
        """After a step ran out of device memory: the model's memory given back where it has
        some to give (the ops' hook, as ``_between_steps``'s); False when nothing was."""
        shed = getattr(self.model.ops, "shed_memory", None)
        return shed is not None and shed()

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> StepResult:
        self._between_steps(plan.n_tokens)
        x = step_inputs(plan, self.block_size, self.max_blocks)
        if not len(x.logits_at) and not len(x.tokens):
            return StepResult(None, [])
        graph = None
        if self.use_graphs and not x.verify and not self.want_hidden:
            if x.n_decode == len(x.q_lens):
                graph = self.decode_graph_for(x.n_decode)
            elif x.n_decode == 0 and len(x.q_lens) == 1 and len(x.logits_at) <= 1:
                n = len(x.tokens)
                graph = next((g for m, g in sorted(self.prefill_graphs.items()) if m >= n), None)
        if graph is not None:
            if not graph.captured:
                graph.capture()  # before the inputs are loaded: capture fills them itself
            if graph.decode and self.decode_before is not None:
                self.decode_before(graph.n_seqs, x.wanting)
            snaps: list = []
            logits = self._replay(graph, x, snaps)
            self._serve(graph, len(x.tokens))
            ticket = None
            if graph.decode:
                self.last_decode = graph
                logits = logits[: len(x.wanting)]
                if self.decode_launched is not None:
                    ticket = self.decode_launched(graph.n_seqs)
            elif not len(x.logits_at):
                logits = None
            return StepResult(logits, x.wanting, graph, ticket, snaps=snaps)
        if x.verify and len(x.q_lens) == 1 and self.verify_graphs and not self.want_hidden:
            n = len(x.tokens)  # one sequence verifying its drafts, nothing else in the step
            graph = next((g for m, g in sorted(self.verify_graphs.items()) if m >= n), None)
            if graph is not None:
                if not graph.captured:
                    graph.capture()
                return StepResult(self._replay(graph, x)[:n], [], verify=x.verify)
        snaps = []
        if not self.want_hidden:
            return StepResult(self._eager(x, out_snaps=snaps), x.wanting, verify=x.verify, snaps=snaps)
        logits, rows = self._eager(x, hidden=True, out_snaps=snaps)
        hidden, t = [], 0
        for seq, start, n in zip(x.seqs, x.q_starts, x.q_lens):
            hidden.append((seq, start, rows[t : t + n]))
            t += n
        return StepResult(logits, x.wanting, verify=x.verify, hidden=hidden, snaps=snaps)

    def run_chained(self, seqs: list[Sequence], overrides: tuple[tuple[int, int, int], ...] = (),
                    passengers: frozenset[int] = frozenset(),
                    deferred: frozenset[int] = frozenset()) -> StepResult:
        """The decode step after the last one, on the same graph and rows, its tokens fed on
        the device by that step's choices: ``seqs`` are that step's rows, each with a block
        for its next position (the caller grew the tables); only the tables are copied in.
        ``overrides``: (row, token, position) of rows whose input the host chose instead
        (written on the device before the replay); ``passengers``: rows whose input is
        nobody's choice (their outputs are not read, and their draws are not taken);
        ``deferred``: rows chosen after the launch (BatchSampler.resample): the graph's
        sampling takes no draw for them either."""
        # the expert cache between steps here too: a long greedy answer is one chain of steps,
        # and without this its promotions were never published and a squeeze never shrank it
        self._between_steps(len(seqs))
        graph = self.last_decode
        _, h32 = graph.host_buffers()
        mb, b = graph.max_blocks, graph.n_seqs
        h32[: b * mb] = 0
        for i, seq in enumerate(seqs):
            h32[i * mb : i * mb + len(seq.table)] = seq.table
        if self.decode_before is not None:
            self.decode_before(graph.n_seqs, seqs, passengers | deferred)
        logits = graph.replay(chained=True, overrides=overrides)
        self._serve(graph, len(seqs))
        if self.states is not None:  # the same rows on the same slots, one token further
            for seq in seqs:
                self._slots[seq].length += 1
        ticket = self.decode_launched(graph.n_seqs) if self.decode_launched is not None else None
        return StepResult(logits[: len(seqs)], list(seqs), graph, ticket, passengers=passengers)

    def chain_ready(self, result: StepResult) -> bool:
        """Whether ``result``'s graph can feed its own next step."""
        g = result.graph
        return g is not None and g.decode and g.chainable and result.ticket is not None \
            and self.last_decode is g

    def _serve(self, graph, n_rows: int) -> None:
        """The host's part of a decode graph just launched (an offloaded MoE's misses)."""
        serve = getattr(self.model.ops, "serve_replay", None)
        if serve is not None and graph.decode:
            serve(n_rows)

    def _replay(self, g, x: StepInputs, out_snaps: list | None = None) -> torch.Tensor:
        h64, h32 = g.host_buffers()
        n, b, mb = g.n_tokens, g.n_seqs, g.max_blocks
        t = len(x.tokens)
        h64[:] = 0
        h32[:] = 0
        h64[:t] = x.tokens
        h64[n : n + t] = x.positions
        h64[2 * n : 2 * n + t] = x.slots
        if g.decode:
            h64[3 * n :] = np.arange(b)
            h32[: len(x.q_lens) * mb] = x.tables.reshape(-1)
            h32[b * mb : b * mb + len(x.q_starts)] = x.q_starts
            h32[b * mb + b :] = np.arange(b + 1)
        else:
            pad = np.arange(t, n)
            h64[n + t : 2 * n] = x.q_starts[0] + pad  # padding: later positions, scratch slots
            h64[2 * n + t : 3 * n] = pad % self.block_size
            if g.n_logits == 1:
                h64[3 * n] = t - 1
            else:  # every real row's logits (a verification), the padding repeating the last
                h64[3 * n :] = np.minimum(np.arange(g.n_logits), t - 1)
            h32[:mb] = x.tables[0]
            h32[mb] = x.q_starts[0]
            # the chunk is its t real rows: the attention's keys end at its last real position.
            # Counting the padding rows as the chunk's made a tile holding real rows read the
            # keys after them (slots of the table's blocks this step never wrote: stale, NaN
            # after a reuse), and a masked score times a NaN value is NaN in P @ V
            h32[mb + 1 :] = (0, t)
        slots = self._graph_slots.get(g)
        if slots is None:
            return g.replay()
        rows = [self._bind(seq) for seq in x.seqs]
        slots.load([h.slot for h in rows])
        snap_rows = self._snap_rows(x)
        snap = self._graph_snaps.get(g)
        if snap is not None:
            snap.load(snap_rows or [(0, SCRATCH_SLOT)] * len(rows))
        elif snap_rows:
            raise StateError("a graph without snapshot rows was given a step that snapshots")
        logits = g.replay()
        for h, m in zip(rows, x.q_lens):  # the graph's step consumed the real tokens of each
            h.length += m
        if snap_rows and out_snaps is not None:
            self._saved(x, snap_rows, out_snaps)
        return logits

    def _snap_rows(self, x: StepInputs) -> list[tuple[int, int]] | None:
        """The step's snapshot rows on the state pool: (row count, snapshot slot) a sequence,
        (0, 0) for none; None when the step takes no snapshot."""
        if not x.snap_at or not any(x.snap_at):
            return None
        slots = iter(self.states.snap_slots)
        rows = []
        for a in x.snap_at:
            slot = next(slots, None) if a else SCRATCH_SLOT
            if slot is None:
                raise StateError(f"the step asks for {sum(map(bool, x.snap_at))} snapshots; the "
                                 f"state pool has {len(self.states.snap_slots)} snapshot slots")
            rows.append((a, slot))
        return rows

    def _saved(self, x: StepInputs, snap_rows: list[tuple[int, int]], out: list) -> None:
        """The snapshot slots the step wrote, copied out: (sequence, StateSnapshot) into ``out``
        (queued after the step: the next step may overwrite the slots)."""
        for seq, start, (a, slot) in zip(x.seqs, x.q_starts, snap_rows):
            if a:
                out.append((seq, self.states.save(slot, start + a)))

    def _bind(self, seq: Sequence) -> SlotState:
        """``seq``'s slot of the state pool: the one it holds, or one taken now and written with
        zeros (a sequence from its first token) or the snapshot it was admitted with."""
        held = self._slots.get(seq)
        if held is not None and held is seq.state and held.length == seq.n_computed:
            return held
        if held is not None:  # re-admitted since it was preempted: a new start
            self.release(seq)
        st = self.states.bind(seq.state if seq.n_computed else None)
        self._slots[seq] = st
        seq.state = st
        if st.length != seq.n_computed:
            raise StateError(f"sequence {seq.id} resumes at position {seq.n_computed} from a "
                             f"recurrent state of {st.length} tokens")  # fmt: skip
        return st

    def save_state(self, seq: Sequence):
        """A copy of ``seq``'s recurrent state now (queued on the stream after the steps
        launched so far), for ``restore_state``."""
        if seq.state is None:
            raise StateError(f"sequence {seq.id} has no recurrent state to save")
        return seq.state.clone()

    def restore_state(self, seq: Sequence, snap) -> None:
        """``seq``'s recurrent state becomes ``snap`` (from ``save_state``): written into the
        slot it holds, or (off the state pool, or before it holds one) taken as its state."""
        held = self._slots.get(seq)
        if held is not None and held is seq.state:
            self.states.load(held.slot, snap)
            held.length = snap.length
        else:
            seq.state = snap

    def release(self, seq: Sequence) -> None:
        """``seq`` left the running sequences (finished, cancelled, failed or preempted): its
        state slot goes back to the pool (work queued on it still runs first: the stream's
        order). Nothing to do off the state pool."""
        held = self._slots.pop(seq, None)
        if held is not None:
            held.release()
            if seq.state is held:
                seq.state = None

    def _state(self, seq: Sequence):
        """``seq``'s recurrent state, new (zeros) when it starts from its first token (a new
        sequence, or one preempted and recomputed)."""
        if seq.state is None or seq.n_computed == 0:
            make = getattr(self.model, "new_state", None)  # the model's layout and device
            seq.state = make() if make is not None else RecurrentState.zeros(self.model.config, self.device)
        return seq.state

    def _eager(self, x: StepInputs, hidden: bool = False, out_snaps: list | None = None):
        """The step run eagerly: its logits (None when no row wants any); with ``hidden``
        (logits, every row's post-norm hidden state [T, D]). The snapshots the step's rows
        ask for go into ``out_snaps`` as (sequence, state)."""
        dev = self.device

        def put(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(dev, non_blocking=False)

        b = len(x.q_lens)
        cu = np.zeros(b + 1, dtype=np.int32)
        cu[1:] = np.cumsum(x.q_lens)
        layout = SeqLayout(x.q_lens, x.q_starts, x.n_decode, put(x.slots), put(x.tables),
                           put(np.asarray(x.q_starts, dtype=np.int32)), put(cu))
        at = x.logits_at if len(x.logits_at) else np.asarray([len(x.tokens) - 1])
        kv, snap_rows = self.pool, None
        if self.states is not None:  # the recurrent layers' states: the rows' slots of the pool
            rows = [self._bind(seq) for seq in x.seqs] if x.seqs is not None else []
            ids = [st.slot for st in rows] or [SCRATCH_SLOT] * b  # the profile step: scratch
            snap_rows = self._snap_rows(x)
            snap = None if snap_rows is None else put(np.asarray(snap_rows, dtype=np.int32))
            kv = HybridKV(self.pool, rows, self.states, put(np.asarray(ids, dtype=np.int32)),
                          snap=snap)
        elif self.model.config.is_hybrid:  # the recurrent layers' state: each sequence's own
            kv = HybridKV(self.pool, [self._state(seq) for seq in x.seqs], snap_at=x.snap_at,
                          snaps=[None] * b)
        batch = Batch(put(x.tokens), put(x.positions), kv, layout, put(at))
        if hidden:
            logits, rows = self.model.step(batch, hidden_at=torch.arange(len(x.tokens), device=dev))
        else:
            logits, rows = self.model.step(batch), None
        if out_snaps is not None and snap_rows is not None:  # the pool's snapshot slots
            self._saved(x, snap_rows, out_snaps)
        elif out_snaps is not None and x.snap_at and isinstance(kv, HybridKV):  # the CPU's copies
            for seq, a, st in zip(x.seqs, x.snap_at, kv.snaps):
                if a and st is None:
                    raise StateError(f"sequence {seq.id}'s step asked for a snapshot after {a} "
                                     "rows; the model made none")
                if a:
                    out_snaps.append((seq, st))
        logits = logits if len(x.logits_at) else None
        return (logits, rows) if hidden else logits
