"""The engine worker: one thread owns the ``LLM``'s engine and decodes every job together.

Handlers ``submit`` a ``Job`` and read its events from an asyncio queue; the thread admits new
jobs at step boundaries (continuous batching: deimos.engine.Engine), so a request joins the
running batch at the next step. A job's ``cancelled`` flag (set when its client disconnects)
is checked at every step: its sequence ends and its KV blocks are free at once.

Events a job receives, in order: any number of ``Piece``, then one ``Done`` or ``Failed``
(or, put there by the server's shutdown rather than the worker, one ``Cut``). The worker hands
a step's events to each event loop in one call (``Outbox``): waking a loop from another thread
writes to its self-pipe, ~100 us a call with the GIL passed back and forth on a 2-core CPU,
which per token and job was 6% of a single stream's decode there and would be one wake-up per
stream and step at 64 streams.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from deimos.engine import LLM, Request
from deimos.engine.request import EngineError
from deimos.kernels.sampling import TokenLogprobs
from deimos.engine.jsontext import closure
from deimos.server.metrics import Finished, Metrics
from deimos.server.processors import Constrained
from deimos.server.stops import StopMatcher

log = logging.getLogger("deimos.server")


class QueueFull(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class Piece:
    text: str  # safe to show: complete UTF-8, no part of a stop string
    logprobs: list[TokenLogprobs]  # the tokens whose text ends within ``text`` (when asked)


@dataclass(frozen=True, slots=True)
class Done:
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float
    prefill_s: float
    decode_s: float
    queued_s: float


@dataclass(frozen=True, slots=True)
class Failed:
    error: BaseException


@dataclass(frozen=True, slots=True)
class Cut:
    reason: str  # stopped from outside (the server is shutting down): the answer says why


class Outbox:
    """Events the worker thread produced since the last ``flush``, in order, per event loop;
    ``flush`` hands each loop its list in one ``call_soon_threadsafe``."""

    def __init__(self) -> None:
        self._items: dict[asyncio.AbstractEventLoop, list[tuple[Job, object]]] = {}

    def put(self, job: Job, event: object) -> None:
        self._items.setdefault(job.loop, []).append((job, event))

    def flush(self) -> None:
        items, self._items = self._items, {}
        for loop, events in items.items():
            try:
                loop.call_soon_threadsafe(_dispatch, events)
            except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
                for job, _ in events:
                    job.cancelled.set()


def _dispatch(events: list[tuple[Job, object]]) -> None:
    for job, event in events:
        job.events.put_nowait(event)


@dataclass(slots=True)
class Job:
    id: str
    request: Request
    stops: Sequence[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued: float = field(default_factory=time.monotonic)
    outbox: Outbox | None = None  # set by the worker when it admits the job (before any event)

    def emit(self, event: Piece | Done | Failed) -> None:
        """From the worker thread: the event goes out with the step's others (``Outbox``)."""
        self.outbox.put(self, event)


class _Active:
    """A job the engine is running: its sequence and the text state of its answer."""

    def __init__(self, job: Job, seq, tokenizer, started: float) -> None:
        self.job = job
        self.seq = seq
        self.dec = tokenizer.stream_decoder()
        self.stops = StopMatcher(job.stops)
        # (start, end) of each token's text in the produced text, for tokens not yet shown
        self.pending: deque[tuple[int, int, TokenLogprobs]] = deque()
        self.produced = self.emitted = 0
        self.shown_text: list[str] = []  # what the client got, for closing truncated JSON
        self.json_out = any(isinstance(p, Constrained) for p in job.request.logits_processors)
        self.t0 = started
        self.t_first: float | None = None
        self.finish: str | None = None  # set when the answer is over (stop string, cancel)
        self.n_tokens = 0  # the request's output tokens handed to ``token`` so far

    def token(self, token: int, last: bool) -> None:
        """The engine chose ``token`` for this job (``last``: its final one, StepOutput.final):
        its text (after stop strings) to the client. Tokens come in output order; the request
        may already hold later ones when a step chose several."""
        req = self.job.request
        i = self.n_tokens
        self.n_tokens += 1
        if self.t_first is None:
            self.t_first = time.monotonic()
        eog = last and req.finish_reason == "stop"  # an end-of-generation token: no text
        piece = ("" if eog else self.dec.feed(token)) + (self.dec.flush() if last else "")
        if req.top_logprobs is not None and not eog:
            self.pending.append((self.produced, self.produced + len(piece), req.token_logprobs[i]))
        self.produced += len(piece)
        text = self.stops.feed(piece)
        if last and not self.stops.stopped:
            text += self.stops.flush()  # text held back as a possible stop string's start
        self.emitted += len(text)
        if self.json_out:
            self.shown_text.append(text)
        shown = _release(self.pending, self.emitted, self.stops.stopped, last)
        if text or shown:
            self.job.emit(Piece(text, shown))
        if self.stops.stopped:
            self.finish = "stop"


class EngineWorker:
    """One thread owns the engine (deimos.engine.Engine): it admits submitted jobs at step
    boundaries, steps the engine while any sequence runs, hands every chosen token to its
    job, and frees a cancelled job's sequence at the next step."""

    def __init__(self, llm: LLM, metrics: Metrics, max_queue: int = 64) -> None:
        self.llm = llm
        self.engine = llm.engine
        self.metrics = metrics
        self.max_queue = max_queue
        self._inbox: queue.Queue[Job | None] = queue.Queue()
        self._active: dict[int, _Active] = {}
        self._outbox = Outbox()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="deimos-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._inbox.put(None)
        self._thread.join(timeout=5)

    @property
    def queued(self) -> int:
        """Jobs not running yet: in the inbox, or admitted and waiting in the engine's queue
        (read from other threads: a snapshot)."""
        return self._inbox.qsize() + len(self.engine.scheduler.waiting)

    def submit(self, job: Job) -> None:
        if self.queued >= self.max_queue:
            raise QueueFull(f"{self.queued} requests are already waiting")
        self._inbox.put(job)
        self.metrics.set_queued(self.queued)

    # ---- the loop ----------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop:
            try:
                self._admit(block=not self.engine.has_work)
                self._cancel()
                self._outbox.flush()  # refusals and cancellations before the step runs
                outs = self.engine.step()
                for out in outs:
                    self._deliver(out)
                self._outbox.flush()  # the step's tokens, one wake-up for each event loop
                self._report()
            except Exception as e:  # noqa: BLE001 - the worker outlives any one step
                log.error("engine worker: %s", e, exc_info=True)
                for a in list(self._active.values()):
                    self._fail(a, EngineError(f"the engine failed: {type(e).__name__}: {e}"))
            finally:
                self._outbox.flush()

    def _admit(self, block: bool) -> None:
        while True:
            try:
                job = self._inbox.get(block=block, timeout=None if block else 0)
            except queue.Empty:
                return
            block = False
            if job is None:
                self._stop = True
                return
            if job.cancelled.is_set():  # its client left while it waited
                continue
            job.outbox = self._outbox
            self.metrics.start(job.id, len(job.request.prompt_ids))
            try:
                seq = self.engine.add(job.request)
            except Exception as e:  # noqa: BLE001 - a refused request fails alone
                log.debug("request %s refused: %s", job.id, e, exc_info=True)
                self._record_failure(job)
                job.emit(Failed(e))
                continue
            a = _Active(job, seq, self.llm.tokenizer, time.monotonic())
            if seq.finished:  # max_tokens 0
                self._done(a)
            else:
                self._active[seq.id] = a

    def _cancel(self) -> None:
        for a in list(self._active.values()):
            if a.job.cancelled.is_set() and a.finish is None:
                a.finish = "cancelled"
            if a.finish is not None:
                self.engine.cancel(a.seq)
                self._done(a)

    def _deliver(self, out) -> None:
        a = self._active.get(out.seq.id)
        if a is None:
            return
        if out.error is not None:
            self._fail(a, out.error)
            return
        a.token(out.token, out.final)
        self.metrics.progress(a.job.id, a.job.request.cached_tokens,
                              len(a.job.request.output_ids))
        if a.finish is not None:  # a stop string: the sequence ends now
            self.engine.cancel(a.seq)
        if a.finish is not None or out.final:
            self._done(a)

    def _report(self) -> None:
        st = self.engine.stats()
        self.metrics.set_queued(self.queued)
        set_engine = getattr(self.metrics, "set_engine", None)
        if set_engine is not None:
            set_engine(st)

    def _record_failure(self, job: Job) -> None:
        self.metrics.finish(job.id, Finished(len(job.request.prompt_ids), 0, 0, 0.0, 0.0, 0.0,
                                             "error"), 0.0, 0.0, False)

    def _fail(self, a: _Active, err: BaseException) -> None:
        self._active.pop(a.seq.id, None)
        self.engine.cancel(a.seq)
        log.debug("request %s failed: %s", a.job.id, err)
        self._record_failure(a.job)
        a.job.emit(Failed(err))

    def _done(self, a: _Active) -> None:
        self._active.pop(a.seq.id, None)
        req = a.job.request
        t_end = time.monotonic()
        finish = a.finish or req.finish_reason or "length"
        if finish == "error":
            finish = "length"
        if a.json_out and finish == "length":  # cut mid-value: closed so that it parses
            tail = closure("".join(a.shown_text))
            if tail:
                a.job.emit(Piece(tail, []))
        first = a.t_first if a.t_first is not None else t_end
        # the tokens delivered: a stop string ends the answer there, whatever the step chose after
        done = Done(finish, len(req.prompt_ids), req.cached_tokens, a.n_tokens,
                    first - a.t0, first - a.t0, t_end - first, a.t0 - a.job.enqueued)
        n = done.completion_tokens
        computed = done.prompt_tokens - done.cached_tokens
        self.metrics.finish(
            a.job.id,
            Finished(done.prompt_tokens, done.cached_tokens, n, done.ttft_s,
                     computed / done.prefill_s if done.prefill_s > 0 else 0.0,
                     (n - 1) / done.decode_s if n > 1 and done.decode_s > 0 else 0.0, finish),
            done.prefill_s, done.decode_s, finish == "cancelled")
        a.job.emit(done)


def _release(pending: deque[tuple[int, int, TokenLogprobs]], emitted: int, cut: bool,
             last: bool) -> list[TokenLogprobs]:
    """Logprobs of the tokens whose text is now shown: those ending within the ``emitted``
    characters; at a stop string (``cut``) also one straddling the cut, and none after it;
    at the end of generation all of them."""
    out = []
    while pending and (last or pending[0][1] <= emitted or (cut and pending[0][0] < emitted)):
        out.append(pending.popleft()[2])
    if cut:
        pending.clear()
    return out
