"""The pinned host buffers a captured offload step shares with the device
(deimos.kernels.triton.host_link), one set per MoE layer, and the host's side of the protocol.

Per layer i (``rows`` = the most rows a step routes, the largest decode graph):
``ids`` int32 [rows, k], ``weights`` float32 [rows, k], ``x`` float32 [rows, D] (written by the
device's ``post_rows``), ``out`` float32 [rows, D] (the host's answer, read by ``wait_rows``),
``table`` int32 [E] (the experts the device reads from host memory itself this step, -1 for
the others: the host's split of the misses), ``flags[i] = (posted, decided, done)`` int32.
The device holds the step's number (``seq``, bumped by
the first layer's post) and the post's counter; the host mirrors the number (``next_step``).
``error`` is where a device wait that gave up writes its layer + 1.

``wait_posted`` spins (a few microseconds between the device's store and the host seeing it;
with a deadline, so a device that never posts is an error, not a hang) and ``answer`` stores
the done flag after the answer's rows (x86 keeps stores in order; the device reads the flag
with acquire semantics). ``release_all`` answers every layer not answered yet, so that a
step whose host side failed ends on the device (its result is then discarded).
"""

from __future__ import annotations

import time

import numpy as np
import torch

SPIN_CHECK = 4096  # polls between two looks at the clock
POST_TIMEOUT_S = 30.0  # the device did not post a layer in this long: an engine fault


class HostMailbox:
    POSTED, DECIDED, DONE = 0, 1, 2

    def __init__(self, n_layer: int, rows: int, k: int, d: int, n_expert: int, device: torch.device):
        if min(n_layer, rows, k, d, n_expert) < 1:
            raise ValueError(f"host mailbox: layers {n_layer}, rows {rows}, k {k}, D {d}, experts "
                             f"{n_expert} must be >= 1")
        self.n_layer, self.rows, self.k, self.d = n_layer, rows, k, d

        def pinned(*shape, dtype=torch.float32) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype).pin_memory()

        self.ids = pinned(n_layer, rows, k, dtype=torch.int32)
        self.weights = pinned(n_layer, rows, k)
        self.x = pinned(n_layer, rows, d)
        self.out = pinned(n_layer, rows, d)
        self.table = pinned(n_layer, 1, n_expert, dtype=torch.int32)
        self.table.fill_(-1)
        self.flags = pinned(n_layer, 3, dtype=torch.int32)  # (posted, decided, done) a layer
        self.error = pinned(1, dtype=torch.int32)
        self.seq = torch.zeros(1, dtype=torch.int32, device=device)  # the device's step number
        self.count = torch.zeros(1, dtype=torch.int32, device=device)  # post_rows' arrivals
        self.np_ids, self.np_weights = self.ids.numpy(), self.weights.numpy()
        self.np_x, self.np_out = self.x.numpy(), self.out.numpy()
        self.np_flags, self.np_error = self.flags.numpy(), self.error.numpy()
        self.np_table = self.table.numpy()[:, 0]
        self.step = 0  # the host's mirror of seq: the number of the last step launched
        self.answered = -1  # the last layer answered in the step being served

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.ids, self.weights, self.x, self.out, self.table, self.flags))

    def flag(self, layer: int, which: int) -> torch.Tensor:
        """Layer's POSTED, DECIDED or DONE flag, an int32 [1] view for the kernels."""
        return self.flags[layer, which : which + 1]

    def table_rows(self, layer: int) -> torch.Tensor:
        """The layer's table as float32 [1, E] (the same bits: wait_rows copies it as rows)."""
        return self.table[layer].view(torch.float32)

    def begin_step(self) -> int:
        """A step was launched: its number (what the device's first post writes)."""
        if self.np_error[0]:
            layer = int(self.np_error[0]) - 1
            self.np_error[0] = 0
            raise RuntimeError(f"expert offload: the device gave up waiting for the host at MoE layer {layer}")
        self.step = (self.step + 1) & 0x7FFFFFFF
        self.answered = -1
        return self.step

    def wait_posted(self, layer: int, timeout_s: float = POST_TIMEOUT_S) -> None:
        flags, want = self.np_flags, self.step
        n = 0
        deadline = None
        while flags[layer, self.POSTED] != want:
            n += 1
            if n % SPIN_CHECK == 0:
                now = time.monotonic()
                if deadline is None:
                    deadline = now + timeout_s
                elif now > deadline:
                    raise RuntimeError(f"expert offload: the device did not post MoE layer {layer} of "
                                       f"step {want} in {timeout_s:.0f} s")
                if n % (64 * SPIN_CHECK) == 0:
                    time.sleep(0)  # let the server's threads in during a long wait

    def decide(self, layer: int) -> None:
        """The layer's ``table`` is written: the device may read its share of the misses."""
        self.np_flags[layer, self.DECIDED] = self.step

    def answer(self, layer: int) -> None:
        """The layer's ``out`` rows are written: let the device go on."""
        self.np_flags[layer, self.DONE] = self.step
        self.answered = layer

    def release_all(self) -> None:
        """Answer every layer the step has not (a failed host side: the step still ends)."""
        for layer in range(self.answered + 1, self.n_layer):
            self.np_out[layer] = 0
            self.np_table[layer] = -1
            self.np_flags[layer, self.DECIDED] = self.step
            self.np_flags[layer, self.DONE] = self.step
        self.answered = self.n_layer - 1
