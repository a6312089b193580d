"""``deimos bench FILE --squeeze``: decode while another process takes memory mid-run.

A replay of ``requests`` greedy requests (one random prompt token, ``n_gen`` tokens each), one
after another through the engine. Before request ``take_before + 1`` (request 4 of 8) a helper
process (deimos.bench.memhold) starts taking ``take_gib`` (2 GiB) and rewrites it every
``rewrite_ms`` (250 ms) so the driver cannot page it; it is not waited for (the engine gives
memory back only between its steps, so waiting could deadlock on a full card): the moment it
holds its memory is read from its ready line and put on the timeline. With ``--release`` the
helper is ended before request ``release_before + 1`` (request 6 of 8: halfway through the rest),
and the expert cache is expected to grow back (gpu_memory.SlotSizer: after free memory has
stayed above the headroom for a second).

After every engine step the timeline samples the expert cache's slots (per layer), so the
report shows the slots over time, not only at request boundaries. Decode tokens/s of a phase
is its tokens over its requests' wall time (a request's time from its add to its last token,
as the bench's decode round). ``kept`` = squeezed / before.

``drive`` is the loop without the engine (a request runner, a slot reader and a helper factory
are passed in), so its bookkeeping runs on the CPU in the tests with a real helper process.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

TAKE_BEFORE = 3  # 0-based: the helper starts before request 4
TAKE_GIB = 2.0
REWRITE_MS = 250.0
REQUESTS = 8


@dataclass(frozen=True)
class SqueezePlan:
    requests: int = REQUESTS
    take_before: int = TAKE_BEFORE
    release_before: int | None = None
    take_gib: float = TAKE_GIB
    rewrite_ms: float = REWRITE_MS

    def __post_init__(self) -> None:
        if not 0 < self.take_before < self.requests:
            raise ValueError(f"squeeze: the take (before request {self.take_before + 1}) must "
                             f"fall inside the {self.requests} requests, after the first")
        if self.release_before is not None and not (
                self.take_before < self.release_before < self.requests):
            raise ValueError(f"squeeze: the release (before request {self.release_before + 1}) "
                             f"must come after the take and before the last request")
        if self.take_gib <= 0 or self.rewrite_ms < 0:
            raise ValueError(f"squeeze: take_gib {self.take_gib} must be > 0, rewrite_ms "
                             f"{self.rewrite_ms} >= 0")

    @classmethod
    def of(cls, requests: int = REQUESTS, release: bool = False, **kw) -> SqueezePlan:
        """The default timeline for ``requests``: take before request 4, release (if asked)
        halfway through the rest."""
        if requests < TAKE_BEFORE + 2 + release:
            raise ValueError(f"squeeze: {requests} requests are too few (at least "
                             f"{TAKE_BEFORE + 2 + release}: 3 before the take, 2 after it"
                             + (", 1 after the release" if release else "") + ")")
        rel = TAKE_BEFORE + max(1, (requests - TAKE_BEFORE) // 2) if release else None
        return cls(requests, TAKE_BEFORE, rel, **kw)

    def phase(self, i: int) -> str:
        if i < self.take_before:
            return "before"
        if self.release_before is None or i < self.release_before:
            return "squeezed"
        return "released"


@dataclass(frozen=True)
class RequestRecord:
    index: int
    phase: str  # before | squeezed | released
    start: float  # seconds since the replay began
    seconds: float
    tokens: int
    slots_start: int | None
    slots_end: int | None

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class SlotSample:
    t: float  # seconds since the replay began
    slots: int | None
    request: int
    free: int | None = None  # the device's free bytes as the cache's sizing read them
    headroom: int | None = None  # what the sizing keeps free (below it: shrink)


@dataclass(frozen=True)
class Event:
    t: float
    what: str  # "take" (helper started), "taken" (it holds), "release"
    detail: str = ""


@dataclass(frozen=True)
class SqueezeSummary:
    before_tps: float
    squeezed_tps: float
    kept: float  # squeezed / before
    released_tps: float | None
    slots_before: int | None  # at the end of the last request before the take
    slots_squeezed: int | None  # the fewest while squeezed
    slots_end: int | None  # at the end of the replay
    slots_regrown: int | None  # the most after the release
    regrow_s: float | None  # release -> the first sample back at slots_before
    taken_s: float | None  # take -> the helper holds its memory
    held_bytes: int | None


@dataclass
class SqueezeTimeline:
    plan: SqueezePlan
    requests: list[RequestRecord] = field(default_factory=list)
    samples: list[SlotSample] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    held_bytes: int | None = None
    rewrites: int | None = None

    def _phase_tps(self, phase: str) -> float | None:
        rs = [r for r in self.requests if r.phase == phase]
        secs = sum(r.seconds for r in rs)
        return sum(r.tokens for r in rs) / secs if rs and secs > 0 else None

    def _at(self, what: str) -> float | None:
        return next((e.t for e in self.events if e.what == what), None)

    def summary(self) -> SqueezeSummary:
        before, squeezed = self._phase_tps("before"), self._phase_tps("squeezed")
        if before is None or squeezed is None:
            raise ValueError("squeeze: the timeline lacks requests before or after the take")
        last_before = [r for r in self.requests if r.phase == "before"][-1]
        sq = [s.slots for s in self.samples if s.slots is not None
              and self.plan.phase(s.request) == "squeezed"]
        take, taken, release = self._at("take"), self._at("taken"), self._at("release")
        after = [s for s in self.samples if release is not None and s.t >= release
                 and s.slots is not None]
        target = last_before.slots_end
        back = next((s.t for s in after if target is not None and s.slots >= target), None)
        return SqueezeSummary(
            before_tps=before, squeezed_tps=squeezed, kept=squeezed / before,
            released_tps=self._phase_tps("released"), slots_before=target,
            slots_squeezed=min(sq) if sq else None,
            slots_end=self.requests[-1].slots_end if self.requests else None,
            slots_regrown=max(s.slots for s in after) if after else None,
            regrow_s=None if back is None else back - release,
            taken_s=None if take is None or taken is None else taken - take,
            held_bytes=self.held_bytes)

    def to_json(self) -> dict:
        d = asdict(self)
        d["summary"] = asdict(self.summary())
        return d


def drive(plan: SqueezePlan, run_request: Callable[[int, Callable[[], None]], int],
          slots: Callable[[], int | None], make_hold: Callable[[], object],
          clock: Callable[[], float] = time.monotonic,
          memory: Callable[[], tuple[int | None, int | None]] | None = None) -> SqueezeTimeline:
    """Runs the replay: ``run_request(i, after_step)`` runs request ``i`` to its end, calling
    ``after_step()`` after each engine step, and returns the tokens it made; ``slots()``: the
    cache's slots now (None without a cache); ``make_hold()``: a MemHold not yet started;
    ``memory()``: (free bytes, headroom) as the cache's sizing sees them, sampled with the
    slots. The helper is closed on the way out, whatever happens."""
    tl = SqueezeTimeline(plan)
    t0 = clock()
    hold = None
    seen_ready = False
    current = 0

    def after_step() -> None:
        nonlocal seen_ready
        now = clock() - t0
        free, room = memory() if memory is not None else (None, None)
        tl.samples.append(SlotSample(now, slots(), current, free, room))
        if hold is not None and not seen_ready and hold.held is not None:
            seen_ready = True
            tl.held_bytes = hold.held.held
            tl.events.append(Event(hold.held.at - t0, "taken",
                                   f"{hold.held.held / 2**30:.2f} GiB"
                                   + ("" if hold.held.full else
                                      f" (not all it asked for; stop={hold.held.stop or '?'}, "
                                      f"{hold.held.free_after / 2**30:.2f} GiB free then)")))

    try:
        for i in range(plan.requests):
            current = i
            if i == plan.take_before:
                hold = make_hold()
                hold.start()
                tl.events.append(Event(clock() - t0, "take", f"{plan.take_gib:g} GiB, rewritten "
                                                              f"every {plan.rewrite_ms:g} ms"))
            if plan.release_before is not None and i == plan.release_before and hold is not None:
                after_step()  # a ready line that came while the last request ran
                tl.rewrites = hold.close()
                tl.events.append(Event(clock() - t0, "release"))
            s0 = slots()
            start = clock()
            made = run_request(i, after_step)
            end = clock()
            tl.requests.append(RequestRecord(i, plan.phase(i), start - t0, end - start, made, s0,
                                             slots()))
        after_step()
    finally:
        if hold is not None:
            rw = hold.close()
            if tl.rewrites is None:
                tl.rewrites = rw
    return tl
