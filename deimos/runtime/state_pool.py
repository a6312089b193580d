"""A hybrid model's recurrent states on the GPU path: one slot of device memory per running
sequence, allocated once, indexed on the device by the step (deimos.models.gpu.deltanet_ops).

Per recurrent layer i (views of two tensors ``[L, n_slots, ...]`` over the L recurrent layers,
so that one copy moves a slot's rows of every layer):
    ssm[i]   [n_slots, Hv, Dk, Dv] float32   the delta-rule states, the kernels' layout
    conv[i]  [n_slots, C, K - 1] float32     the last K - 1 inputs of each channel, oldest first
Slot 0 is scratch: CUDA-graph padding rows read and write it, no sequence gets it (as block 0
of the KV pool). After the sequences' slots come ``n_snap`` snapshot slots (``snap_slots``),
never held: a prefill step stores a sequence's state at a block boundary inside its chunk there
(the kernels' snapshot row), and ``save`` copies it out after the step. The pool is memory plus
a free list; which sequence holds which slot is the model runner's bookkeeping
(deimos.engine.runner).

- ``SlotState``: a running sequence's handle (slot + length), what ``Sequence.state`` holds on
  this path; ``clone()`` snapshots it.
- ``StateSnapshot``: a slot's rows copied out (device tensors), what the prefix cache keeps on
  a block (deimos.engine.block_manager); never written, so ``clone()`` is itself, and
  restoring copies it into a fresh slot (``StatePool.bind``).
- ``StepSlots``: a graph's slot ids on the device, filled before a replay (a prefill graph's
  snapshot rows too: ``(row count, slot)`` pairs).

A slot handed to a new owner is always written first (zeros or a restore) by a device copy on
the step's stream: work still queued for its previous owner (a chained decode step) finishes
before.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from deimos.models.config import ModelConfig
from deimos.models.deltanet import RecurrentState, StateError

SCRATCH_SLOT = 0


class StatePoolFull(RuntimeError):
    """Every slot is held (the engine runs at most ``n_seqs`` sequences at once)."""


@dataclass(frozen=True, eq=False)
class StateSnapshot:
    """The state of a sequence after ``length`` tokens: ``ssm`` [L, Hv, Dk, Dv] and ``conv``
    [L, C, K - 1] float32 on the pool's device, the L recurrent layers in order."""

    ssm: torch.Tensor
    conv: torch.Tensor
    length: int
    layers: tuple[int, ...]
    layout = "kernel"

    def clone(self) -> StateSnapshot:
        """Itself: a snapshot is never written (a restore copies it into a slot)."""
        return self

    @property
    def nbytes(self) -> int:
        return self.ssm.numel() * 4 + self.conv.numel() * 4

    def to_state(self) -> RecurrentState:
        """A RecurrentState with copies of these tensors (kernel layout, same device)."""
        own = torch.contiguous_format
        conv = {i: self.conv[j].t().clone(memory_format=own) for j, i in enumerate(self.layers)}
        ssm = {i: self.ssm[j].clone() for j, i in enumerate(self.layers)}
        return RecurrentState(conv, ssm, self.length, "kernel")


class SlotState:
    """A running sequence's recurrent state: slot ``slot`` of ``pool``, after ``length`` tokens
    (the step that consumes tokens advances it: the model in an eager step, the runner after a
    graph replay)."""

    __slots__ = ("length", "pool", "slot")
    layout = "kernel"

    def __init__(self, pool: StatePool, slot: int, length: int = 0) -> None:
        self.pool, self.slot, self.length = pool, slot, length

    @property
    def live(self) -> bool:
        return self.slot > SCRATCH_SLOT

    def clone(self) -> StateSnapshot:
        """A snapshot of the slot now (queued on the stream after the steps launched so far)."""
        self._check()
        return self.pool.save(self.slot, self.length)

    def adopt(self, layout: str, device: torch.device) -> None:
        """Nothing to move: checks that the model reads the pool's layout on its device."""
        self._check()
        if layout != "kernel" or torch.device(device) != self.pool.device:
            raise StateError(f"a state pool slot is the kernel layout on {self.pool.device}; the "
                             f"model wants {layout} on {device} (the CPU reference takes "
                             "RecurrentState)")  # fmt: skip

    def release(self) -> None:
        """The slot goes back to the pool; the handle is dead afterwards."""
        if self.live:
            self.pool.free(self.slot)
            self.slot = -1

    @property
    def nbytes(self) -> int:
        return self.pool.slot_nbytes

    def _check(self) -> None:
        if not self.live:
            raise StateError("this recurrent state's slot was released")

    def __repr__(self) -> str:
        return f"SlotState(slot={self.slot}, length={self.length})"


class StatePool:
    def __init__(self, config: ModelConfig, n_seqs: int, device: str | torch.device,
                 n_snap: int = 0) -> None:
        """Slots for ``n_seqs`` sequences, the scratch slot and ``n_snap`` snapshot slots,
        zeroed."""
        if not config.is_hybrid:
            raise ValueError(f"StatePool: {config.arch} has no recurrent layers")
        if n_seqs < 1:
            raise ValueError(f"StatePool: needs at least one sequence slot, got {n_seqs}")
        if n_snap < 0:
            raise ValueError(f"StatePool: n_snap must be >= 0, got {n_snap}")
        if config.ssm_conv_kernel < 2:
            raise ValueError(f"StatePool: conv kernel width {config.ssm_conv_kernel} < 2")
        self.config = config
        self.device = torch.device(device)
        self.layers = tuple(i for i in range(config.n_layer) if config.is_recurrent(i))
        self.n_slots = n_seqs + 1 + n_snap
        self.snap_slots = tuple(range(n_seqs + 1, self.n_slots))
        hv, dh = config.ssm_n_v_heads, config.ssm_head_dim
        shape = (len(self.layers), self.n_slots)
        f32 = {"dtype": torch.float32, "device": self.device}
        self._ssm = torch.zeros(*shape, hv, dh, dh, **f32)
        self._conv = torch.zeros(*shape, config.ssm_conv_dim, config.ssm_conv_kernel - 1, **f32)
        self.ssm = {i: self._ssm[j] for j, i in enumerate(self.layers)}
        self.conv = {i: self._conv[j] for j, i in enumerate(self.layers)}
        self._free: deque[int] = deque(range(1, n_seqs + 1))
        self._held: set[int] = set()

    # ---- slots --------------------------------------------------------------------------

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def n_held(self) -> int:
        return len(self._held)

    @property
    def slot_nbytes(self) -> int:
        """Bytes of one slot over every layer."""
        return (self._ssm[:, 0].numel() + self._conv[:, 0].numel()) * 4

    @property
    def nbytes(self) -> int:
        return self.slot_nbytes * self.n_slots

    def take(self) -> int:
        """A free slot (its contents are its last owner's: ``bind`` writes it first)."""
        if not self._free:
            raise StatePoolFull(f"all {self.n_held} recurrent-state slots are held")
        slot = self._free.popleft()
        self._held.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._held:
            raise RuntimeError(f"StatePool: slot {slot} freed but not held")
        self._held.remove(slot)
        self._free.append(slot)

    def bind(self, state: StateSnapshot | RecurrentState | None = None) -> SlotState:
        """A slot for a sequence: zeros (``state`` None: from its first token) or ``state``
        copied in (a snapshot, or a RecurrentState in either layout, on any device)."""
        slot = self.take()
        try:
            length = self.load(slot, state)
        except Exception:
            self.free(slot)
            raise
        return SlotState(self, slot, length)

    # ---- contents -----------------------------------------------------------------------

    def load(self, slot: int, state: StateSnapshot | RecurrentState | None) -> int:
        """Write ``state`` (None: zeros) into ``slot``; returns its length."""
        if state is None:
            self._ssm[:, slot].zero_()
            self._conv[:, slot].zero_()
            return 0
        if isinstance(state, StateSnapshot):
            if state.layers != self.layers or state.ssm.shape != self._ssm[:, slot].shape:
                raise StateError(f"a snapshot of layers {state.layers} {tuple(state.ssm.shape)} "
                                 f"does not fit this pool's {self.layers}")  # fmt: skip
            self._ssm[:, slot].copy_(state.ssm)
            self._conv[:, slot].copy_(state.conv)
            return state.length
        if isinstance(state, RecurrentState):
            if sorted(state.ssm) != list(self.layers) or sorted(state.conv) != list(self.layers):
                raise StateError(f"a RecurrentState of layers {sorted(state.ssm)} does not fit "
                                 f"this pool's {list(self.layers)}")  # fmt: skip
            flip = state.layout != "kernel"
            for j, i in enumerate(self.layers):
                s = state.ssm[i].transpose(-1, -2) if flip else state.ssm[i]
                self._ssm[j, slot].copy_(s)
                self._conv[j, slot].copy_(state.conv[i].t())
            return state.length
        raise StateError(f"StatePool: cannot restore a {type(state).__name__} (a StateSnapshot, a "
                         "RecurrentState or None)")

    def save(self, slot: int, length: int) -> StateSnapshot:
        """A copy of ``slot``'s rows (two device copies)."""
        return StateSnapshot(self._ssm[:, slot].clone(), self._conv[:, slot].clone(), length,
                             self.layers)

    def check(self) -> None:
        """Invariants (tests): every slot but scratch is free or held, exactly once."""
        free = set(self._free)
        assert len(free) == len(self._free) and not free & self._held
        assert free | self._held == set(range(1, self.n_slots - len(self.snap_slots)))


# snapshot slots of the engine's pool: how many prefilling sequences a step can snapshot inside
# their chunks (past them, a chunk is cut at its last block boundary instead: one more step)
SNAP_SLOTS = 4


def state_pool_for(model, n_seqs: int) -> StatePool | None:
    """The pool of a hybrid model on the kernel path (its states the "kernel" layout), on its
    device, with ``min(SNAP_SLOTS, n_seqs)`` snapshot slots; None for any other model (the CPU
    reference keeps a RecurrentState a sequence)."""
    if not model.config.is_hybrid or getattr(model, "state_layout", None) != "kernel":
        return None
    return StatePool(model.config, n_seqs, model.device, n_snap=min(SNAP_SLOTS, n_seqs))


class StepSlots:
    """A graph's state slots: int32 ``[n]`` on the device (``dev``, what the captured step
    reads), or ``[n, width]`` (a prefill graph's snapshot rows), loaded from a pinned host
    buffer; rows past the live ones are zeros (the scratch slot; no snapshot). A load equal to
    the last one copies nothing."""

    def __init__(self, n: int, device: torch.device, width: int | None = None) -> None:
        shape = (n,) if width is None else (n, width)
        self.dev = torch.full(shape, SCRATCH_SLOT, dtype=torch.int32, device=device)
        cuda = self.dev.device.type == "cuda"
        self._host = torch.full(shape, SCRATCH_SLOT, dtype=torch.int32, pin_memory=cuda)
        self._hostn = self._host.numpy()
        self._copied = torch.cuda.Event() if cuda else None
        self._last: list[int] | None = None

    def load(self, slots: list) -> None:
        """``slots``: an id a row (or a ``width``-tuple a row)."""
        if slots == self._last:
            return
        if len(slots) > len(self._hostn):
            raise ValueError(f"StepSlots: {len(slots)} rows for a graph of {len(self._hostn)}")
        if self._copied is not None:
            self._copied.synchronize()  # the last copy out of the host buffer is done
        self._hostn[:] = SCRATCH_SLOT
        self._hostn[: len(slots)] = np.asarray(slots, dtype=np.int32)
        self.dev.copy_(self._host, non_blocking=self._copied is not None)
        if self._copied is not None:
            self._copied.record()
        self._last = list(slots)
