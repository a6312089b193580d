"""The engine worker's outbox (deimos.server.worker.Outbox): a step's events reach each job's
queue in order, with one wake-up of each event loop a flush; a closed loop cancels its jobs."""

from __future__ import annotations

import asyncio
import threading

from deimos.engine.request import Request
from deimos.kernels.sampling import SamplingParams
from deimos.server.worker import Job, Outbox


def _job(name: str, loop: asyncio.AbstractEventLoop, outbox: Outbox) -> Job:
    req = Request([1, 2], 4, SamplingParams(temperature=0))
    return Job(id=name, request=req, stops=(), loop=loop, outbox=outbox)


def test_a_flush_wakes_each_loop_once_and_keeps_each_jobs_order():
    async def go():
        loop = asyncio.get_running_loop()
        calls = []
        real = loop.call_soon_threadsafe

        def counted(*args):
            calls.append(args[0])
            return real(*args)

        loop.call_soon_threadsafe = counted
        box = Outbox()
        a, b = _job("a", loop, box), _job("b", loop, box)
        t = threading.Thread(target=lambda: ([j.emit(f"{j.id}{i}") for i in range(3) for j in (a, b)],
                                             box.flush()))
        t.start()
        t.join()
        got = {j.id: [await asyncio.wait_for(j.events.get(), 5) for _ in range(3)] for j in (a, b)}
        assert got == {"a": ["a0", "a1", "a2"], "b": ["b0", "b1", "b2"]}
        assert len(calls) == 1  # six events, one wake-up
        box.flush()  # nothing left: no wake-up
        assert len(calls) == 1
        return a, b

    asyncio.run(go())


def test_a_closed_loop_cancels_its_jobs():
    loop = asyncio.new_event_loop()
    box = Outbox()
    job = _job("c", loop, box)
    loop.close()
    job.emit("x")
    assert not job.cancelled.is_set()  # held until the flush
    box.flush()
    assert job.cancelled.is_set()
