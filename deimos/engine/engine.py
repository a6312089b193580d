"""The engine: many requests decoded together (continuous batching over a paged KV cache).

    engine = Engine(model, EngineConfig(n_ctx=4096), stop_ids)
    seq = engine.add(request)
    while engine.has_work:
        for out in engine.step():     # StepOutput(seq, token, error) for every token chosen
            ...

A step: the scheduler plans it (deimos.engine.scheduler), the runner runs the model on it
(deimos.engine.runner), and the sequences that reached the end of their tokens get their next
token from the sampler (deimos.engine.sampling: on the GPU batched in the step's graph, rows that
need the host's exact path on the host). Finished and cancelled sequences give their blocks
back at once; full blocks stay in the prefix cache for the next request that shares them.

With speculative decoding (``EngineConfig.spec``, deimos.engine.speculate) a decoding sequence
may verify drafts of its next tokens in a step (eagerly, beside the others' rows): the accepted
ones and one more come out of that step, each through ``_emit``; the rest are rolled back.
A hybrid model's recurrent state cannot forget a rejected draft's row: the state is saved before
the verification, and after a rejection it is restored and the sequence's accepted tokens and
the correction are fed again as a chunk of the next step (whose last row gives the next token),
the way a preempted sequence is recomputed.

One thread owns an engine (the server's worker, or the ``LLM`` API's caller).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import numpy as np
import torch

from deimos.engine.block_manager import BlockManager, pack_tokens
from deimos.engine.request import (
    ContextLengthError,
    EngineError,
    Request,
    RequestError,
    masks_only,
)
from deimos.engine.runner import ModelRunner
from deimos.engine.sampling import BatchSampler
from deimos.engine.scheduler import Scheduler, SchedulerConfig
from deimos.engine.sequence import SeqStatus, Sequence
from deimos.engine.speculate import SpecConfig, SpecState, make_drafter
from deimos.kernels.sample_batch import PENALTY_WIDTH, always_decided
from deimos.kernels.sampling import Sampler, logprobs
from deimos.models.blocks import DecoderModel
from deimos.runtime.kv_pool import KVPool, bytes_per_token, pool_blocks, step_bytes
from deimos.runtime.state_pool import state_pool_for

log = logging.getLogger("deimos")


@dataclass(frozen=True)
class _Chain:
    """The rows of a chained decode step that need more than the graph's feed (indices into
    the step's rows): chosen after the launch (``Engine._deferred``), chosen by the host (a
    passenger every other launch), reporting logprobs (their logits copied out first)."""

    deferred: frozenset[int]
    hosts: tuple[int, ...]
    logprob: tuple[int, ...]


@dataclass(frozen=True)
class EngineConfig:
    """Every setting of the engine, once. ``n_ctx``: the most tokens one sequence may hold
    (prompt plus outputs). The KV pool: ``kv_tokens`` or ``kv_gib`` when given; on a GPU
    otherwise ``kv_fraction`` of the memory free after the weights (less a reserve for the
    step's activations), at most ``kv_max_factor`` full contexts per running sequence; on the
    CPU ``n_ctx`` tokens per running sequence, at most 4 GiB. ``spec``: speculative decoding
    (None: off). ``defer_rows``: below."""

    n_ctx: int
    max_seqs: int = 64
    max_batch_tokens: int = 2048
    block_size: int = 16
    kv_tokens: int | None = None
    kv_gib: float | None = None
    kv_fraction: float = 0.9
    kv_max_factor: float = 2.0
    prefix_cache: bool = True
    cuda_graphs: bool = True
    spec: SpecConfig | None = None
    # rows whose choice needs their last token (a JSON grammar's mask, penalties) chosen
    # after the chained launch that computed them, on the device (BatchSampler.resample),
    # instead of riding every other launch as passengers (a grammar's) or stopping the chain
    # for the whole batch (penalties); rows reporting logprobs kept in the chain, their
    # logits copied out before the next launch. On since session 44's H100 run (qwen3 4B, 16
    # rows): a grammar's row 100 -> 194 tok/s for -2.3% to its 15 neighbours, a penalized
    # row's neighbours +12.7%
    defer_rows: bool = True

    def __post_init__(self) -> None:
        if self.n_ctx < 1:  # 1: every request is refused (a prompt needs a row to generate from)
            raise ValueError(f"n_ctx must be >= 1, got {self.n_ctx}")
        if self.block_size < 16 or self.block_size > 256 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two in 16..256, got {self.block_size}")
        if self.kv_tokens is not None and self.kv_tokens < 1:
            raise ValueError(f"kv_tokens must be >= 1, got {self.kv_tokens}")
        if self.kv_gib is not None and not self.kv_gib > 0:
            raise ValueError(f"kv_gib must be > 0, got {self.kv_gib}")
        if not 0 < self.kv_fraction <= 1:
            raise ValueError(f"kv_fraction must be in (0, 1], got {self.kv_fraction}")
        SchedulerConfig(self.max_seqs, self.max_batch_tokens)  # its checks
        if self.spec is not None and not isinstance(self.spec, SpecConfig):
            raise ValueError(f"spec must be a SpecConfig or None, got {type(self.spec).__name__}")


@dataclass(frozen=True, slots=True)
class StepOutput:
    seq: Sequence
    token: int | None  # the token chosen (None: the sequence ended without one, see error)
    error: BaseException | None = None
    # this is the sequence's last output (its request's finish_reason was set by this token).
    # A step that chose several tokens for a sequence records them all before they are read,
    # so the request's state cannot say which of them ended it
    final: bool = False


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_cached: int
    block_size: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    preemptions: int
    experts: dict | None = None  # the expert cache's numbers (an offloaded MoE model), else None
    # speculative decoding: drafts verified and accepted, steps that verified any
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_verify_steps: int = 0
    # a sequence's steps that chose tokens (plain rows and verifications), and the tokens chosen
    token_rows: int = 0
    tokens_chosen: int = 0


def _make_pool(model: DecoderModel, cfg: EngineConfig) -> KVPool:
    device = model.device
    dtype = torch.float32 if device.type == "cpu" else torch.float16
    want = int(cfg.n_ctx * cfg.max_seqs * cfg.kv_max_factor)
    if cfg.kv_tokens is not None or cfg.kv_gib is not None:
        n = pool_blocks(model.config, cfg.block_size, dtype, tokens=cfg.kv_tokens, gib=cfg.kv_gib)
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        reserve = 2 * 2**30 + step_bytes(model.config, cfg.max_batch_tokens)  # activations
        n = pool_blocks(model.config, cfg.block_size, dtype, free_bytes=free, fraction=cfg.kv_fraction,
                        reserve_bytes=reserve, max_tokens=want)
    else:
        per = bytes_per_token(model.config, dtype)
        tokens = min(cfg.n_ctx * cfg.max_seqs, max(cfg.n_ctx, (4 * 2**30) // per))
        n = pool_blocks(model.config, cfg.block_size, dtype, tokens=tokens)
    one = -(-cfg.n_ctx // cfg.block_size) + 1  # one full context and the scratch block
    if n < one:
        log.warning("a KV pool of %d tokens cannot hold one full context (%d tokens): using %d",
                    (n - 1) * cfg.block_size, cfg.n_ctx, (one - 1) * cfg.block_size)
        n = one
    return KVPool(model.config, n, cfg.block_size, device, dtype)


class Engine:
    def __init__(self, model: DecoderModel, cfg: EngineConfig) -> None:
        self.model = model
        self.cfg = cfg
        self.n_vocab = model.config.n_vocab
        self.drafter = None
        if cfg.spec is not None:  # before the KV pool: a draft model's memory is taken first
            self.drafter = make_drafter(cfg.spec, model, cfg.n_ctx, cfg.max_seqs)
        # a hybrid model's recurrent states on the kernel path: a slot per running sequence,
        # allocated before the KV pool is sized from the memory left
        self.states = state_pool_for(model, cfg.max_seqs)
        self.pool = _make_pool(model, cfg)
        # a hybrid model's recurrent layers can start from a cached prefix only where a snapshot
        # of their state was kept: its cache needs one (the latest full block of each sequence)
        self.hybrid = model.config.is_hybrid
        self.blocks = BlockManager(self.pool.n_blocks, cfg.block_size, cfg.prefix_cache,
                                   needs_state=self.hybrid, max_states=2 * cfg.max_seqs)
        # a prefill chunk crossing a block boundary snapshots the state there inside its step:
        # as many a step as the state pool has snapshot slots (the CPU reference: any number)
        snaps = len(self.states.snap_slots) if self.states is not None else cfg.max_seqs
        self.scheduler = Scheduler(self.blocks, SchedulerConfig(cfg.max_seqs, cfg.max_batch_tokens),
                                   propose=self._propose if self.drafter is not None else None,
                                   step_snapshots=snaps if self.hybrid else 0)
        self.sampler = BatchSampler(self.n_vocab, model.device, cfg.max_seqs)
        self.runner = ModelRunner(model, self.pool, cfg.n_ctx, cfg.max_seqs, cfg.cuda_graphs,
                                  decode_after=self.sampler.graph_hook,
                                  decode_before=self.sampler.prepare,
                                  decode_launched=self.sampler.launched, states=self.states,
                                  verify_graphs=self.drafter is not None)
        self.runner.want_hidden = bool(getattr(self.drafter, "wants_hidden", False))
        self._ids = itertools.count()
        self._inflight = None  # a launched step not read yet (deimos.engine.runner.StepResult)
        self.steps = 0
        self.spec_drafted = self.spec_accepted = self.spec_verify_steps = 0
        self.token_rows = self.tokens_chosen = 0
        self.memory_recoveries = 0  # steps that ran out of device memory and were recomputed
        # rows launched in a chained step as passengers (their choice is the host's: _continue)
        self.passenger_rows = 0

    @property
    def n_ctx(self) -> int:
        return self.cfg.n_ctx

    def warm(self, progress=None) -> None:
        """Capture the graphs, then one eager step of the largest shape (its activations'
        memory reserved now, not while serving), then the eager shapes of a server's first
        requests (``ModelRunner.warm_shapes``: their kernels compiled now, not in a request)."""
        self.runner.warm(progress)
        if not self.model.graph_safe or getattr(self.model.ops, "offload", None) is not None:
            # a model whose steps read host state (an offloaded MoE: the profile would route
            # 2048 tokens through the CPU and fill the expert cache's statistics; a hybrid off
            # the state pool: each sequence's recurrent state) gets no profile step: its memory
            # follows other rules
            return
        peak = self.runner.profile(self.cfg.max_batch_tokens)
        if peak:
            log.info("the largest eager step (%d tokens) peaks at %.2f GiB of activations",
                     self.cfg.max_batch_tokens, peak / 2**30)
        self.runner.warm_eager(self.cfg.max_batch_tokens)  # the first requests' kernel variants

    # ---- requests ----------------------------------------------------------------------

    def add(self, req: Request) -> Sequence:
        """Queue ``req``; errors in the request itself raise here (RequestError)."""
        n = self.n_vocab
        ids = req.prompt_ids
        # the ids' range in one C pass (packing them, which fails below 0) and a numpy max: a
        # min() and a max() over the list cost ~20 ns a token (0.4 ms for 20k), twice with
        # the sampler's own check. The packed prompt is the prefix cache's (its chain keys)
        try:
            packed = pack_tokens(ids) if ids else None
            ok = packed is None or int(np.frombuffer(packed, dtype="<u4").max()) < n
        except OverflowError:
            packed, ok = None, False
        except TypeError:
            bad = next(t for t in ids if not isinstance(t, (int, np.integer)))
            raise RequestError(f"prompt token id {bad!r} is not an integer") from None
        if not ok:
            bad = next(t for t in ids if not 0 <= t < n)
            raise RequestError(f"prompt token id {bad} is outside the vocabulary [0, {n})")
        if len(req.prompt_ids) >= self.cfg.n_ctx:
            raise ContextLengthError(
                f"the prompt has {len(req.prompt_ids)} tokens; the context holds {self.cfg.n_ctx} "
                "(prompt plus at least one generated token)")
        req.sampler = Sampler(req.sampling, n)
        req.sampler.accept_many(req.prompt_ids, checked=True)
        seq = Sequence(next(self._ids), req, list(req.prompt_ids), packed=packed)
        if self.drafter is not None and not req.logits_processors:  # a grammar decodes plainly
            seq.spec = SpecState(self.cfg.spec.k_max)
        if req.max_tokens == 0:
            req.finish_reason = "length"
            seq.status = SeqStatus.FINISHED
            return seq
        self.scheduler.add(seq)
        return seq

    def cancel(self, seq: Sequence) -> None:
        """Stop ``seq`` now (from the owning thread); its blocks are free before the next step."""
        if not seq.finished:
            seq.request.finish_reason = seq.request.finish_reason or "cancelled"
            self._finish(seq)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._inflight is not None

    def stats(self) -> EngineStats:
        b = self.blocks
        numbers = getattr(self.model.ops, "numbers", None)
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), b.n_used,
                           b.n_free, b.n_cached, b.block_size, b.hit_tokens, b.query_tokens,
                           self.scheduler.preemptions, numbers() if numbers is not None else None,
                           self.spec_drafted, self.spec_accepted, self.spec_verify_steps,
                           self.token_rows, self.tokens_chosen)

    # ---- the step ----------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """One step: the tokens chosen (an empty list while a step is only launched: on a GPU
        a decode step whose batch does not change is launched before the one before it is
        read, its tokens fed on the device, so the GPU never waits for the host)."""
        if self._inflight is not None:
            return self._continue()
        plan = self.scheduler.schedule()
        for seq in plan.preempted:  # a preempted sequence starts again from a snapshot or zeros
            self.runner.release(seq)
        if plan.empty:
            return []
        if self.hybrid:  # the states the verifications start from (restored after a rejection)
            for seq, _ in plan.verify:
                seq.spec.rollback = self.runner.save_state(seq)
        try:
            result = self.runner.run(plan)
        except torch.cuda.OutOfMemoryError as e:
            return self._out_of_memory(plan, e)
        except Exception as e:  # noqa: BLE001 - a fault of the engine: every sequence of the step fails
            return self._failed(plan.decode + [s for s, _ in plan.verify + plan.prefill], e)
        self.steps += 1
        for seq, start, rows in result.hidden:  # the main model's rows for an MTP drafter
            self.drafter.observe(seq, start, rows)
        for seq in plan.decode:
            seq.n_computed += 1
        for seq, _ in plan.verify:  # its last token; a draft's row counts once it is accepted
            seq.n_computed += 1
        self.spec_verify_steps += bool(plan.verify)
        snaps = dict(result.snaps)  # a chunk's state at the block boundary inside it
        for seq, n in plan.prefill:
            seq.n_computed += n
            self._seal(seq, snaps.get(seq))
        if result.wanting and self.runner.chain_ready(result):
            self._inflight = result  # read at the next call, after launching the one after
            return []
        return self._read(result)

    def _finish(self, seq: Sequence) -> None:
        """``seq`` is done: its blocks back (the scheduler), its recurrent-state slot back."""
        self.scheduler.finish(seq)
        self.runner.release(seq)
        if self.drafter is not None:
            self.drafter.release(seq)  # a draft model's blocks for it

    def _out_of_memory(self, plan, e: Exception) -> list[StepOutput]:
        """A step ran out of device memory (another process took what its activations needed
        after the expert cache's last reading): the cache gives a step's room back and the
        step's sequences are preempted, recomputed from their cached prefixes (their tokens,
        answers and recurrent states as if the step had not run: nothing of it was kept).
        With nothing to give back, they fail (an engine fault, as any other)."""
        seqs = plan.decode + [s for s, _ in plan.verify + plan.prefill]
        if not self.runner.shed_memory():
            return self._failed(seqs, e)
        log.warning("engine step: out of device memory; the expert cache gave memory back, the "
                    "step's %d sequences will be recomputed", len(seqs))
        for seq in reversed(seqs):  # the step's first back at the front of the queue
            if not seq.finished:
                self.scheduler.preempt(seq)
                self.runner.release(seq)
                if seq.spec is not None:
                    seq.spec.rollback = None  # its verification never ran
        self.memory_recoveries += 1
        return []

    def _failed(self, seqs: list[Sequence], e: Exception) -> list[StepOutput]:
        log.error("engine step failed: %s", e, exc_info=True)
        err = EngineError(f"the engine failed on a step: {type(e).__name__}: {e}")
        outs = []
        for seq in seqs:
            if not seq.finished:
                self._finish(seq)
                outs.append(StepOutput(seq, None, err, final=True))
        return outs

    def _deferred(self, seq: Sequence) -> bool:
        """Whether ``seq``'s row stays in a chain of decode steps at its full rate though its
        choice needs its last token (``EngineConfig.defer_rows``): a grammar's mask (every
        processor one, ``masks_only``) or penalties (over a window the device sampler holds:
        ``penalty_last_n`` 0..PENALTY_WIDTH), no logprobs, and a sampling the device always
        decides (``always_decided``). In a chained launch its input is the token chosen after
        the launch before (``BatchSampler.resample``, enqueued between the two), so its key,
        value and recurrent state are its own: hybrids too."""
        req = seq.request
        p = req.sampling
        procs = req.logits_processors
        return (self.cfg.defer_rows and bool(procs or p.penalties_enabled) and masks_only(procs)
                and req.top_logprobs is None and always_decided(p)
                and (not p.penalties_enabled
                     or 0 <= p.penalty_last_n <= PENALTY_WIDTH))  # fmt: skip

    def _logprob_row(self, seq: Sequence) -> bool:
        """Whether ``seq``'s row stays in a chain of decode steps though it reports logprobs
        (``EngineConfig.defer_rows``; otherwise such a row stops the chain for the whole
        batch): its token is the graph's sampler's as any plain row's (no processors or
        penalties, ``always_decided``), and its logits row is copied to the host before the
        next launch overwrites it (``BatchSampler.hold``), for the logprobs."""
        req = seq.request
        p = req.sampling
        return (self.cfg.defer_rows and req.top_logprobs is not None
                and not req.logits_processors and not p.penalties_enabled
                and always_decided(p))  # fmt: skip

    def _chain_ok(self, cur) -> bool:
        """Whether the decode step after ``cur`` can be launched before ``cur`` is read
        (``_chain_rows``)."""
        return self._chain_rows(cur) is not None

    def _chain_rows(self, cur) -> _Chain | None:
        """The rows of the decode step after ``cur`` that need more than the graph's own
        feed, where that step can be launched before ``cur`` is read; None where it cannot.
        It can with the same sequences (nothing waiting, nothing else running), none of them
        finishing by length at ``cur``, a block for every next position, and every row
        either sampled on the device exactly without ``cur``'s token on the host (no
        penalties, processors or logprobs; ``always_decided``), or ``_deferred``, or a
        ``_logprob_row``, or riding along as a passenger (a row whose choice is the host's,
        a logits processor: every other step, ``_continue``; not all of them, which would
        only halve their rate; not in a hybrid model, whose recurrent state a passenger's
        input would advance wrongly, where a KV row is only overwritten by the next step)."""
        rows = cur.wanting
        if self.scheduler.waiting or len(self.scheduler.running) != len(rows):
            return None
        need = 0
        deferred, hosts, logprob = [], [], []
        for i, seq in enumerate(rows):
            req = seq.request
            p = req.sampling
            if (seq.finished or len(req.output_ids) + 1 >= req.max_tokens
                    or len(seq.tokens) >= self.cfg.n_ctx):  # fmt: skip
                return None
            if self._deferred(seq):
                deferred.append(i)
            elif self._logprob_row(seq):
                logprob.append(i)
            elif req.logits_processors and not self.hybrid:
                hosts.append(i)
            elif (req.logits_processors or req.top_logprobs is not None
                    or p.penalties_enabled or not always_decided(p)):  # fmt: skip
                return None
            if seq.spec is not None and seq.spec.wanted(len(req.output_ids) + 1):
                return None  # it drafts at its next step: that step needs this one's token
            need += self.blocks.blocks_to_grow(seq.table, seq.n_computed + 1)
        if len(hosts) == len(rows) or need > self.blocks.n_free:
            return None  # (passengers alone: a chain would only halve their rate)
        return _Chain(frozenset(deferred), tuple(hosts), tuple(logprob))

    def _continue(self) -> list[StepOutput]:
        """The step after ``_inflight``, launched before it is read when ``_chain_rows``
        allows. A row whose choice needs its last token (``_deferred``: a grammar's mask,
        penalties) is chosen after the launch, once ``cur``'s token is read
        (``BatchSampler.resample``, before the next launch reads it). A row whose choice is
        the host's alternates: where it was read-worthy in the step before, its next input is
        not chosen yet, so it rides the launch as a passenger (its output not read; the key
        and value it writes are rewritten by its next step); where it was a passenger, its
        host-chosen token and position are written on the device for this launch
        (``overrides``), and its output is read."""
        cur, self._inflight = self._inflight, None
        nxt = None
        chain = self._chain_rows(cur)
        deferred = frozenset() if chain is None else chain.deferred
        if chain is not None:
            rows = cur.wanting
            hosts = chain.hosts
            passengers = frozenset(i for i in hosts if i not in cur.passengers)
            overrides = tuple((i, rows[i].tokens[-1], rows[i].n_computed)
                              for i in hosts if i in cur.passengers)
            for seq in rows:
                self.blocks.grow(seq.table, seq.n_computed + 1)
            # the rows the host chooses at ``cur`` (and those reporting logprobs) are read after
            # the launch below, which overwrites the graph's logits: copied out first (an
            # engine that read them from the device then took the next step's rows, and
            # waited for that step)
            held = [i for i in hosts if i not in cur.passengers] + list(chain.logprob)
            try:
                self.sampler.hold(cur, held)
                nxt = self.runner.run_chained(rows, overrides, passengers, deferred)
            except Exception as e:  # noqa: BLE001
                return self._failed(list(rows), e)
            self.steps += 1
            self.passenger_rows += len(passengers)
            for i, seq in enumerate(rows):
                if i not in passengers:
                    seq.n_computed += 1
        outs = self._read(cur)
        live = [(i, cur.wanting[i]) for i in sorted(deferred) if not cur.wanting[i].finished]
        if nxt is not None and live:  # their tokens at ``nxt``, now that their masks are known
            try:
                self.sampler.resample(nxt, live)
            except Exception as e:  # noqa: BLE001
                outs += self._failed([seq for _, seq in live], e)
        self._inflight = nxt
        return outs

    def _read(self, result) -> list[StepOutput]:
        outs: list[StepOutput] = []
        if result.wanting:
            choices = self.sampler.choose(result, self.model.device)
            for i, (seq, (token, error)) in enumerate(zip(result.wanting, choices)):
                if seq.finished or i in result.passengers:  # ended while this step ran
                    continue  # (cancelled, or a chained row), or rode it as a passenger
                outs.append(self._emit(seq, token, error))
                self._seal(seq)
                self.token_rows += 1
                self.tokens_chosen += token is not None
        if result.verify:
            rows = result.logits[len(result.wanting) :]
            at = 0
            for seq, drafts in result.verify:
                if not seq.finished:
                    outs += self._verify(seq, drafts, rows[at : at + len(drafts) + 1])
                at += len(drafts) + 1
        return outs

    # ---- speculative decoding ----------------------------------------------------------

    def _propose(self, seq: Sequence, room: int) -> list[int]:
        """The scheduler's drafts for ``seq`` (at most ``room``): as many as its SpecState
        wants, fed positions inside the context, and no more tokens than max_tokens leaves
        (a verification gives one token past its accepted drafts)."""
        st = seq.spec
        if st is None:
            return []
        req = seq.request
        n_out = len(req.output_ids)
        k = min(st.wanted(n_out), room, req.max_tokens - n_out - 1,
                self.cfg.n_ctx - len(seq.tokens))  # the last draft's position: n_ctx - 1
        if k <= 0:
            return []
        drafts = self.drafter.propose(seq, k)[:k]
        if any(not 0 <= t < self.n_vocab for t in drafts):
            drafts = []
        st.found(len(drafts), n_out)
        return drafts

    def _verify(self, seq: Sequence, drafts: list[int], rows) -> list[StepOutput]:
        """``seq``'s verification: ``rows`` [k + 1, V] are the logits after its last token and
        after each of its k ``drafts``. Emits the accepted drafts, then the token chosen at the
        first rejection (or after the last draft), stopping at the first that finishes the
        sequence; the cache keeps the accepted prefix (blocks past it go back)."""
        req = seq.request
        outs: list[StepOutput] = []
        accepted = 0
        fast = self.sampler.greedy_rows(seq, rows)
        for j in range(len(drafts) + 1):
            draft = drafts[j] if j < len(drafts) else None
            try:
                if fast is None:
                    token, ok = self.sampler.verify(seq, rows[j], draft)
                elif fast[j] is None:
                    raise EngineError("cannot sample from the model's logits: logits contain NaN")
                else:
                    token, ok = fast[j], fast[j] == draft
                if req.top_logprobs is not None:
                    req.token_logprobs.append(logprobs(rows[j].float(), token, req.top_logprobs))
            except EngineError as e:
                outs.append(self._emit(seq, None, e))
                break
            outs.append(self._emit(seq, token, None))
            accepted += ok
            if seq.finished or not ok:
                break
            seq.n_computed += 1  # the accepted draft's keys and values are the cache's now
        self.spec_drafted += len(drafts)
        self.spec_accepted += accepted
        self.token_rows += 1
        self.tokens_chosen += sum(o.token is not None for o in outs)
        snap, seq.spec.rollback = seq.spec.rollback, None
        if not seq.finished and snap is not None and accepted < len(drafts):
            # a hybrid's state went over the rejected drafts too: back to where the verification
            # started; the accepted tokens and the correction are the next step's chunk
            self.runner.restore_state(seq, snap)
            seq.n_computed = snap.length
        if not seq.finished:
            keep = self.blocks.blocks_for(len(seq.tokens))  # up to the next token's position
            if len(seq.table) > keep:  # blocks that held only rejected drafts
                tail = seq.table[keep:]
                del seq.table[keep:]
                self.blocks.free(tail)
            self._seal(seq)
            seq.spec.verified(len(drafts), accepted, len(req.output_ids), self.cfg.spec.k_max)
        return outs

    def _seal(self, seq: Sequence, snap=None) -> None:
        """Seal ``seq``'s full blocks; a hybrid's recurrent state at the last one is kept on it:
        ``snap`` (the state the step took at a boundary inside its chunk) or the sequence's
        own state, when it stands there."""
        if not seq.finished:
            n = min(seq.n_computed, len(seq.tokens))
            seq.n_sealed = self.blocks.seal(seq.table, seq.tokens, n, seq.n_sealed, seq.keys)
            st = snap if snap is not None else seq.state
            if (self.hybrid and self.blocks.prefix_cache and st is not None and seq.n_sealed
                    and st.length == seq.n_sealed * self.blocks.block_size
                    and seq.snap_block != seq.table[seq.n_sealed - 1]):  # fmt: skip
                # the state stands at a block boundary: a snapshot there (the next turn of the
                # conversation starts from it, prefilling only what follows). The one at the
                # prompt's last boundary stays for others sharing the prompt (a system prompt);
                # later ones replace each other (one per sequence)
                prev = seq.snap_block if seq.snap_pos > seq.n_prompt else None
                kept = snap if snap is not None else st.clone()  # a step's snapshot is a copy
                seq.snap_block = self.blocks.attach_state(seq.table[seq.n_sealed - 1], kept,
                                                          previous=prev)
                seq.snap_pos = st.length

    def _emit(self, seq: Sequence, token: int | None, error: BaseException | None) -> StepOutput:
        """``token`` is ``seq``'s next output: recorded, and the sequence finished on a stop
        token, the loop guard, ``max_tokens``, or a full context (prompt + outputs - 1 rows
        are fed: one more row must be free to feed this token)."""
        req = seq.request
        if error is not None or token is None:
            req.finish_reason = "error"
            self._finish(seq)
            return StepOutput(seq, None, error, final=True)
        req.sampler.accept(token)
        req.output_ids.append(token)
        seq.tokens.append(token)
        if token in req.stop_ids:
            req.finish_reason = "stop"
        elif req.loop_guard is not None and req.loop_guard.period(req.output_ids) is not None:
            req.finish_reason = "repetition"
        elif len(req.output_ids) >= req.max_tokens or len(seq.tokens) - 1 >= self.cfg.n_ctx:
            req.finish_reason = "length"
        if req.finish_reason is not None:
            self._seal(seq)  # its last full blocks (and a hybrid's state there) stay cached
            self._finish(seq)
        return StepOutput(seq, token, final=req.finish_reason is not None)
