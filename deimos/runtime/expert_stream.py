"""A long step's non-resident experts streamed to the GPU one layer ahead (prompt chunks of a
model whose experts live on the host: deimos.models.gpu.offload).

A prompt chunk of a few hundred tokens routes to nearly every expert of a layer (512 tokens x 8
of 128 experts leave an expert unchosen with probability (1 - 8/128)^512 ~ 0), so the
experts a layer's cache does not hold are copied to the device whatever the routing says:
which ones is known on the host (the cache's published table) before the layer runs. That
lets the copies run on a stream of their own while the device computes the layer before, in a
ring of staging buffers (two: layer i's copies overlap layer i - 1's compute), with no host
synchronisation on the step's path (before: the host waited for each layer's routing, then
copied the missed experts on the compute stream, so copy and compute took turns).

``ExpertStager.stage(layer_cache)`` enqueues, on its copy stream: the layer's non-resident
experts into the cache's free slots first (``LayerCache.fill``: the first prompt fills the
cache), the rest into the next staging buffer (one copy per array for each run of
consecutive expert ids), and the staged experts' slot table; it returns a ``Staged`` whose
``ready`` event the compute stream waits for. ``done(staged)`` marks the buffer free for
reuse once the compute enqueued so far has run. Without CUDA everything is done at once (the
tests' interpreter path).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from deimos.quant.triton.layout import PackedWeight
from deimos.runtime.expert_cache import LayerCache

RING = 2  # staging buffers: a layer's copies overlap the compute of the layer before
GROW_BYTES = 8 << 20  # a buffer grows in whole steps of this
ALIGN = 256  # bytes: each array's region in a buffer starts aligned


def runs(experts: np.ndarray) -> list[tuple[int, int, int]]:
    """(first expert, count, first staged index) of each run of consecutive ids in the sorted
    ``experts`` (staged index j holds experts[j])."""
    if not experts.size:
        return []
    breaks = np.flatnonzero(np.diff(experts) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [experts.size]))
    return [(int(experts[s]), int(e - s), int(s)) for s, e in zip(starts, ends)]


@dataclass
class Staged:
    """One layer's plan for a long step: ``experts`` staged (slot j of ``stacks`` = experts[j],
    through ``table``), ``placed`` into the cache's free slots; the compute waits for ``ready``
    (None: done already)."""

    experts: np.ndarray
    placed: np.ndarray
    table: torch.Tensor  # int32 [E]: staged index of each staged expert, -1 elsewhere
    stacks: dict[str, PackedWeight]
    ready: torch.cuda.Event | None
    ring: int


class ExpertStager:
    """Staging buffers and the copy stream of long steps (module docstring). A buffer is raw
    bytes carved per layer into its arrays (a Q4_K_M file's layers differ in the down
    projection's format: Q4_K or Q6_K)."""

    def __init__(self, device: torch.device, buffer_bytes: int):
        """``buffer_bytes``: each ring buffer's size when first made (``peak_bytes // RING``:
        it never grows after, so what it holds is what the cache's sizing kept free for it)."""
        self.device = torch.device(device)
        self.buffer_bytes = buffer_bytes
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.turn = 0
        self.buffers: list[torch.Tensor | None] = [None] * RING
        self.free: list[torch.cuda.Event | None] = [None] * RING  # the last compute reading buffer k
        self.tables: list[torch.Tensor | None] = [None] * RING  # pinned int32 [E]: buffer k's table
        self.table_copied: list[torch.cuda.Event | None] = [None] * RING

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers if b is not None)

    @classmethod
    def peak_bytes(cls, layers: list[LayerCache]) -> int:
        """The most the buffers take: every ring buffer grown to a layer's whole set of experts
        (a prompt chunk with no expert of the layer resident), whole GROW_BYTES steps. The
        expert cache's sizing keeps this free (models.gpu.offload), so that the first prompt
        does not make the cache shrink to make room for it."""
        most = max((cls._layout(lay, lay.n_expert)[1] for lay in layers), default=0)
        return RING * -(-most // GROW_BYTES) * GROW_BYTES

    def release(self) -> None:
        """Give the buffers back, to the driver too (free memory as NVML reads it: the cache's
        sizing then sees the bytes it counted free again)."""
        for ev in self.free:
            if ev is not None:
                ev.synchronize()
        self.buffers = [None] * RING
        self.free = [None] * RING
        if self.cuda:
            torch.cuda.empty_cache()

    @staticmethod
    def _layout(lay: LayerCache, n: int) -> tuple[list[tuple[str, str, int, int]], int]:
        """(part, array, byte offset, bytes) of each array for n staged experts, and the total."""
        out, off = [], 0
        for p, arrays in lay.host.arrays.items():
            for a, src in arrays.items():
                nb = n * src[0].numel() * src.element_size()
                out.append((p, a, off, nb))
                off += -(-nb // ALIGN) * ALIGN
        return out, off

    def _buffer(self, k: int, nbytes: int) -> torch.Tensor:
        buf = self.buffers[k]
        if buf is not None and buf.numel() >= nbytes:
            return buf
        if self.free[k] is not None:  # the old buffer's last reader
            self.free[k].synchronize()
        self.buffers[k] = None
        size = max(-(-nbytes // GROW_BYTES) * GROW_BYTES, self.buffer_bytes)
        self.buffers[k] = torch.empty(size, dtype=torch.uint8, device=self.device)
        return self.buffers[k]

    def stage(self, lay: LayerCache, fill: bool = True) -> Staged:
        """Enqueue layer ``lay``'s non-resident experts (module docstring). Raises
        torch.cuda.OutOfMemoryError when a staging buffer cannot grow (the free-slot copies
        already made stand: those experts are resident)."""
        k, self.turn = self.turn, (self.turn + 1) % RING
        host = lay.host
        ctx = torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()
        with ctx:
            if self.free[k] is not None:
                self.stream.wait_event(self.free[k])  # buffer k's last compute has read it
            missing = np.flatnonzero(lay.slot_of_host < 0)
            placed = np.asarray(lay.fill(missing.tolist()) if fill and lay.n_slots else [], dtype=np.int64)
            experts = np.setdiff1d(missing, placed)
            layout, total = self._layout(lay, experts.size)
            buf = self._buffer(k, total)
            views = {}
            for p, a, off, nb in layout:
                src = host.arrays[p][a]
                views[(p, a)] = buf[off:off + nb].view(src.dtype).view(experts.size * host.rows[p], *src.shape[2:])
            dst, srcs = [], []
            for e0, n, j0 in runs(experts):
                for (p, a), view in views.items():
                    r = host.rows[p]
                    dst.append(view[j0 * r:(j0 + n) * r])
                    srcs.append(host.arrays[p][a][e0:e0 + n].reshape(n * r, *view.shape[1:]))
            if dst:
                torch._foreach_copy_(dst, srcs, non_blocking=self.cuda)
            table = self._table(k, lay.n_expert, experts)
            ready = None
            if self.cuda:
                ready = torch.cuda.Event()
                ready.record(self.stream)
        stacks = {}
        for p in host.arrays:
            t_, kk = host.parts[p]
            stacks[p] = PackedWeight(t_, experts.size * host.rows[p], kk,
                                     {a: views[(p, a)] for a in host.arrays[p]})
        return Staged(experts, placed, table, stacks, ready, k)

    def _table(self, k: int, n_expert: int, experts: np.ndarray) -> torch.Tensor:
        """Buffer k's slot table on the device, copied on the current (copy) stream from a
        pinned host table of its own (rewritten only after its last copy ran)."""
        host = self.tables[k]
        if host is None or host.numel() != n_expert:
            host = self.tables[k] = torch.empty(n_expert, dtype=torch.int32, pin_memory=self.cuda)
        elif self.table_copied[k] is not None:
            self.table_copied[k].synchronize()
        h = host.numpy()
        h.fill(-1)
        h[experts] = np.arange(experts.size, dtype=np.int32)
        if not self.cuda:
            return host.clone()
        dev = host.to(self.device, non_blocking=True)
        ev = self.table_copied[k] = torch.cuda.Event()
        ev.record(self.stream)
        return dev

    def wait(self, staged: Staged) -> None:
        """The current stream waits for ``staged``'s copies."""
        if staged.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(staged.ready)

    def done(self, staged: Staged) -> None:
        """Everything reading ``staged``'s buffer is enqueued on the current stream: the buffer
        is free for the copy that follows it."""
        if self.cuda:
            cur = torch.cuda.current_stream(self.device)
            ev = torch.cuda.Event()
            ev.record(cur)
            self.free[staged.ring] = ev
            staged.table.record_stream(cur)
