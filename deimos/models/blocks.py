"""Building blocks shared by the architectures: norm, attention, gated MLP, the decoder shell.

Tensor shapes: T = tokens in the step, D = n_embd, H/Hkv = query/kv heads, Dh = head size.
"""

from __future__ import annotations

import torch

from deimos.kernels.activation import gated_act
from deimos.kernels.attention import causal_attention
from deimos.kernels.norm import add_rms_norm, rms_norm
from deimos.kernels.rope import apply_rope, rope_cos_sin
from deimos.models.batch import Batch
from deimos.models.config import ModelConfig
from deimos.models.weights import Embedding, Linear, WeightSource

Rope = dict[float, tuple[torch.Tensor, torch.Tensor]]  # rope base -> (cos, sin) for this step


class RMSNorm:
    def __init__(self, weight: torch.Tensor, eps: float):
        self.weight = weight
        self.eps = eps

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None, *, fused: bool = True):
        """Plain: norm(x). With the residual stream (fused=True): returns (norm(x + residual), x + residual)."""
        if not fused:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


class Attention:
    """GQA self-attention with RoPE, optional q/k head norms and an optional sliding window."""

    def __init__(self, cfg: ModelConfig, layer: int, w: WeightSource):
        p = f"blk.{layer}"
        self.cfg = cfg
        self.q = w.linear(f"{p}.attn_q", cfg.n_head * cfg.head_dim, cfg.n_embd, bias=None)
        self.k = w.linear(f"{p}.attn_k", cfg.n_head_kv * cfg.head_dim, cfg.n_embd, bias=None)
        self.v = w.linear(f"{p}.attn_v", cfg.n_head_kv * cfg.head_dim_v, cfg.n_embd, bias=None)
        self.o = w.linear(f"{p}.attn_output", cfg.n_embd, cfg.n_head * cfg.head_dim_v, bias=None)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(w.vector(f"{p}.attn_q_norm.weight", cfg.head_dim), cfg.rms_eps)
            self.k_norm = RMSNorm(w.vector(f"{p}.attn_k_norm.weight", cfg.head_dim), cfg.rms_eps)
        self.layer = layer
        self.rope_base = cfg.layer_rope_base(layer)
        self.window = cfg.sliding_window if cfg.is_swa(layer) else 0

    def __call__(self, x: torch.Tensor, batch: Batch, rope: Rope) -> torch.Tensor:
        cfg, n = self.cfg, x.shape[0]
        q = self.q(x).view(n, cfg.n_head, cfg.head_dim)
        k = self.k(x).view(n, cfg.n_head_kv, cfg.head_dim)
        v = self.v(x).view(n, cfg.n_head_kv, cfg.head_dim_v)
        if self.q_norm is not None:
            q = self.q_norm(q, fused=False)
            k = self.k_norm(k, fused=False)
        cos, sin = rope[self.rope_base]
        q = apply_rope(q, cos, sin, cfg.rope_type)
        k = apply_rope(k, cos, sin, cfg.rope_type)
        k_all, v_all, k_pos = batch.kv.append(self.layer, batch.positions, k, v)
        out = causal_attention(q, k_all, v_all, batch.positions, k_pos, cfg.attn_scale, self.window)
        return self.o(out.reshape(n, cfg.n_head * cfg.head_dim_v))


class GatedMLP:
    def __init__(self, cfg: ModelConfig, layer: int, w: WeightSource):
        p = f"blk.{layer}"
        self.gate = w.linear(f"{p}.ffn_gate", cfg.n_ff, cfg.n_embd, bias=None)
        self.up = w.linear(f"{p}.ffn_up", cfg.n_ff, cfg.n_embd, bias=None)
        self.down = w.linear(f"{p}.ffn_down", cfg.n_embd, cfg.n_ff, bias=None)
        self.activation = cfg.activation

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(gated_act(self.gate(x), self.up(x), self.activation))


class DecoderModel:
    """Embedding -> layers (each returns (hidden, residual)) -> final norm -> logits where wanted.

    Subclasses build ``self.layers`` in ``__init__`` after calling ``super().__init__``.
    """

    def __init__(self, cfg: ModelConfig, w: WeightSource):
        self.config = cfg
        self.embed: Embedding = w.embedding("token_embd", cfg.n_vocab, cfg.n_embd)
        self.norm = RMSNorm(w.vector("output_norm.weight", cfg.n_embd), cfg.rms_eps)
        if w.has("output.weight"):
            self.lm_head: Linear = w.linear("output", cfg.n_vocab, cfg.n_embd, bias=None)
        else:  # tied embeddings
            self.lm_head = self.embed.as_linear()
        self.freq_factors = w.vector("rope_freqs.weight", cfg.rope_dim // 2) if w.has("rope_freqs.weight") else None
        self.layers: list = []

    def rope(self, positions: torch.Tensor) -> Rope:
        cfg = self.config
        bases = {cfg.layer_rope_base(i) for i in range(cfg.n_layer)}
        return {
            b: rope_cos_sin(positions, cfg.rope_dim, b, cfg.rope_scale, self.freq_factors) for b in bases
        }

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        """-> logits [N, n_vocab] float32 for the positions ``batch.logits_at`` (default: the last)."""
        hidden = self.embed(batch.tokens)
        if self.config.embed_scale != 1.0:
            hidden = hidden * self.config.embed_scale
        rope = self.rope(batch.positions)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, batch, rope)
        at = batch.logits_at if batch.logits_at is not None else torch.tensor([hidden.shape[0] - 1])
        hidden, _ = self.norm(hidden[at], residual[at])
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcap
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
