"""The elastic expert cache's bookkeeping: which routed experts have a slot on the device.

Per MoE layer a number of slots, each holding one expert's packed weights (every array of its
deimos.quant.triton.layout ``PackedWeight`` parts, e.g. gate, up, down), and

- ``slot_of`` int32 ``[E]`` on the device: expert e's slot, -1 when not resident. Updated in
  place (a copy into the same tensor), so a captured CUDA graph reads the current table;
  ``slot_of_host`` is its host mirror, what the device sees once the work enqueued so far runs.
- storage in CHUNKS: one allocation (uint8) holds ``slots_per_chunk`` slots' rows of every
  array, carved into typed views; slot s = row block s % spc of chunk s // spc. Shrinking drops
  whole chunks and calls ``torch.cuda.empty_cache()``, so the memory goes back to the driver.
  ``chunk_ptrs[(part, array)]`` (int64 ``[max chunks]`` on the device, updated in place, 0 for
  no chunk) gives kernels each chunk's base address: row block j of chunk c starts at
  ``chunk_ptrs[c] + j * r * row_bytes``.
- a policy (``POLICIES``) fed by ``record(layer, ids)`` (a step's routed ids, host) that picks
  the victim of ``promote(layer, expert)`` and what ``resize`` keeps.

``fill`` places experts into free slots on the current stream (a prompt chunk's misses, which
it copies to the device anyway: the first prompt fills the cache). Promotion copies from a
host copy of every expert (``HostExperts``; pinned when CUDA is
present) asynchronously on a side stream when one is given: ``promote`` evicts the victim
(its -1 published on the current stream first), makes the side stream wait for the current
one (a kernel still reading the old slot finishes before the copy overwrites it), starts the
copy and returns; ``poll()`` between steps publishes every copy that has finished. Without a
stream (CPU tests) the copy is synchronous and still published by ``poll()``.
``promote_batch`` does the same for a step's promotions in every layer with one copy kernel
(the decode steps' way: a copy-engine call per array cost the host ~0.4 ms a promotion).

Policy, from measured hit rates (tests/test_expert_cache.py::test_policy_hit_rates: the real
LayerCache over synthetic routing traces of 600 steps, 128 experts, 8 a token, popularity
Zipf(s) over the experts, each of a sequence's last experts kept with probability r, a quarter
of the popularity ranks reshuffled every 200 steps; hit rate after 100 steps of warm-up;
promotions unlimited or 2 a step, the PCIe budget of a decode step):

    trace (batch, s, r)   slots  promote   lru    lfu    hybrid
    1, 0.8, 0.3             32     all    0.618  0.662  0.674
    1, 0.8, 0.3             32      2     0.582  0.632  0.646
    1, 0.8, 0.3             64      2     0.780  0.803  0.807
    1, 1.1, 0.5             32      2     0.770  0.787  0.818
    8, 0.8, 0.3             32      2     0.574  0.592  0.598
    8, 0.8, 0.3             64     all    0.791  0.812  0.829
    8, 1.1, 0.5             32     all    0.706  0.743  0.769
    8, 1.1, 0.5             64      2     0.865  0.871  0.885

``hybrid`` (LFU with a 64-step half-life, the latest step's experts never the victim) is best
or level on all 16 cases the test runs (mean 0.781; lfu 0.768, lru 0.746), so it is the
default. Real routing traces may rank them otherwise: the stats (``ExpertCache.stats``) show
the live hit rate. One caller at a time (the engine's thread).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from deimos.kernels.copy_ranges import by_word
from deimos.quant.triton.layout import PackedWeight

POLICIES = ("lru", "lfu", "hybrid")
DEFAULT_POLICY = "hybrid"
HALF_LIFE = 64.0  # steps for a decayed use count to halve (lfu, hybrid)
CHUNK_ALIGN = 256  # bytes: each array's view in a chunk starts on this boundary


# ---- policies -----------------------------------------------------------------------------------


class Policy:
    """Use statistics of one layer's E experts. ``value()`` ranks experts (higher = keep);
    ``admit(candidate, victim)`` says whether a miss may take the victim's slot."""

    name = "?"

    def __init__(self, n_expert: int, half_life: float = HALF_LIFE):
        self.n_expert = n_expert
        self.step = 0
        self.last = np.full(n_expert, -1.0)  # step of last use
        self.freq = np.zeros(n_expert)  # use count, decayed by half every half_life steps
        self.decay = 0.5 ** (1.0 / half_life)

    def record(self, ids: np.ndarray) -> None:
        counts = np.bincount(ids.reshape(-1), minlength=self.n_expert)
        self.freq *= self.decay
        self.freq += counts
        self.step += 1
        self.last[counts > 0] = self.step

    def value(self) -> np.ndarray:
        raise NotImplementedError

    def admit(self, candidate: int, victim: int) -> bool:
        return True


class LRU(Policy):
    """Least recently used out; every miss admitted."""

    name = "lru"

    def value(self) -> np.ndarray:
        return self.last


class LFU(Policy):
    """Lowest decayed use count out (recency breaks ties); every miss admitted."""

    name = "lfu"

    def value(self) -> np.ndarray:
        return self.freq + 1e-9 * self.last


class Hybrid(LFU):
    """LFU's order, but the experts of the latest recorded step are never the victim (while
    others are resident): routing repeats itself from one token to the next, so an expert just
    used is worth keeping whatever its count (LRU's one good idea), and among the rest the
    decayed count decides. (Tried and dropped: admitting a miss only when its count passes the
    victim's, 2-10 points worse on every trace: the newcomer is usually reused next step.)"""

    name = "hybrid"

    def value(self) -> np.ndarray:
        return self.freq + 1e-9 * self.last + 1e9 * (self.last == self.step)


_POLICY_CLASSES = {c.name: c for c in (LRU, LFU, Hybrid)}


def make_policy(name: str, n_expert: int, half_life: float = HALF_LIFE) -> Policy:
    if name not in _POLICY_CLASSES:
        raise ValueError(f"expert cache: policy must be one of {POLICIES}, got {name!r}")
    return _POLICY_CLASSES[name](n_expert, half_life)


# ---- host copy and slot copies ------------------------------------------------------------------


class HostExperts:
    """One layer's every expert in its packed layout, on the host: ``parts`` maps a part name
    (e.g. "gate", "up", "down") to a stacked ``PackedWeight`` of ``E * r`` rows, expert e =
    rows ``e r .. e r + r - 1`` (``layout.pack`` of the 3-D tensor's bytes as [E * n_out,
    row_bytes] gives exactly this). ``pin``: page-locked (default: when CUDA is present), so
    that copies to the device are asynchronous."""

    def __init__(self, parts: dict[str, PackedWeight], n_expert: int, pin: bool | None = None):
        if not parts:
            raise ValueError("HostExperts: no parts")
        if pin is None:
            pin = torch.cuda.is_available()
        self.n_expert = n_expert
        self.rows: dict[str, int] = {}
        self.arrays: dict[str, dict[str, torch.Tensor]] = {}
        for name, w in parts.items():
            if w.n % n_expert:
                raise ValueError(f"HostExperts: part {name!r} has {w.n} rows, not {n_expert} experts' worth")
            r = w.n // n_expert
            self.rows[name] = r
            arrays = {}
            for a, t in sorted(w.tensors.items()):
                if t.device.type != "cpu" or t.shape[0] != w.n:
                    raise ValueError(f"HostExperts: {name}.{a} must be a CPU tensor of {w.n} rows")
                t = t.contiguous().view(n_expert, r, *t.shape[1:])
                arrays[a] = t.pin_memory() if pin else t
            self.arrays[name] = arrays
        self.parts = {name: (w.ggml_type, w.k) for name, w in parts.items()}

    def expert(self, e: int) -> dict[str, dict[str, torch.Tensor]]:
        """Expert e's rows of every array: part -> array -> [r, ...] (views)."""
        return {p: {a: t[e] for a, t in arrays.items()} for p, arrays in self.arrays.items()}

    @property
    def expert_nbytes(self) -> int:
        return sum(t[0].numel() * t.element_size() for arrays in self.arrays.values() for t in arrays.values())


def copy_expert(host: HostExperts, expert: int, dst: dict[str, dict[str, torch.Tensor]],
                stream: torch.cuda.Stream | None = None) -> torch.cuda.Event | None:
    """Copy expert ``expert``'s rows into ``dst`` (part -> array -> a slot's views). With a CUDA
    ``stream``: enqueued there, non-blocking (pinned source), and an event recorded after it
    is returned; otherwise the copy is done when this returns (None)."""
    src = host.expert(expert)
    if stream is None:
        copy_arrays(dst, src, non_blocking=False)
        return None
    with torch.cuda.stream(stream):
        copy_arrays(dst, src, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(stream)
    return ev


def copy_arrays(dst: dict[str, dict[str, torch.Tensor]], src: dict[str, dict[str, torch.Tensor]],
                non_blocking: bool) -> None:
    """Every array of ``dst`` (part -> array -> tensor) from ``src``'s, in one call: the host's
    cost of a slot's ~10 copies is one dispatch, not ten (prompt fills, resizes and eager
    steps' promotions; a captured decode step's go through ``ExpertCache.promote_batch``)."""
    pairs = [(t, src[p][a]) for p, arrays in dst.items() for a, t in arrays.items()]
    torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs], non_blocking=non_blocking)


# ---- one layer ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _View:
    part: str
    array: str
    dtype: torch.dtype
    row_shape: tuple[int, ...]
    rows: int  # per slot
    offset: int  # bytes into the chunk
    nbytes: int  # the whole chunk's rows of this array


class LayerCache:
    """One layer's slots (module docstring). ``n_slots`` usable slots in whole chunks."""

    def __init__(self, host: HostExperts, n_slots: int, device: str | torch.device, *,
                 policy: str = DEFAULT_POLICY, slots_per_chunk: int = 4, half_life: float = HALF_LIFE):
        if slots_per_chunk < 1:
            raise ValueError(f"expert cache: slots_per_chunk must be >= 1, got {slots_per_chunk}")
        self.host = host
        self.device = torch.device(device)
        self.n_expert = host.n_expert
        self.spc = slots_per_chunk
        self.max_chunks = -(-self.n_expert // slots_per_chunk)
        self.policy = make_policy(policy, self.n_expert, half_life)
        self.views: list[_View] = []
        off = 0
        for p, arrays in host.arrays.items():
            for a, t in arrays.items():
                r = host.rows[p]
                nb = slots_per_chunk * r * t[0, 0].numel() * t.element_size()
                self.views.append(_View(p, a, t.dtype, tuple(t.shape[2:]), r, off, nb))
                off += -(-nb // CHUNK_ALIGN) * CHUNK_ALIGN
        self.chunk_nbytes = off
        self.slot_nbytes = host.expert_nbytes
        self.slot_of = torch.full((self.n_expert,), -1, dtype=torch.int32, device=self.device)
        self.slot_of_host = np.full(self.n_expert, -1, dtype=np.int32)
        self.chunk_ptrs = {(v.part, v.array): torch.zeros(self.max_chunks, dtype=torch.int64, device=self.device)
                           for v in self.views}
        self._chunks: list[torch.Tensor] = []
        self._chunk_views: list[dict[tuple[str, str], torch.Tensor]] = []
        self.expert_in = np.full(self.max_chunks * slots_per_chunk, -1, dtype=np.int32)  # slot -> expert
        self.pending: dict[int, tuple[int, torch.cuda.Event | None]] = {}  # slot -> (expert, event)
        self.hits = self.misses = self.promotions = self.declined = 0
        self._staging = _Publisher(self.device)
        self.n_slots = 0
        self.resize(n_slots)

    # -- state ------------------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        return len(self._chunks) * self.chunk_nbytes

    @property
    def resident(self) -> np.ndarray:
        """Experts with a published slot."""
        return np.flatnonzero(self.slot_of_host >= 0)

    def slot_arrays(self, slot: int) -> dict[str, dict[str, torch.Tensor]]:
        """Slot ``slot``'s views: part -> array -> [r, ...] on the device."""
        c, j = divmod(slot, self.spc)
        out: dict[str, dict[str, torch.Tensor]] = {}
        for v in self.views:
            out.setdefault(v.part, {})[v.array] = self._chunk_views[c][(v.part, v.array)][j * v.rows:(j + 1) * v.rows]
        return out

    def slot_weight(self, slot: int, part: str) -> PackedWeight:
        t, k = self.host.parts[part]
        arrays = self.slot_arrays(slot)[part]
        return PackedWeight(t, self.host.rows[part], k, arrays)

    # -- statistics -------------------------------------------------------------------------------

    def record(self, ids: np.ndarray) -> None:
        """A step's routed expert ids (host, any shape): hit/miss counts against the published
        table, then the policy's statistics."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.n_expert):
            raise ValueError(f"expert cache: an expert id outside [0, {self.n_expert})")
        hit = int((self.slot_of_host[ids] >= 0).sum())
        self.hits += hit
        self.misses += ids.size - hit
        self.policy.record(ids)

    # -- promotion --------------------------------------------------------------------------------

    def promote(self, expert: int, stream: torch.cuda.Stream | None = None) -> bool:
        """Start copying ``expert`` into a slot: a free one, else the policy's victim. False
        when it is resident or on its way already, or there are no slots."""
        return bool(self.promote_many([expert], stream))

    def promote_many(self, experts: Sequence[int], stream: torch.cuda.Stream | None = None) -> list[int]:
        """``promote`` for several experts (in order) with one publication of their victims'
        evictions; returns the experts whose copies started."""
        claimed = self.claim_many(experts)
        if claimed and stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        for e, slot in claimed:
            self.started(e, slot, copy_expert(self.host, e, self.slot_arrays(slot), stream))
        return [e for e, _ in claimed]

    def started(self, expert: int, slot: int, event: torch.cuda.Event | None) -> None:
        """A claimed slot's copy is under way (``event``: recorded after it; None: done): the
        slot is pending until ``poll`` publishes it."""
        self.pending[slot] = (expert, event)
        self.promotions += 1

    def claim_many(self, experts: Sequence[int]) -> list[tuple[int, int]]:
        """A slot for each of ``experts`` (in order) that is neither resident nor on its way:
        a free one, else the policy's victim, evicted (the evictions published on the current
        stream before this returns). Returns (expert, slot) pairs, whose copies the caller
        starts and then marks ``pending`` (``promote_many``, ``ExpertCache.promote_batch``)."""
        claimed: list[tuple[int, int]] = []
        evicted = False
        for e in experts:
            got = self._claim(int(e), claimed)
            if got is not None:
                claimed.append((int(e), got[0]))
                evicted |= got[1]
        if evicted:  # the victims' -1 reach the device before their slots are overwritten
            self._publish()
        return claimed

    def ranges(self, expert: int, slot: int) -> list[tuple[int, int, int]]:
        """(host address, device address, bytes) of each array of ``expert``'s copy into
        ``slot``: contiguous on both sides (an expert's rows of an array; a slot's row block)."""
        c, j = divmod(slot, self.spc)
        out = []
        for v in self.views:
            src = self.host.arrays[v.part][v.array]
            n = src[0].numel() * src.element_size()
            out.append((src.data_ptr() + expert * n, self._chunk_views[c][(v.part, v.array)].data_ptr() + j * n, n))
        return out

    def free_slots(self) -> list[int]:
        """Usable slots holding no expert and no copy on its way."""
        return [int(s) for s in np.flatnonzero(self.expert_in[: self.n_slots] < 0) if int(s) not in self.pending]

    def best_missing(self, n: int) -> list[int]:
        """The ``n`` experts the policy values most among those neither resident nor on their
        way (for free slots: ``ExpertOffload``'s fill after a growth)."""
        value = self.policy.value().astype(np.float64)
        value[self.slot_of_host >= 0] = -np.inf
        coming = [e for e, _ in self.pending.values()]
        value[coming] = -np.inf
        order = np.argsort(-value, kind="stable")[: max(0, n)]
        return [int(e) for e in order if np.isfinite(value[e])]

    def fill(self, experts: Sequence[int]) -> list[int]:
        """Place ``experts`` (in order) into free slots, no eviction, the copies enqueued on the
        current stream (non-blocking from the pinned host copy) so that kernels enqueued after
        read them, and published at once. For a prompt chunk's missed experts, which the chunk
        copies to the device anyway. Returns the experts placed."""
        free = self.free_slots()
        coming = {e for e, _ in self.pending.values()}
        placed: list[int] = []
        for e in experts:
            e = int(e)
            if not free:
                break
            if not 0 <= e < self.n_expert:
                raise ValueError(f"expert cache: expert {e} outside [0, {self.n_expert})")
            if self.slot_of_host[e] >= 0 or e in coming or e in placed:
                continue
            slot = free.pop(0)
            copy_arrays(self.slot_arrays(slot), self.host.expert(e), non_blocking=self.device.type == "cuda")
            self.slot_of_host[e] = slot
            self.expert_in[slot] = e
            placed.append(e)
        if placed:
            self._publish()
        return placed

    def _claim(self, expert: int, claimed: list[tuple[int, int]]) -> tuple[int, bool] | None:
        """(slot, whether a victim was evicted) for ``expert``, or None; ``claimed``: (expert,
        slot) pairs taken by this call already."""
        if not 0 <= expert < self.n_expert:
            raise ValueError(f"expert cache: expert {expert} outside [0, {self.n_expert})")
        busy = [*self.pending.values(), *claimed]
        if self.slot_of_host[expert] >= 0 or any(e == expert for e, _ in busy):
            return None
        free = np.flatnonzero(self.expert_in[: self.n_slots] < 0)
        free = free[~np.isin(free, [*self.pending, *(s for _, s in claimed)])]
        if free.size:
            return int(free[0]), False
        victims = self.resident
        if not victims.size:
            return None
        victim = int(victims[np.argmin(self.policy.value()[victims])])
        if not self.policy.admit(expert, victim):
            self.declined += 1
            return None
        slot = int(self.slot_of_host[victim])
        self.slot_of_host[victim] = -1
        self.expert_in[slot] = -1
        return slot, True

    def poll(self, wait: bool = False) -> int:
        """Publish every finished copy (all of them with ``wait``): their slots become visible
        to kernels enqueued from now on. Returns how many were published."""
        done = [s for s, (_, ev) in self.pending.items() if ev is None or wait or ev.query()]
        for s in done:
            e, ev = self.pending.pop(s)
            if ev is not None:
                torch.cuda.current_stream(self.device).wait_event(ev)
            self.slot_of_host[e] = s
            self.expert_in[s] = e
        if done:
            self._publish()
        return len(done)

    def _publish(self) -> None:
        self._staging.copy(self.slot_of_host, self.slot_of)

    # -- size -------------------------------------------------------------------------------------

    def resize(self, n_slots: int) -> None:
        """Make ``n_slots`` slots usable (at most E; rounded up to whole chunks of storage).
        Shrinking evicts the least valuable residents first, moves the kept ones out of the
        dropped chunks and frees those chunks (back to the driver on CUDA). Call between steps:
        it waits for pending copies and, on CUDA, for the device."""
        n_slots = max(0, min(int(n_slots), self.n_expert))
        self.poll(wait=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        resident = self.resident
        keep = resident[np.argsort(-self.policy.value()[resident], kind="stable")][:n_slots]
        for e in np.setdiff1d(resident, keep):
            self.expert_in[self.slot_of_host[e]] = -1
            self.slot_of_host[e] = -1
        need = -(-n_slots // self.spc)
        while len(self._chunks) < need:
            self._add_chunk()
        # compaction: every kept expert into a slot below n_slots
        for e in keep:
            s = int(self.slot_of_host[e])
            if s >= n_slots:
                dst = int(np.flatnonzero(self.expert_in[:n_slots] < 0)[0])
                src_v, dst_v = self.slot_arrays(s), self.slot_arrays(dst)
                for p in dst_v:
                    for a in dst_v[p]:
                        dst_v[p][a].copy_(src_v[p][a])
                self.expert_in[s] = -1
                self.expert_in[dst] = e
                self.slot_of_host[e] = dst
        self._publish()
        if len(self._chunks) > need:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the compaction copies read the dropped chunks
            del self._chunks[need:], self._chunk_views[need:]
            for t in self.chunk_ptrs.values():
                t[need:] = 0
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self.n_slots = n_slots

    def _add_chunk(self) -> None:
        c = len(self._chunks)
        buf = torch.empty(self.chunk_nbytes, dtype=torch.uint8, device=self.device)
        views = {}
        for v in self.views:
            t = buf[v.offset:v.offset + v.nbytes].view(v.dtype).view(self.spc * v.rows, *v.row_shape)
            views[(v.part, v.array)] = t
            self.chunk_ptrs[(v.part, v.array)][c] = t.data_ptr()
        self._chunks.append(buf)
        self._chunk_views.append(views)


class _Publisher:
    """Copies the host table into the device one, ordered on the current stream. On CUDA
    through a ring of pinned buffers, each reused only after its last copy has run (so the
    host never waits for the step in flight); elsewhere a plain copy."""

    RING = 16

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.i = 0
        self.bufs: list[torch.Tensor | None] = [None] * self.RING
        self.events: list[torch.cuda.Event | None] = [None] * self.RING

    def copy(self, host: np.ndarray, dev: torch.Tensor) -> None:
        src = torch.from_numpy(host)
        if not self.cuda:
            dev.copy_(src)
            return
        i, self.i = self.i, (self.i + 1) % self.RING
        if self.events[i] is not None:
            self.events[i].synchronize()
        if self.bufs[i] is None:
            self.bufs[i] = torch.empty(host.shape, dtype=src.dtype).pin_memory()
        self.bufs[i].copy_(src)
        dev.copy_(self.bufs[i], non_blocking=True)
        ev = self.events[i] = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))


# ---- every layer ------------------------------------------------------------------------------


def _by_layer(wanted: Sequence[tuple[int, int]]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i, e in wanted:
        out.setdefault(int(i), []).append(int(e))
    return out


class ExpertCache:
    """The cache of every MoE layer: ``layers[i]`` is layer i's ``LayerCache`` (its
    ``slot_of`` is what the layer's kernels read). ``n_slots`` slots per layer."""

    def __init__(self, hosts: Sequence[HostExperts], n_slots: int, device: str | torch.device, *,
                 policy: str = DEFAULT_POLICY, slots_per_chunk: int = 4, half_life: float = HALF_LIFE):
        self.layers = [LayerCache(h, n_slots, device, policy=policy, slots_per_chunk=slots_per_chunk,
                                  half_life=half_life) for h in hosts]
        self.device = torch.device(device)
        # promote_batch's descriptors (pinned, and their device copy) and its last copy's event
        self._desc_host: torch.Tensor | None = None
        self._desc_dev: torch.Tensor | None = None
        self._batch_event: torch.cuda.Event | None = None

    @property
    def n_slots(self) -> int:
        return self.layers[0].n_slots if self.layers else 0

    @property
    def slots_per_chunk(self) -> int:
        return self.layers[0].spc if self.layers else 1

    @property
    def slot_nbytes(self) -> int:
        """Device bytes one slot in every layer takes (one chunk's worth / slots_per_chunk)."""
        return sum(-(-lay.chunk_nbytes // lay.spc) for lay in self.layers)

    @property
    def nbytes(self) -> int:
        return sum(lay.nbytes for lay in self.layers)

    @property
    def max_slots(self) -> int:
        return max((lay.n_expert for lay in self.layers), default=0)

    def record(self, layer: int, ids_host: np.ndarray) -> None:
        self.layers[layer].record(ids_host)

    def promote(self, layer: int, expert: int, stream: torch.cuda.Stream | None = None) -> bool:
        return self.layers[layer].promote(expert, stream)

    def promote_many(self, layer: int, experts: Sequence[int], stream: torch.cuda.Stream | None = None) -> list[int]:
        return self.layers[layer].promote_many(experts, stream)

    def promote_batch(self, wanted: Sequence[tuple[int, int]],
                      stream: torch.cuda.Stream | None = None) -> list[tuple[int, int]]:
        """``promote`` for (layer, expert) pairs of any layers, with one launch: on CUDA with a
        side ``stream``, every claimed slot's ranges go to the device as one descriptor table
        and one copy kernel (deimos.kernels.triton.copy_ranges) reads them from the pinned host
        copy, after the current stream's work, under one event; the host's cost is a few tens
        of microseconds a promotion, not a copy-engine call per array (~0.3-0.5 ms a promotion
        measured in a decode step). While the last batch's copy is still running nothing is
        claimed (its descriptors are being read; a decode step is far longer than a batch's
        copy, so this only sheds load). Elsewhere the copies are made at once. Returns the
        (layer, expert) pairs whose copies started. ``batch_ready``, ``claim`` and
        ``start_batch`` are its parts, for a caller that claims layer by layer (a decode step
        claims each layer's promotion while the device computes the next layer)."""
        if not self.batch_ready():
            return []
        claims = [c for i, es in _by_layer(wanted).items() for c in self.claim(i, es)]
        self.start_batch(claims, stream)
        return [(i, e) for i, e, _ in claims]

    def batch_ready(self) -> bool:
        """Whether a batch may be claimed: the last batch's copy has run (always without one)."""
        return self._batch_event is None or self._batch_event.query()

    def claim(self, layer: int, experts: Sequence[int]) -> list[tuple[int, int, int]]:
        """Layer ``layer``'s slots for ``experts`` (``LayerCache.claim_many``: victims evicted
        and published now) as (layer, expert, slot), for ``start_batch``. Claims not started
        leave their slots free (nothing marks them pending)."""
        return [(layer, e, s) for e, s in self.layers[layer].claim_many(experts)]

    def start_batch(self, claims: Sequence[tuple[int, int, int]], stream: torch.cuda.Stream | None) -> None:
        """The copies of ``claims`` (from ``claim``, after ``batch_ready``): one descriptor
        upload and one copy kernel a load width on CUDA with ``stream``; else each expert's
        copy now (synchronous). Their slots are pending until ``poll`` publishes them."""
        if not claims:
            return
        if stream is None or self.device.type != "cuda":
            for i, e, s in claims:
                lay = self.layers[i]
                lay.started(e, s, copy_expert(lay.host, e, lay.slot_arrays(s), None))
            return
        from deimos.kernels.triton.copy_ranges import copy_ranges  # CUDA only: Triton's launch
        desc, groups = by_word(np.array([r for i, e, s in claims for r in self.layers[i].ranges(e, s)],
                                        dtype=np.int64))
        if self._desc_host is None or self._desc_host.shape[0] < desc.shape[0]:
            n = max(desc.shape[0], 64)
            self._desc_host = torch.empty((n, 3), dtype=torch.int64).pin_memory()
            with torch.cuda.stream(stream):  # made on the stream that reads it
                self._desc_dev = torch.empty((n, 3), dtype=torch.int64, device=self.device)
        self._desc_host[: desc.shape[0]].numpy()[...] = desc
        stream.wait_stream(torch.cuda.current_stream(self.device))  # readers of the victims first
        with torch.cuda.stream(stream):
            d = self._desc_dev[: desc.shape[0]]
            d.copy_(self._desc_host[: desc.shape[0]], non_blocking=True)
            for word, a, b in groups:  # one launch a load width
                copy_ranges(d[a:b], word, int(desc[a:b, 2].max()))
            ev = self._batch_event = torch.cuda.Event()
            ev.record(stream)
        for i, e, s in claims:
            self.layers[i].started(e, s, ev)

    def poll(self, wait: bool = False) -> int:
        return sum(lay.poll(wait) for lay in self.layers)

    def resize(self, n_slots: int) -> None:
        for lay in self.layers:
            lay.resize(n_slots)

    def stats(self) -> dict[str, float]:
        """Slots, bytes and counts for the dashboard and /metrics."""
        hits = sum(lay.hits for lay in self.layers)
        misses = sum(lay.misses for lay in self.layers)
        return {"slots": self.n_slots, "bytes": self.nbytes, "hits": hits, "misses": misses,
                "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
                "promotions": sum(lay.promotions for lay in self.layers),
                "declined": sum(lay.declined for lay in self.layers)}
