"""The engine worker: one thread owns the ``LLM`` and runs one request at a time.

The generator has a single KV-cache slot, so generation is serialized: handlers ``submit`` a
``Job`` and read its events from an asyncio queue; the thread takes jobs in arrival order.
A job's ``cancelled`` flag (set when its client disconnects) is checked between tokens: the
generation stops at once and the slot goes to the next job.

Events a job receives, in order: any number of ``Piece``, then one ``Done`` or ``Failed``
(or, put there by the server's shutdown rather than the worker, one ``Cut``).
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


@dataclass(slots=True)
class Job:
    id: str
    request: Request
    stops: Sequence[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued: float = field(default_factory=time.monotonic)

    def emit(self, event: Piece | Done | Failed) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            self.cancelled.set()


class EngineWorker:
    def __init__(self, llm: LLM, metrics: Metrics, max_queue: int = 64) -> None:
        self.llm = llm
        self.metrics = metrics
        self.max_queue = max_queue
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="deimos-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)

    def submit(self, job: Job) -> None:
        if self._jobs.qsize() >= self.max_queue:
            raise QueueFull(f"{self._jobs.qsize()} requests are already waiting")
        self._jobs.put(job)
        self.metrics.set_queued(self._jobs.qsize())

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            self.metrics.set_queued(self._jobs.qsize())
            if job.cancelled.is_set():  # its client left while it waited
                continue
            try:
                self._run(job)
            except Exception as e:  # noqa: BLE001 - the worker outlives any one request
                log.debug("request %s failed: %s", job.id, e, exc_info=True)
                self.metrics.finish(Finished(len(job.request.prompt_ids), 0, 0, 0.0, 0.0, 0.0,
                                             "error"), 0.0, 0.0, False)
                job.emit(Failed(e))

    def _run(self, job: Job) -> None:
        req = job.request
        t0 = time.monotonic()
        self.metrics.start(job.id, len(req.prompt_ids))
        dec = self.llm.tokenizer.stream_decoder()
        stops = StopMatcher(job.stops)
        # (start, end) of each token's text in the produced text, for tokens not yet shown
        pending: deque[tuple[int, int, TokenLogprobs]] = deque()
        produced = emitted = 0
        shown_text: list[str] = []  # what the client got, for closing truncated JSON
        json_out = any(isinstance(p, Constrained) for p in req.logits_processors)
        t_first: float | None = None
        finish: str | None = None
        gen = self.llm.generator.run(req)
        try:
            for token in gen:
                if t_first is None:
                    t_first = time.monotonic()
                if job.cancelled.is_set():
                    finish = "cancelled"
                    break
                if req.finish_reason == "stop":  # an end-of-generation token: no text
                    break
                last = req.finish_reason == "length"
                piece = dec.feed(token) + (dec.flush() if last else "")
                if req.top_logprobs is not None:
                    pending.append((produced, produced + len(piece), req.token_logprobs[-1]))
                produced += len(piece)
                text = stops.feed(piece)
                if last and not stops.stopped:
                    text += stops.flush()
                emitted += len(text)
                if json_out:
                    shown_text.append(text)
                shown = _release(pending, emitted, stops.stopped, last)
                if text or shown:
                    job.emit(Piece(text, shown))
                self.metrics.progress(req.cached_tokens, len(req.output_ids))
                if stops.stopped:
                    finish = "stop"
                    break
        finally:
            gen.close()  # an abandoned generation leaves the cache consistent (see Generator)
        t_end = time.monotonic()
        finish = finish or req.finish_reason or "length"
        if json_out and finish == "length":  # cut mid-value: closed so that it parses
            tail = closure("".join(shown_text))
            if tail:
                job.emit(Piece(tail, []))
        first = t_first if t_first is not None else t_end
        done = Done(finish, len(req.prompt_ids), req.cached_tokens, len(req.output_ids),
                    first - t0, first - t0, t_end - first, t0 - job.enqueued)
        n = done.completion_tokens
        computed = done.prompt_tokens - done.cached_tokens
        self.metrics.finish(
            Finished(done.prompt_tokens, done.cached_tokens, n, done.ttft_s,
                     computed / done.prefill_s if done.prefill_s > 0 else 0.0,
                     (n - 1) / done.decode_s if n > 1 and done.decode_s > 0 else 0.0, finish),
            done.prefill_s, done.decode_s, finish == "cancelled")
        job.emit(done)


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
