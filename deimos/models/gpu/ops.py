"""The layer ops on the Triton kernels (deimos.kernels.triton); the oracle is
deimos.models.ops.ReferenceOps.

Decode (one token) is written so a CUDA graph can replay it: the RoPE kernel stores the
rotated keys and the values straight into the cache rows at the device positions, the
split-K decode attention reads the length from the device, and no shape depends on the
position. Prefill (T > 1) stores the same way and runs the causal flash kernel over the
whole cache with the chunk's start read on the device: a prefill chunk is graph-safe too.
"""

from __future__ import annotations

import torch

from deimos.kernels.triton.activation import gated_act
from deimos.kernels.triton.decode_attention import decode_attention
from deimos.kernels.triton.norm import add_rms_norm, rms_norm
from deimos.kernels.triton.prefill_attention import prefill_attention
from deimos.kernels.triton.rope import apply_rope, rope_inv_freq
from deimos.models.batch import Batch
from deimos.models.config import ModelConfig
from deimos.models.ops import StepState


class TritonOps:
    graph_safe = True  # a one-token step can be captured (deimos.runtime.graph)

    def __init__(self, cfg: ModelConfig, freq_factors: torch.Tensor | None, device: str | torch.device):
        self.cfg = cfg
        bases = sorted({cfg.layer_rope_base(i) for i in range(cfg.n_layer)})
        self.inv_freq = {b: rope_inv_freq(cfg.rope_dim, b, cfg.rope_scale, freq_factors, device)
                         for b in bases}  # fmt: skip

    def begin(self, batch: Batch, start: int) -> StepState:
        # int32 positions: what the rope and decode-attention kernels read
        return StepState(batch, start, batch.tokens.shape[0], batch.positions.to(torch.int32))

    def add_rms_norm(self, x, residual, weight, eps):
        return add_rms_norm(x, residual, weight, eps)

    def rms_norm(self, x, weight, eps):
        return rms_norm(x, weight, eps)

    def attention(self, q, k, v, layer, step, rope_base, scale, window):
        kv = step.batch.kv
        k_cache, v_cache = kv.k[layer], kv.v[layer]
        # one launch: q rotated in place, k rotated and v copied into the cache rows
        apply_rope(q, k, step.rope, self.inv_freq[rope_base], self.cfg.rope_type, inplace=True,
                   cache=(v, k_cache, v_cache))
        if step.n == 1:
            return decode_attention(q, k_cache, v_cache, step.rope, scale, window)
        # the start read from the positions on the device: a prefill graph replays for any start
        return prefill_attention(q, k_cache, v_cache, step.rope, scale, window)

    def gated_act(self, gate, up, activation):
        return gated_act(gate, up, activation)
