"""llama, qwen2 and qwen3: pre-norm decoder layers with SwiGLU.

qwen2 adds q/k/v biases and qwen3 q/k head norms; both are properties of the weights and
the config, handled inside the shared Attention block.
"""

from __future__ import annotations

from deimos.models.blocks import Attention, DecoderModel, GatedMLP, RMSNorm
from deimos.models.config import ModelConfig
from deimos.models.weights import WeightSource


class LlamaLayer:
    """``mlp``: the feed-forward block's class (GatedMLP; qwen3moe's routed experts)."""

    def __init__(self, cfg: ModelConfig, i: int, w: WeightSource, mlp=GatedMLP):
        self.attn_norm = RMSNorm(w.vector(f"blk.{i}.attn_norm.weight", cfg.n_embd), cfg.rms_eps, w.ops)
        self.attn = Attention(cfg, i, w)
        self.ffn_norm = RMSNorm(w.vector(f"blk.{i}.ffn_norm.weight", cfg.n_embd), cfg.rms_eps, w.ops)
        self.mlp = mlp(cfg, i, w)

    def __call__(self, hidden, residual, step):
        hidden, residual = self.attn_norm(hidden, residual)
        hidden = self.attn(hidden, step)
        hidden, residual = self.ffn_norm(hidden, residual)
        return self.ffn(hidden), residual

    def ffn(self, hidden):
        return self.mlp(hidden)


class LlamaModel(DecoderModel):
    def __init__(self, cfg: ModelConfig, w: WeightSource):
        super().__init__(cfg, w)
        self.layers = [LlamaLayer(cfg, i, w) for i in range(cfg.n_layer)]
