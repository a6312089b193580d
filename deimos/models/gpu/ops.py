"""The layer ops on the Triton kernels (deimos.kernels.triton); the oracle is
deimos.models.ops.ReferenceOps.

Decode (one token) is written so a CUDA graph can replay it: the split-K decode attention
rotates q and the new key itself (RoPE and qk-norm fused into its launch), stores the new key
and value straight into the cache row at the device position, reads the length from the
device, and no shape depends on the position. Prefill (T > 1) stores the same way and runs the causal flash kernel over the
whole cache with the chunk's start read on the device: a prefill chunk is graph-safe too.
"""

from __future__ import annotations

import torch

from deimos.kernels.triton.activation import gated_act
from deimos.kernels.triton.decode_attention import NewToken, decode_attention
from deimos.kernels.triton.norm import add_rms_norm, rms_norm
from deimos.kernels.triton.prefill_attention import prefill_attention
from deimos.kernels.triton.rope import apply_rope, rope_inv_freq
from deimos.models.batch import Batch
from deimos.models.config import ModelConfig
from deimos.models.gpu.linear import InputCache
from deimos.models.ops import StepState
from deimos.quant.triton.gemv_q8 import empty_quantized


class TritonOps:
    graph_safe = True  # a one-token step can be captured (deimos.runtime.graph)

    def __init__(self, cfg: ModelConfig, freq_factors: torch.Tensor | None, device: str | torch.device,
                 inputs: InputCache | None = None):
        self.cfg = cfg
        # with the model's InputCache, a decode step's norm, activation and attention kernels
        # also write their output as the next GEMV's integer activation (one launch less each)
        self.inputs = inputs
        bases = sorted({cfg.layer_rope_base(i) for i in range(cfg.n_layer)})
        self.inv_freq = {b: rope_inv_freq(cfg.rope_dim, b, cfg.rope_scale, freq_factors, device)
                         for b in bases}  # fmt: skip

    def begin(self, batch: Batch, start: int) -> StepState:
        # int32 positions: what the rope and decode-attention kernels read
        return StepState(batch, start, batch.tokens.shape[0], batch.positions.to(torch.int32))

    def _quantized_for(self, rows: int, k: int, device: torch.device):
        if self.inputs is None or rows != 1 or k % 32:
            return None
        return empty_quantized(rows, k, device)

    def add_rms_norm(self, x, residual, weight, eps):
        qx = self._quantized_for(x.shape[0], x.shape[1], x.device)
        y, r = add_rms_norm(x, residual, weight, eps, quantized=qx)
        if qx is not None:
            self.inputs.put(y, qx)
        return y, r

    def rms_norm(self, x, weight, eps):
        return rms_norm(x, weight, eps)

    def attention(self, q, k, v, layer, step, rope_base, scale, window, head_norms=None):
        kv = step.batch.kv
        k_cache, v_cache = kv.k[layer], kv.v[layer]
        inv_freq = self.inv_freq[rope_base]
        if step.n == 1 and v.shape == k.shape:
            # one launch: the attention kernel rotates (and head-norms) q and the new key
            # itself and stores the new key and value in the cache row. The combine kernel
            # quantizes per head: whole groups of 32 in each head
            qx = self._quantized_for(1, q.shape[1] * q.shape[2], q.device) if q.shape[2] % 32 == 0 else None
            new = NewToken(k, v, inv_freq, self.cfg.rope_type, head_norms)
            out = decode_attention(q, k_cache, v_cache, step.rope, scale, window, quantized=qx,
                                   new=new)  # fmt: skip
            if qx is not None:
                out = out.view(1, -1)  # what the output projection reads
                self.inputs.put(out, qx)
            return out
        # one launch: q (head-normed and) rotated in place, k rotated and v copied into the
        # cache rows. In place on q: it is the step's own GEMV output
        apply_rope(q, k, step.rope, inv_freq, self.cfg.rope_type, inplace=True,
                   cache=(v, k_cache, v_cache), head_norms=head_norms)
        if step.n == 1:
            return decode_attention(q, k_cache, v_cache, step.rope, scale, window)
        # the start read from the positions on the device: a prefill graph replays for any start
        return prefill_attention(q, k_cache, v_cache, step.rope, scale, window)

    def gated_act(self, gate, up, activation):
        qx = self._quantized_for(gate.shape[0], gate.shape[1], gate.device)
        y = gated_act(gate, up, activation, quantized=qx)
        if qx is not None:
            self.inputs.put(y, qx)
        return y
