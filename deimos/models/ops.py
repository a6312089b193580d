"""The per-layer operations a model runs besides its linears, behind one interface.

``ReferenceOps`` is the float32 torch reference (deimos.kernels, the CPU oracle);
``deimos.models.gpu.ops.TritonOps`` runs the Triton kernels (chosen by ``WeightSource`` with
the kernel-backed weights). Model code calls ``ops`` and never knows which it has.

A step's per-step state (``StepState``) is made once by ``ops.begin`` and handed to every
layer: the batch (its sequences' layout in the paged cache) and the rope tables the ops need.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from deimos.kernels.activation import gated_act, sigmoid_gate
from deimos.kernels.attention import causal_attention
from deimos.kernels.norm import add_rms_norm, rms_norm
from deimos.kernels.rope import apply_rope, rope_cos_sin
from deimos.models.batch import Batch
from deimos.models.config import ModelConfig
from deimos.models.moe import moe_reference, shared_gate_add


@dataclass
class StepState:
    batch: Batch
    n: int  # tokens in the step
    rope: Any  # what the ops' ``rope`` needs (tables or device positions)
    extra: Any = None  # what else the ops keep for the step (the GPU prefill's tile map)


class ExpertSum(NamedTuple):
    """Routed experts' outputs not yet summed (``ops.moe(..., defer=True)``): token t's output
    is ``sum_j weights[t, j] * y[t k + j]``. Only the ops that made it take it, and only in
    ``add_rms_norm``, which sums the rows in its own launch (``RMSNorm`` passes it through)."""

    y: torch.Tensor  # float32 [T * k, D]
    weights: torch.Tensor  # float32 [T, k]
    add: torch.Tensor | None = None  # float32 [T, D] added to the sum (a shared expert's output)
    gate: tuple[torch.Tensor, torch.Tensor] | None = None  # (x, g): add scaled by sigmoid(x . g)


class Ops(Protocol):
    def begin(self, batch: Batch) -> StepState: ...
    def add_rms_norm(self, x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]: ...
    def rms_norm(self, x, weight, eps) -> torch.Tensor: ...
    def attention(self, q, k, v, layer: int, step: StepState, rope_base: float, scale: float,
                  window: int, head_norms: tuple | None = None, gated: bool = False) -> torch.Tensor:
        """The q and k heads RMS-normalized when ``head_norms=(q_weight, k_weight, eps)``
        (qk-norm), RoPE on q and k, the step's k and v into the cache at their slots, each
        sequence's queries attending over its own cached keys. ``gated``: an output gate
        follows (the output projection reads the gate's output, not this one's)."""
        ...
    def gated_act(self, gate, up, activation: str) -> torch.Tensor: ...
    def gated_mlp(self, x, gate, up, activation: str) -> torch.Tensor:
        """A gated MLP's input half, ``gated_act(gate(x), up(x), activation)`` (``gate`` and
        ``up`` its linears; a backend may compute the two products and the activation in one
        launch)."""
        ...
    def moe(self, x: torch.Tensor, block, defer: bool = False) -> torch.Tensor | ExpertSum:
        """Routed experts: x [T, D] -> [T, D] through ``block`` (deimos.models.moe.MoE: its
        router, expert weights, k, normalization and activation); moe_reference is the oracle.
        ``defer``: the caller hands the result only to this ops' ``add_rms_norm``, so an
        ``ExpertSum`` may come back instead (the sum folded into the norm's launch)."""
        ...
    def output_gate(self, attn, gate) -> torch.Tensor:
        """Gated attention's ``attn [T, H Dh] * sigmoid(gate [T, H, Dh])`` (gate: a view)."""
        ...
    def shared_gate_add(self, routed, shared, x, gate_inp) -> torch.Tensor:
        """routed + shared * sigmoid(x . gate_inp) per token (deimos.models.moe.shared_gate_add)."""
        ...
    def moe_shared(self, x: torch.Tensor, block, defer: bool = False) -> torch.Tensor | ExpertSum:
        """``block`` (deimos.models.moe.MoEShared): its routed experts plus its shared expert's
        product gated per token, ``shared_gate_add(moe(x), product(x), x, gate_inp)``;
        ``defer`` as ``moe``'s (the shared row and its gate in the ``ExpertSum``)."""
        ...


class ReferenceOps:
    """Float32 torch reference ops: keys and values written at the step's slots, then each
    sequence's keys gathered through its block table (host layout) for the reference attention."""

    graph_safe = False  # the per-sequence loop reads the host layout

    def __init__(self, cfg: ModelConfig, freq_factors: torch.Tensor | None):
        self.cfg = cfg
        self.freq_factors = freq_factors
        self.dtype = torch.float32  # of the rope tables; deimos.eval.float64 sets float64
        self.bases = sorted({cfg.layer_rope_base(i) for i in range(cfg.n_layer)})

    def begin(self, batch: Batch) -> StepState:
        cfg = self.cfg
        tables = {b: rope_cos_sin(batch.positions, cfg.rope_dim, b, cfg.rope_scale, self.freq_factors,
                                  self.dtype)
                  for b in self.bases}  # fmt: skip
        return StepState(batch, batch.tokens.shape[0], tables)

    def add_rms_norm(self, x, residual, weight, eps):
        return add_rms_norm(x, residual, weight, eps)

    def rms_norm(self, x, weight, eps):
        return rms_norm(x, weight, eps)

    def attention(self, q, k, v, layer, step, rope_base, scale, window, head_norms=None, gated=False):
        if head_norms is not None:
            qn, kn, eps = head_norms
            q = rms_norm(q.reshape(-1, q.shape[-1]), qn, eps).view(q.shape)
            k = rms_norm(k.reshape(-1, k.shape[-1]), kn, eps).view(k.shape)
        cos, sin = step.rope[rope_base]
        q = apply_rope(q, cos, sin, self.cfg.rope_type)
        k = apply_rope(k, cos, sin, self.cfg.rope_type)
        batch = step.batch
        kv, seqs = batch.kv, batch.seqs
        k_pool, v_pool = kv.k[layer], kv.v[layer]
        slots = seqs.slots.to(k_pool.device)
        k_pool.index_copy_(0, slots, k.to(k_pool.dtype))
        v_pool.index_copy_(0, slots, v.to(v_pool.dtype))
        out = torch.empty(q.shape[:2] + (v.shape[2],), dtype=q.dtype, device=q.device)
        bs = kv.block_size
        t0 = 0
        for b, (n, start) in enumerate(zip(seqs.q_lens, seqs.q_starts)):
            end = start + n  # keys 0 .. end - 1 of this sequence
            k_pos = torch.arange(end, device=q.device)
            rows = seqs.tables[b].to(torch.long)[k_pos // bs] * bs + k_pos % bs
            out[t0 : t0 + n] = causal_attention(q[t0 : t0 + n], k_pool[rows].to(q.dtype),
                                                v_pool[rows].to(q.dtype),
                                                batch.positions[t0 : t0 + n], k_pos, scale, window)
            t0 += n
        return out

    def gated_act(self, gate, up, activation):
        return gated_act(gate, up, activation)

    def gated_mlp(self, x, gate, up, activation):
        return self.gated_act(gate(x), up(x), activation)

    def moe(self, x, block, defer=False):
        return moe_reference(x, block)

    def shared_gate_add(self, routed, shared, x, gate_inp):
        return shared_gate_add(routed, shared, x, gate_inp)

    def moe_shared(self, x, block, defer=False):
        shared = block.shared
        return shared_gate_add(block.moe(x), shared.product(x), x, shared.gate_inp)

    def output_gate(self, attn, gate):
        return sigmoid_gate(attn, gate)
