"""Free GPU memory, watched, and how many expert slots it pays for.

``nvml_reader(index)``: (free, total) bytes of torch's CUDA device ``index`` through NVML
(``pynvml``, from nvidia-ml-py; the whole card, every process), the NVML device found by the
torch device's UUID, else its PCI bus id, else CUDA_VISIBLE_DEVICES' entry. ``FreeMemory``
re-reads it at most every ``interval`` (0.1 s). Both take an injectable reader and clock.

``SlotSizer.target(current)`` is the sizing rule: the slots (per layer, whole chunks, at most
E) that fit in ``free + what the cache holds - headroom - band``, with hysteresis:

- shrink at once when free memory falls below the headroom (another process took memory);
- grow only when free memory has stayed above ``headroom + band`` for ``grow_after`` (1 s),
  and then leave ``band`` free, so that the cache settles between the two thresholds instead
  of resizing on every small change.

Headroom = the step's own transient bytes (``step_bytes``: what a step allocates outside the
cache and the CUDA-graph pool, e.g. an eager prefill chunk's activations; the engine knows
it) + 5% of the card, at least 512 MiB and at most 1 GiB: what the process allocates lazily
(cuBLAS/cuBLASLt workspaces, Triton's launch scratch, the caching allocator's rounding and
fragmentation) and what another process can take between two reads. 8 GiB card: 512 MiB;
from 20 GiB: 1 GiB. "The card" is the memory the engine had when the cache was sized (its
free memory then and what it held: ``card_bytes``), not the device's total: a big card
that another process fills but for 8 GiB leaves the engine an 8 GiB card's memory, and
gets its headroom (1 GiB there kept 0.5 GiB of an 8 GiB share idle: 4 slots a layer of
qwen3moe 30B-A3B, measured on an H100). Band = max(one chunk of every layer, 256 MiB).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

MIN_INTERVAL = 0.1  # seconds between two NVML reads
HEADROOM_FRACTION = 0.05
HEADROOM_MIN = 512 << 20
HEADROOM_MAX = 1 << 30
BAND_MIN = 256 << 20
GROW_AFTER = 1.0  # seconds free memory must stay above headroom + band before growing

Reader = Callable[[], tuple[int, int]]  # () -> (free bytes, total bytes)


def headroom(total: int, step_bytes: int = 0) -> int:
    """Bytes to leave free on a card of ``total`` bytes (module docstring)."""
    return step_bytes + min(max(int(HEADROOM_FRACTION * total), HEADROOM_MIN), HEADROOM_MAX)


class FreeMemory:
    """``free()``: the device's free bytes, re-read from ``reader`` at most every ``interval``
    seconds of ``clock``; ``total``: the card's bytes (from the first read)."""

    def __init__(self, reader: Reader, clock: Callable[[], float] = time.monotonic,
                 interval: float = MIN_INTERVAL):
        self.reader = reader
        self.clock = clock
        self.interval = interval
        self.reads = 0
        self._at: float | None = None
        self._free, self.total = self._read()

    def _read(self) -> tuple[int, int]:
        free, total = self.reader()
        self.reads += 1
        self._at = self.clock()
        return int(free), int(total)

    def free(self) -> int:
        if self._at is None or self.clock() - self._at >= self.interval:
            self._free, self.total = self._read()
        return self._free

    def stale(self) -> None:
        """The last reading no longer holds (this process just freed or took memory): the
        next ``free()`` reads again."""
        self._at = None


class SlotSizer:
    """The sizing rule with hysteresis (module docstring). ``slot_bytes``: device bytes of one
    slot in every layer (``ExpertCache.slot_nbytes``); ``chunk_slots``: slots are added and
    dropped in chunks of this many; ``max_slots``: E."""

    def __init__(self, memory: FreeMemory, slot_bytes: int, max_slots: int, *, chunk_slots: int = 1,
                 step_bytes: int = 0, grow_after: float = GROW_AFTER, card_bytes: int | None = None):
        if slot_bytes <= 0 or chunk_slots < 1 or max_slots < 0:
            raise ValueError(f"SlotSizer: slot_bytes {slot_bytes}, chunk_slots {chunk_slots}, "
                             f"max_slots {max_slots}")
        self.memory = memory
        self.slot_bytes = slot_bytes
        self.chunk_slots = chunk_slots
        self.max_slots = max_slots
        self.step_bytes = step_bytes
        self.grow_after = grow_after
        # the engine's card (module docstring): at most the device's
        self.card_bytes = self.memory.total if card_bytes is None else min(int(card_bytes), self.memory.total)
        self._above_since: float | None = None

    @property
    def headroom(self) -> int:
        return headroom(self.card_bytes, self.step_bytes)

    @property
    def band(self) -> int:
        return max(self.slot_bytes * self.chunk_slots, BAND_MIN)

    def fit(self, free: int, current: int) -> int:
        """Slots (whole chunks, 0..max_slots) that leave ``headroom + band`` free, counting the
        ``current`` slots' memory as ours to reuse."""
        spare = free + current * self.slot_bytes - self.headroom - self.band
        chunks = max(0, spare) // (self.slot_bytes * self.chunk_slots)
        return min(chunks * self.chunk_slots, self.max_slots)

    def target(self, current: int) -> int:
        """The slot count to resize to now (``current`` when nothing should change). A change
        marks the free-memory reading stale: the next call reads the card after the resize
        (on the reading from before a shrink, the calls in the next 0.1 s shrank again and
        again: 28 -> 16 -> 8 -> 0 slots in 0.13 s while 16 left the headroom free, H100)."""
        n = self._target(current)
        if n != current:
            self.memory.stale()
        return n

    def _target(self, current: int) -> int:
        free = self.memory.free()
        now = self.memory.clock()
        if free < self.headroom:
            self._above_since = None
            return min(current, self.fit(free, current))
        want = self.fit(free, current)
        if want <= current or free < self.headroom + self.band:
            self._above_since = None
            return current
        if self._above_since is None:
            self._above_since = now
        if now - self._above_since < self.grow_after:
            return current
        self._above_since = None
        return want


# ---- NVML ---------------------------------------------------------------------------------------


def visible_device(index: int, env: str | None) -> int | str:
    """The ``index``-th entry of CUDA_VISIBLE_DEVICES (``env``; None or empty: all devices):
    a physical index (int) or a UUID ("GPU-..." / "MIG-...")."""
    if not env:
        return index
    entries = [e.strip() for e in env.split(",") if e.strip()]
    if index >= len(entries):
        raise ValueError(f"CUDA_VISIBLE_DEVICES={env!r} has no device {index}")
    e = entries[index]
    return int(e) if e.isdigit() else e


def nvml_reader(index: int = 0) -> Reader | None:
    """(free, total) of torch's CUDA device ``index`` through NVML; None without pynvml, a
    driver or the device (then ``torch_reader``)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = _nvml_handle(pynvml, index)
        pynvml.nvmlDeviceGetMemoryInfo(handle)
    except Exception:  # noqa: BLE001 - not installed, no driver, no such device
        return None

    def read() -> tuple[int, int]:
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return int(info.free), int(info.total)

    return read


def torch_reader(index: int = 0) -> Reader:
    """(free, total) from the CUDA runtime (cudaMemGetInfo), the fallback."""
    import torch

    return lambda: torch.cuda.mem_get_info(index)


def _nvml_handle(nv: Any, index: int) -> Any:
    props = None
    try:
        import torch

        if torch.cuda.is_available() and index < torch.cuda.device_count():
            props = torch.cuda.get_device_properties(index)
    except Exception:  # noqa: BLE001 - a CPU build of torch
        props = None
    uuid = str(getattr(props, "uuid", "") or "")
    for name in ([uuid] if uuid.startswith(("GPU-", "MIG-")) else [f"GPU-{uuid}", f"MIG-{uuid}"]) if uuid else []:
        try:
            return nv.nvmlDeviceGetHandleByUUID(name)
        except nv.NVMLError:
            pass
    bus = getattr(props, "pci_bus_id", None)
    if bus is not None:
        dom, dev = getattr(props, "pci_domain_id", 0), getattr(props, "pci_device_id", 0)
        try:
            return nv.nvmlDeviceGetHandleByPciBusId(f"{dom:08x}:{bus:02x}:{dev:02x}.0")
        except nv.NVMLError:
            pass
    which = visible_device(index, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if isinstance(which, str):
        return nv.nvmlDeviceGetHandleByUUID(which)
    return nv.nvmlDeviceGetHandleByIndex(which)
