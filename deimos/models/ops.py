"""The per-layer operations a model runs besides its linears, behind one interface.

``ReferenceOps`` is the float32 torch reference (deimos.kernels, the CPU oracle);
``deimos.models.gpu.ops.TritonOps`` runs the Triton kernels (chosen by ``WeightSource`` with
the kernel-backed weights). Model code calls ``ops`` and never knows which it has.

A step's per-step state (``StepState``) is made once by ``ops.begin`` and handed to every
layer: the positions, where the chunk starts in the cache, and the rope tables the ops need.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from deimos.kernels.activation import gated_act
from deimos.kernels.attention import causal_attention
from deimos.kernels.norm import add_rms_norm, rms_norm
from deimos.kernels.rope import apply_rope, rope_cos_sin
from deimos.models.batch import Batch
from deimos.models.config import ModelConfig


@dataclass
class StepState:
    batch: Batch
    start: int  # cache position of the step's first token (host)
    n: int  # tokens in the step
    rope: Any  # what the ops' ``rope`` needs (tables or device positions)


class Ops(Protocol):
    def begin(self, batch: Batch, start: int) -> StepState: ...
    def add_rms_norm(self, x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]: ...
    def rms_norm(self, x, weight, eps) -> torch.Tensor: ...
    def attention(self, q, k, v, layer: int, step: StepState, rope_base: float, scale: float,
                  window: int, head_norms: tuple | None = None) -> torch.Tensor:
        """The q and k heads RMS-normalized when ``head_norms=(q_weight, k_weight, eps)``
        (qk-norm), RoPE on q and k, the step's k and v into the cache, attention over the
        cache."""
        ...
    def gated_act(self, gate, up, activation: str) -> torch.Tensor: ...


class ReferenceOps:
    """Float32 torch reference ops; the KV cache is written at ``step.start`` (host)."""

    graph_safe = False  # the cache slice depends on the host start

    def __init__(self, cfg: ModelConfig, freq_factors: torch.Tensor | None):
        self.cfg = cfg
        self.freq_factors = freq_factors
        self.dtype = torch.float32  # of the rope tables; deimos.eval.float64 sets float64
        self.bases = sorted({cfg.layer_rope_base(i) for i in range(cfg.n_layer)})

    def begin(self, batch: Batch, start: int) -> StepState:
        cfg = self.cfg
        tables = {b: rope_cos_sin(batch.positions, cfg.rope_dim, b, cfg.rope_scale, self.freq_factors,
                                  self.dtype)
                  for b in self.bases}  # fmt: skip
        return StepState(batch, start, batch.tokens.shape[0], tables)

    def add_rms_norm(self, x, residual, weight, eps):
        return add_rms_norm(x, residual, weight, eps)

    def rms_norm(self, x, weight, eps):
        return rms_norm(x, weight, eps)

    def attention(self, q, k, v, layer, step, rope_base, scale, window, head_norms=None):
        if head_norms is not None:
            qn, kn, eps = head_norms
            q = rms_norm(q.reshape(-1, q.shape[-1]), qn, eps).view(q.shape)
            k = rms_norm(k.reshape(-1, k.shape[-1]), kn, eps).view(k.shape)
        cos, sin = step.rope[rope_base]
        q = apply_rope(q, cos, sin, self.cfg.rope_type)
        k = apply_rope(k, cos, sin, self.cfg.rope_type)
        kv = step.batch.kv
        kv.write(layer, step.start, k, v)
        k_all, v_all, k_pos = kv.view(layer, step.start + step.n)
        return causal_attention(q, k_all, v_all, step.batch.positions, k_pos, scale, window)

    def gated_act(self, gate, up, activation):
        return gated_act(gate, up, activation)
