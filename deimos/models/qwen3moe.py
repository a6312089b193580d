"""qwen3moe: qwen3's attention (q/k head norms, neox RoPE) with a routed-expert MLP in every
layer (softmax router, top-k, weights renormalized; SwiGLU experts; no shared expert)."""

from __future__ import annotations

from deimos.models.blocks import DecoderModel
from deimos.models.llama import LlamaLayer
from deimos.models.config import ModelConfig
from deimos.models.moe import MoE
from deimos.models.weights import WeightSource


class Qwen3MoeLayer(LlamaLayer):
    """qwen3's layer (qk-norm attention) with the routed experts as its feed-forward block."""

    def __init__(self, cfg: ModelConfig, i: int, w: WeightSource):
        super().__init__(cfg, i, w, mlp=MoE)
        # every layer's output but the last goes only to the next layer's attn_norm: the ops
        # may leave the experts' sum to that norm's launch (Ops.moe's defer)
        self.defer_sum = i < cfg.n_layer - 1

    def ffn(self, hidden):
        return self.mlp(hidden, defer=self.defer_sum)

    @property
    def moe(self) -> MoE:
        return self.mlp


class Qwen3MoeModel(DecoderModel):
    def __init__(self, cfg: ModelConfig, w: WeightSource):
        super().__init__(cfg, w)
        self.layers = [Qwen3MoeLayer(cfg, i, w) for i in range(cfg.n_layer)]
