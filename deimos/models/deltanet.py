"""The Gated DeltaNet layer block (qwen35's linear attention) and the recurrent state it carries.

As llama_model_qwen35::graph::build_layer_attn_linear (llama.cpp 11434), for x [T, D]:
    qkv  = attn_qkv(x)          [T, (2 Hk + Hv) Dh]   -> short causal conv (ssm_conv1d, K taps,
                                                         K - 1 carried inputs) -> SiLU
    q, k = the first two Hk x Dh parts, each head L2-normalized (x / sqrt(sum x^2 + eps));
           value head h reads q/k head h % Hk (ggml_repeat tiles the heads)
    v    = the last Hv x Dh part
    z    = attn_gate(x)         [T, Hv Dh]
    beta = sigmoid(ssm_beta(x)) [T, Hv]
    g    = softplus(ssm_alpha(x) + ssm_dt.bias) * ssm_a        (ssm_a = -exp(A_log))
    o    = gated delta rule (deimos.kernels.deltanet), scale 1/sqrt(Dh), per value head a
           state S [Dh, Dh] carried across steps
    out  = ssm_out(rms_norm(o per head, ssm_norm) * silu(z))

State: per sequence every recurrent layer's conv inputs and delta-rule state and the number of
tokens it has consumed. The step finds the states through ``batch.kv``, a ``HybridKV``: the
paged pool plus, in the batch's order, either
- each sequence's own ``RecurrentState`` (the CPU reference; on the kernel path a per-step pool
  of their rows is made and written back), or
- a state pool (``HybridKV.store``, deimos.runtime.state_pool: per layer ``[n_slots, ...]``
  device tensors) and each sequence's slot in it as a device tensor (``HybridKV.slots``),
  the kernel path's persistent form: nothing in the step depends on the host, so a decode step
  can be a CUDA graph. ``HybridKV.states`` then holds the sequences' handles (their lengths,
  checked and advanced by an eager step), or nothing (a graph's step: the caller keeps them).
The model writes the states in place; a step must continue each state exactly where it stopped
(its first position == the state's length).

Snapshots inside a step: ``HybridKV.snap_at[b]`` > 0 asks for sequence b's state after its
first ``snap_at[b]`` rows of the step as well (a block boundary inside a prefill chunk: the
prefix cache keeps the state there, deimos.engine.block_manager). The CPU reference runs such a
sequence in two segments and leaves a RecurrentState of copies in ``HybridKV.snaps[b]``; the
kernel path stores it into a state-pool slot inside the one pass (``HybridKV.snap``: int32
``[B, 2]`` (rows, slot) on the device, rows 0: none).

Two layouts of the delta-rule state: "reference" ``[Hv, Dv, Dk]`` (llama.cpp's, the CPU
reference's) and "kernel" ``[Hv, Dk, Dv]`` (its transpose: the Triton kernels', fla's, on the
model's device). The model converts a state handed to it in the other layout at the start of
its step (``RecurrentState.adopt``: once, the first step after the state was made).
On the kernel path (``WeightSource.triton_ops``) the block runs deimos.models.gpu.deltanet_ops.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from deimos.kernels.deltanet import (
    causal_conv1d,
    delta_gates,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
    l2_norm,
)
from deimos.kernels.norm import gated_rms_norm
from deimos.models.batch import Batch, PagedKV
from deimos.models.config import ModelConfig
from deimos.models.weights import WeightSource

CHUNK = 64  # the chunked form's chunk (llama.cpp's and fla's)
LAYOUTS = ("reference", "kernel")


class StateError(ValueError):
    """A step's sequences and the recurrent states handed to it disagree."""


@dataclass
class RecurrentState:
    """One sequence's Gated DeltaNet state: per recurrent layer (by layer index) the last K - 1
    conv inputs ``conv[i]`` [K - 1, conv_dim] and the delta-rule state ``ssm[i]``, float32:
    [Hv, Dv, Dk] in the "reference" layout, [Hv, Dk, Dv] in the "kernel" one; ``length``:
    tokens consumed (the next position)."""

    conv: dict[int, torch.Tensor]
    ssm: dict[int, torch.Tensor]
    length: int = 0
    layout: str = "reference"

    @classmethod
    def zeros(cls, cfg: ModelConfig, device: str | torch.device = "cpu",
              dtype: torch.dtype = torch.float32, layout: str = "reference") -> RecurrentState:
        """A fresh state (Dk = Dv = the head size: zeros look the same in both layouts)."""
        if not cfg.is_hybrid:
            raise ValueError(f"RecurrentState: {cfg.arch} has no recurrent layers")
        if layout not in LAYOUTS:
            raise ValueError(f"RecurrentState: layout {layout!r} not one of {LAYOUTS}")
        layers = [i for i in range(cfg.n_layer) if cfg.is_recurrent(i)]
        k, dh = cfg.ssm_conv_kernel, cfg.ssm_head_dim
        conv = {i: torch.zeros(k - 1, cfg.ssm_conv_dim, dtype=dtype, device=device) for i in layers}
        ssm = {i: torch.zeros(cfg.ssm_n_v_heads, dh, dh, dtype=dtype, device=device) for i in layers}
        return cls(conv, ssm, 0, layout)

    def clone(self) -> RecurrentState:
        """A snapshot (restoring it and continuing equals an uninterrupted run), on the same
        device in the same layout."""
        return RecurrentState({i: t.clone() for i, t in self.conv.items()},
                              {i: t.clone() for i, t in self.ssm.items()}, self.length, self.layout)

    def adopt(self, layout: str, device: torch.device) -> None:
        """Move the tensors to ``device`` (float32) and the delta-rule states to ``layout``, in
        place; nothing is copied when they already are there."""
        if layout not in LAYOUTS:
            raise ValueError(f"RecurrentState: layout {layout!r} not one of {LAYOUTS}")
        flip = layout != self.layout
        for i, t in self.ssm.items():
            if flip or t.device != device or t.dtype != torch.float32:
                t = t.transpose(-1, -2) if flip else t
                self.ssm[i] = t.to(device, torch.float32).contiguous()
        for i, t in self.conv.items():
            if t.device != device or t.dtype != torch.float32:
                self.conv[i] = t.to(device, torch.float32).contiguous()
        self.layout = layout

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.conv.values(), *self.ssm.values()])


class StateStore(Protocol):
    """The state pool the kernel path reads (deimos.runtime.state_pool.StatePool): per recurrent
    layer ``ssm[i]`` [n_slots, Hv, Dk, Dv] and ``conv[i]`` [n_slots, C, K - 1], float32."""

    ssm: dict[int, torch.Tensor]
    conv: dict[int, torch.Tensor]


@dataclass
class HybridKV:
    """``batch.kv`` of a hybrid model's step: the paged KV pool (its full-attention layers)
    plus the step's recurrent states: ``states[b]`` the RecurrentState of the step's sequence
    b; or, with ``store`` (the kernel path), ``slots`` int32 [B] on the device (sequence b's
    slot of ``store``) and ``states`` the sequences' handles (anything with a ``length``) or
    empty (a CUDA graph's step). Snapshots inside the step (the module's docstring):
    ``snap_at`` with ``snaps`` (the CPU reference: filled by the step), or ``snap`` (a state
    pool's slots)."""

    pool: PagedKV
    states: list = field(default_factory=list)
    store: StateStore | None = None
    slots: torch.Tensor | None = None
    snap_at: list[int] | None = None
    snaps: list = field(default_factory=list)
    snap: torch.Tensor | None = None

    @property
    def k(self):
        return self.pool.k

    @property
    def v(self):
        return self.pool.v

    @property
    def block_size(self) -> int:
        return self.pool.block_size


def step_states(batch: Batch) -> list:
    """The states of the step's sequences, checked against the batch's layout (with a state
    pool: the handles, or [] for a graph's step)."""
    kv = batch.kv
    states = getattr(kv, "states", None)
    seqs = batch.seqs
    if states is None:
        raise StateError("a hybrid model's step needs batch.kv = HybridKV(pool, states): one "
                         "RecurrentState per sequence (deimos.models.deltanet)")
    if getattr(kv, "store", None) is not None:
        slots = kv.slots
        if slots is None or slots.shape != (seqs.n_seqs,) or slots.dtype != torch.int32:
            got = None if slots is None else f"{slots.dtype} {tuple(slots.shape)}"
            raise StateError(f"a step over a state pool needs HybridKV.slots int32 "
                             f"[{seqs.n_seqs}] (one slot a sequence), got {got}")  # fmt: skip
        if not states:
            return []
    if len(states) != seqs.n_seqs:
        raise StateError(f"the step has {seqs.n_seqs} sequences but {len(states)} recurrent states")
    for b, (st, start) in enumerate(zip(states, seqs.q_starts)):
        if st.length != start:
            raise StateError(f"sequence {b} of the step starts at position {start}, its recurrent "
                             f"state is at {st.length} (a recurrent state cannot be rewound: restore "
                             "a snapshot taken at that position)")
    return states


def check_reference_states(batch: Batch) -> None:
    """The CPU reference reads each sequence's own RecurrentState, never a state pool."""
    if getattr(batch.kv, "store", None) is not None:
        raise StateError("the CPU reference's recurrent layers take one RecurrentState per "
                         "sequence (HybridKV.states), not a state pool (the kernel path's)")


class GatedDeltaNet:
    """The linear-attention block of recurrent layer ``layer``: ``block(x, step)`` with x
    [T, D] -> [T, D], advancing each sequence's state. A variant (qwen3next) changes only its
    projections and ``head_map``."""

    head_map = "tiled"  # value head h reads key head h % Hk (qwen35)

    def __init__(self, cfg: ModelConfig, layer: int, w: WeightSource, chunk: int = CHUNK):
        p = f"blk.{layer}"
        hk, hv, dh, d = cfg.ssm_n_k_heads, cfg.ssm_n_v_heads, cfg.ssm_head_dim, cfg.n_embd
        self.load_projections(cfg, p, w)
        self.conv = w.tensor(f"{p}.ssm_conv1d.weight", (cfg.ssm_conv_dim, cfg.ssm_conv_kernel))
        self.dt_bias = w.vector(f"{p}.ssm_dt.bias", hv)
        self.a = w.vector(f"{p}.ssm_a", hv)
        self.norm = w.vector(f"{p}.ssm_norm.weight", dh)
        self.out = w.linear(f"{p}.ssm_out", d, hv * dh, bias=None)
        self.hk, self.hv, self.dh, self.eps = hk, hv, dh, cfg.rms_eps
        self.layer, self.chunk = layer, chunk
        # the kernel path: the delta rule in Triton, states in the "kernel" layout
        self.kernels = w.triton_ops
        self.ops = w.ops

    def load_projections(self, cfg: ModelConfig, p: str, w: WeightSource) -> None:
        """The weights ``projections`` uses (a variant loads its own): the four projections
        of x, one launch on the kernel path where their formats agree."""
        hv, dh = cfg.ssm_n_v_heads, cfg.ssm_head_dim
        self.qkv, self.gate, self.beta, self.alpha = w.linears(
            [(f"{p}.attn_qkv", cfg.ssm_conv_dim), (f"{p}.attn_gate", hv * dh),
             (f"{p}.ssm_beta", hv), (f"{p}.ssm_alpha", hv)], cfg.n_embd)  # fmt: skip

    def __call__(self, x: torch.Tensor, batch: Batch, states: list[RecurrentState]) -> torch.Tensor:
        if self.kernels:
            from deimos.models.gpu.deltanet_ops import gated_delta_net  # imports triton

            return gated_delta_net(self, x, batch, states)
        check_reference_states(batch)
        n = x.shape[0]
        mixed, z, beta, g = self.projections(x)
        out = x.new_empty((n, self.hv, self.dh))
        kv, seqs = batch.kv, batch.seqs
        snap_at = getattr(kv, "snap_at", None) or [0] * seqs.n_seqs
        if len(snap_at) != seqs.n_seqs or any(not 0 <= a < m for a, m in zip(snap_at, seqs.q_lens)):
            raise StateError(f"HybridKV.snap_at {snap_at}: one row count a sequence, each below its "
                             f"rows {seqs.q_lens}")  # fmt: skip
        t0 = 0
        for b, m in enumerate(seqs.q_lens):  # each sequence from its own state
            st, a = states[b], snap_at[b]
            if a:  # to the snapshot row, a copy of the state there, then the rest
                self._segment(mixed, g, beta, out, st, t0, a)
                snap = kv.snaps[b]
                if snap is None:
                    snap = kv.snaps[b] = RecurrentState({}, {}, seqs.q_starts[b] + a, st.layout)
                snap.conv[self.layer] = st.conv[self.layer].clone()
                snap.ssm[self.layer] = st.ssm[self.layer].clone()
            self._segment(mixed, g, beta, out, st, t0 + a, m - a)
            t0 += m
        return self.out(gated_rms_norm(out, z, self.norm, self.eps).reshape(n, self.hv * self.dh))

    def _segment(self, mixed, g, beta, out, st: RecurrentState, t0: int, m: int) -> None:
        """Rows ``t0 .. t0 + m`` of one sequence from its state ``st`` (advanced in place):
        their outputs into ``out``."""
        hk, hv, dh = self.hk, self.hv, self.dh
        rows = slice(t0, t0 + m)
        y, st.conv[self.layer] = causal_conv1d(mixed[rows], self.conv, st.conv[self.layer])
        y = F.silu(y)
        q = self._value_heads(l2_norm(y[:, : hk * dh].view(m, hk, dh), self.eps))
        k = self._value_heads(l2_norm(y[:, hk * dh : 2 * hk * dh].view(m, hk, dh), self.eps))
        v = y[:, 2 * hk * dh :].view(m, hv, dh)
        rule = gated_delta_rule_recurrent if m == 1 else gated_delta_rule_chunked
        kw = {} if m == 1 else {"chunk": self.chunk}
        out[rows], st.ssm[self.layer] = rule(q, k, v, g[rows], beta[rows], st.ssm[self.layer],
                                             dh**-0.5, **kw)

    def projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] -> (conv input [T, (2 Hk + Hv) Dh] as [q | k | v], z [T, Hv, Dh],
        beta [T, Hv], g [T, Hv])."""
        mixed, z, b, alpha = self.raw_projections(x)
        n = x.shape[0]
        beta, g = delta_gates(b.reshape(n, self.hv), alpha.reshape(n, self.hv), self.dt_bias, self.a)
        return mixed, z, beta, g

    def raw_projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] -> (conv input [T, (2 Hk + Hv) Dh], z [T, Hv, Dh], b, alpha): the linears'
        outputs as views, b and alpha (beta's and g's inputs) ``[T, H1, R]`` with value head
        h = i R + j at [t, i, j] (here H1 = 1, R = Hv)."""
        mixed, z = self.qkv(x), self.gate(x).view(x.shape[0], self.hv, self.dh)
        return mixed, z, self.beta(x)[:, None, :], self.alpha(x)[:, None, :]

    def _value_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[T, Hk, Dh] key-head rows -> [T, Hv, Dh], by ``head_map``: tiled (value head h reads
        key head h % Hk) or grouped (h // (Hv / Hk))."""
        r = self.hv // self.hk
        return x.repeat(1, r, 1) if self.head_map == "tiled" else x.repeat_interleave(r, dim=1)
