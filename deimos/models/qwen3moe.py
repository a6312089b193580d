"""qwen3moe: qwen3's attention (q/k head norms, neox RoPE) with a routed-expert MLP in every
layer (softmax router, top-k, weights renormalized; SwiGLU experts; no shared expert)."""

from __future__ import annotations

from deimos.models.blocks import Attention, DecoderModel, RMSNorm
from deimos.models.config import ModelConfig
from deimos.models.moe import MoE
from deimos.models.weights import WeightSource


class Qwen3MoeLayer:
    def __init__(self, cfg: ModelConfig, i: int, w: WeightSource):
        self.attn_norm = RMSNorm(w.vector(f"blk.{i}.attn_norm.weight", cfg.n_embd), cfg.rms_eps, w.ops)
        self.attn = Attention(cfg, i, w)
        self.ffn_norm = RMSNorm(w.vector(f"blk.{i}.ffn_norm.weight", cfg.n_embd), cfg.rms_eps, w.ops)
        self.moe = MoE(cfg, i, w)

    def __call__(self, hidden, residual, step):
        hidden, residual = self.attn_norm(hidden, residual)
        hidden = self.attn(hidden, step)
        hidden, residual = self.ffn_norm(hidden, residual)
        hidden = self.moe(hidden)
        return hidden, residual


class Qwen3MoeModel(DecoderModel):
    def __init__(self, cfg: ModelConfig, w: WeightSource):
        super().__init__(cfg, w)
        self.layers = [Qwen3MoeLayer(cfg, i, w) for i in range(cfg.n_layer)]
