"""gemma3: scaled embeddings, sandwich norms around attention and MLP, q/k head norms,
GeGLU (tanh GELU), interleaved sliding-window layers with their own rope base.

The GGUF converter already folds gemma's (1 + weight) into the norm weights.
"""

from __future__ import annotations

from deimos.models.blocks import Attention, DecoderModel, GatedMLP, RMSNorm
from deimos.models.config import ModelConfig
from deimos.models.weights import WeightSource


class Gemma3Layer:
    def __init__(self, cfg: ModelConfig, i: int, w: WeightSource):
        def norm(name: str) -> RMSNorm:
            return RMSNorm(w.vector(f"blk.{i}.{name}.weight", cfg.n_embd), cfg.rms_eps, w.ops)

        self.attn_norm = norm("attn_norm")
        self.attn = Attention(cfg, i, w)
        self.post_attn_norm = norm("post_attention_norm")
        self.ffn_norm = norm("ffn_norm")
        self.mlp = GatedMLP(cfg, i, w)
        self.post_ffn_norm = norm("post_ffw_norm")

    def __call__(self, hidden, residual, step):
        hidden, residual = self.attn_norm(hidden, residual)
        hidden = self.post_attn_norm(self.attn(hidden, step), fused=False)
        hidden, residual = self.ffn_norm(hidden, residual)
        hidden = self.post_ffn_norm(self.mlp(hidden), fused=False)
        return hidden, residual


class Gemma3Model(DecoderModel):
    def __init__(self, cfg: ModelConfig, w: WeightSource):
        super().__init__(cfg, w)
        self.layers = [Gemma3Layer(cfg, i, w) for i in range(cfg.n_layer)]
