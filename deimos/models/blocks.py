"""Building blocks shared by the architectures: norm, attention, gated MLP, the decoder shell.

Tensor shapes: T = tokens in the step, D = n_embd, H/Hkv = query/kv heads, Dh = head size.
"""

from __future__ import annotations

import torch

from deimos.models.batch import Batch
from deimos.models.config import ModelConfig
from deimos.models.ops import Ops, StepState
from deimos.models.weights import Embedding, Linear, WeightSource


class RMSNorm:
    def __init__(self, weight: torch.Tensor, eps: float, ops: Ops):
        self.weight = weight
        self.eps = eps
        self.ops = ops

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None, *, fused: bool = True):
        """Plain: norm(x) over the last dim. With the residual stream (fused=True): returns
        (norm(x + residual), x + residual)."""
        if not fused:
            shape = x.shape
            return self.ops.rms_norm(x.reshape(-1, shape[-1]), self.weight, self.eps).view(shape)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class Attention:
    """GQA self-attention with RoPE, optional q/k head norms and an optional sliding window."""

    def __init__(self, cfg: ModelConfig, layer: int, w: WeightSource):
        p = f"blk.{layer}"
        self.cfg = cfg
        self.q, self.k, self.v = w.linears(
            [(f"{p}.attn_q", cfg.n_head * cfg.head_dim), (f"{p}.attn_k", cfg.n_head_kv * cfg.head_dim),
             (f"{p}.attn_v", cfg.n_head_kv * cfg.head_dim_v)], cfg.n_embd)  # fmt: skip
        self.o = w.linear(f"{p}.attn_output", cfg.n_embd, cfg.n_head * cfg.head_dim_v, bias=None)
        self.ops = w.ops
        # qk-norm (qwen3, gemma3): every q and k head RMS-normalized, done by the ops with RoPE
        self.head_norms = None
        if cfg.qk_norm:
            self.head_norms = (w.vector(f"{p}.attn_q_norm.weight", cfg.head_dim),
                               w.vector(f"{p}.attn_k_norm.weight", cfg.head_dim), cfg.rms_eps)  # fmt: skip
        self.layer = layer
        self.rope_base = cfg.layer_rope_base(layer)
        self.window = cfg.sliding_window if cfg.is_swa(layer) else 0

    def __call__(self, x: torch.Tensor, step: StepState) -> torch.Tensor:
        cfg, n = self.cfg, x.shape[0]
        q = self.q(x).view(n, cfg.n_head, cfg.head_dim)
        k = self.k(x).view(n, cfg.n_head_kv, cfg.head_dim)
        v = self.v(x).view(n, cfg.n_head_kv, cfg.head_dim_v)
        out = self.ops.attention(q, k, v, self.layer, step, self.rope_base, cfg.attn_scale, self.window,
                                 self.head_norms)
        return self.o(out.reshape(n, cfg.n_head * cfg.head_dim_v))


class GatedMLP:
    def __init__(self, cfg: ModelConfig, layer: int, w: WeightSource):
        p = f"blk.{layer}"
        self.gate, self.up = w.linears([(f"{p}.ffn_gate", cfg.n_ff), (f"{p}.ffn_up", cfg.n_ff)], cfg.n_embd)
        self.down = w.linear(f"{p}.ffn_down", cfg.n_embd, cfg.n_ff, bias=None)
        self.activation = cfg.activation
        self.ops = w.ops

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.ops.gated_mlp(x, self.gate, self.up, self.activation))


class DecoderModel:
    """Embedding -> layers (each returns (hidden, residual)) -> final norm -> logits where wanted.

    Subclasses build ``self.layers`` in ``__init__`` after calling ``super().__init__``.
    """

    def __init__(self, cfg: ModelConfig, w: WeightSource):
        self.config = cfg
        self.embed: Embedding = w.embedding("token_embd", cfg.n_vocab, cfg.n_embd)
        if w.has("output.weight"):
            self.lm_head: Linear = w.linear("output", cfg.n_vocab, cfg.n_embd, bias=None)
        else:  # tied embeddings
            self.lm_head = self.embed.as_linear()
        freq_factors = w.vector("rope_freqs.weight", cfg.rope_dim // 2) if w.has("rope_freqs.weight") else None
        w.make_ops(cfg, freq_factors)
        self.ops: Ops = w.ops
        self.norm = RMSNorm(w.vector("output_norm.weight", cfg.n_embd), cfg.rms_eps, w.ops)
        self.layers: list = []

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def graph_safe(self) -> bool:
        """Whether a step reads nothing from the host, so that a CUDA graph can capture it:
        the ops' say (a model whose layers gather host state overrides it with False)."""
        return getattr(self.ops, "graph_safe", False)

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        """-> logits [N, n_vocab] float32 for the positions ``batch.logits_at`` (default: the
        last); the step's keys and values are written to their slots of ``batch.kv``."""
        return self.step(batch)

    def step(self, batch: Batch) -> torch.Tensor:
        """The forward pass. On the kernel path no host synchronisation is made and no shape
        depends on the positions: it is what a CUDA graph captures (deimos.runtime.graph);
        who owns which slot is the caller's bookkeeping."""
        step = self.ops.begin(batch)
        hidden = self.embed(batch.tokens)
        if self.config.embed_scale != 1.0:
            hidden = hidden * self.config.embed_scale
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, step)
        if batch.logits_at is not None:
            hidden, residual = hidden[batch.logits_at], residual[batch.logits_at]
        else:
            hidden, residual = hidden[-1:], residual[-1:]
        hidden, _ = self.norm(hidden, residual)
        logits = self.lm_head(hidden)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float64 stays
        cap = self.config.final_logit_softcap
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
