"""A request's ``n`` choices: one worker ``Job`` each, submitted together, their events merged.

    group = Choices("chatcmpl-...", [(request, stops), ...], loop)
    submit(server, group)                      # all of them, or none (app._submit)
    async for index, event in group.events(request, poll=True):
        ...
    group.close(shutdown)                      # cancels what still runs, stops the tracking

Every job's event queue is a ``_Tagged`` stand-in: the worker (and the drain's cut) put each
event there, and it lands in the group's one asyncio queue as ``(choice index, event)``, so a
handler waits on one queue however many choices run. Events of one choice keep their order
(``Piece``..., then one ``Done``/``Failed``/``Cut``); choices interleave as the engine decodes
them together.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from deimos.engine import Request
from deimos.server.worker import Cut, Done, Failed, Job, Piece

Event = Piece | Done | Failed | Cut

DISCONNECT_POLL_S = 0.25


class _Tagged:
    """What a job's ``events`` queue is asked for by its writers (``put_nowait``): each event
    goes to the group's queue with the job's choice index."""

    __slots__ = ("index", "queue")

    def __init__(self, index: int, queue: asyncio.Queue) -> None:
        self.index = index
        self.queue = queue

    def put_nowait(self, event: Event) -> None:
        self.queue.put_nowait((self.index, event))


class _Client(Protocol):
    async def is_disconnected(self) -> bool: ...


class _Tracker(Protocol):
    def untrack(self, job: Job) -> None: ...


class Choices:
    def __init__(self, rid: str, requests: Sequence[tuple[Request, Sequence[str]]],
                 loop: asyncio.AbstractEventLoop) -> None:
        """``rid``: the response's id; the jobs are ``rid`` (one choice) or ``rid-i``."""
        self.id = rid
        self.queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        one = len(requests) == 1
        self.jobs = [Job(rid if one else f"{rid}-{i}", req, list(stops), loop,
                         events=_Tagged(i, self.queue))  # type: ignore[arg-type]
                     for i, (req, stops) in enumerate(requests)]

    @property
    def n(self) -> int:
        return len(self.jobs)

    def cancel(self) -> None:
        """Every job still running ends at the engine's next step (a no-op for finished ones)."""
        for job in self.jobs:
            job.cancelled.set()

    def close(self, shutdown: _Tracker) -> None:
        self.cancel()
        for job in self.jobs:
            shutdown.untrack(job)

    async def events(self, client: _Client, poll: bool) -> AsyncIterator[tuple[int, Event]]:
        """(choice index, event) until every choice has its last event. ``poll``: also watch
        the client, and stop (cancelling every job) when it goes away; a streaming response
        learns of a disconnect by being cancelled instead."""
        open_ = set(range(self.n))
        while open_:
            if poll:
                try:
                    index, ev = await asyncio.wait_for(self.queue.get(), DISCONNECT_POLL_S)
                except TimeoutError:
                    if await client.is_disconnected():
                        self.cancel()
                        return
                    continue
            else:
                index, ev = await self.queue.get()
            if index not in open_:  # a drain's cut after the choice's own end
                continue
            if not isinstance(ev, Piece):
                open_.discard(index)
            yield index, ev
