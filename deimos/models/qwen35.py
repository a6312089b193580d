"""qwen35 (Qwen3.5 dense): hybrid layers, most of them Gated DeltaNet (deimos.models.deltanet),
every ``full_attention_interval``-th one full attention; a SwiGLU MLP in every layer.

As llama_model_qwen35::graph (llama.cpp 11434):
    h   = x + mixer(attn_norm(x))              mixer: GatedDeltaNet or GatedAttention
    out = h + mlp(post_attention_norm(h))
GatedAttention: attn_q gives per head [q (Dh) | gate (Dh)]; q/k head norms, partial neox RoPE
(IMROPE with text positions, checked in the config), GQA attention, the output times
sigmoid(gate), then attn_output.

The recurrent state of each sequence comes with the batch (``HybridKV``); see
deimos.models.deltanet. Two paths: the CPU reference (the delta rule in torch) and the kernel
path (``WeightSource.triton_ops``, the default on CUDA: the GPU linears, the ops' Triton
attention, the delta rule by deimos.models.gpu.deltanet_ops), whose states are in the "kernel"
layout on the model's device (``new_state``; a state in the other layout is converted at the
start of the step), or slots of the engine's state pool (deimos.runtime.state_pool).

MTP layers (``<arch>.nextn_predict_layers``, after the main layers): ``model.mtp``, a
deimos.models.mtp.MTPHead (None without them; on the kernel path until ``load_mtp``);
the main step never runs them. ``step(batch, hidden_at=...)`` also returns the post-norm
hidden rows the MTP head takes.
"""

from __future__ import annotations

import torch

from deimos.models.batch import Batch
from deimos.models.blocks import Attention, DecoderModel, GatedMLP, RMSNorm
from deimos.models.config import ModelConfig
from deimos.models.deltanet import GatedDeltaNet, RecurrentState, step_states
from deimos.models.moe import MoE, MoEShared
from deimos.models.mtp import MTPHead
from deimos.models.weights import WeightSource


class GatedAttention(Attention):
    """Attention whose q projection also yields a per-head output gate (sigmoid)."""

    def __init__(self, cfg: ModelConfig, layer: int, w: WeightSource):
        p = f"blk.{layer}"
        self.cfg = cfg
        self.q = w.linear(f"{p}.attn_q", 2 * cfg.n_head * cfg.head_dim, cfg.n_embd, bias=None)
        self.k = w.linear(f"{p}.attn_k", cfg.n_head_kv * cfg.head_dim, cfg.n_embd, bias=None)
        self.v = w.linear(f"{p}.attn_v", cfg.n_head_kv * cfg.head_dim_v, cfg.n_embd, bias=None)
        self.o = w.linear(f"{p}.attn_output", cfg.n_embd, cfg.n_head * cfg.head_dim_v, bias=None)
        self.ops = w.ops
        self.head_norms = (w.vector(f"{p}.attn_q_norm.weight", cfg.head_dim),
                           w.vector(f"{p}.attn_k_norm.weight", cfg.head_dim), cfg.rms_eps)
        self.layer = layer
        self.rope_base = cfg.layer_rope_base(layer)
        self.window = 0

    def __call__(self, x, step):
        cfg, n = self.cfg, x.shape[0]
        qg = self.q(x).view(n, cfg.n_head, 2, cfg.head_dim)
        q, gate = qg[:, :, 0], qg[:, :, 1]  # views: the ops read them strided
        k = self.k(x).view(n, cfg.n_head_kv, cfg.head_dim)
        v = self.v(x).view(n, cfg.n_head_kv, cfg.head_dim_v)
        out = self.ops.attention(q, k, v, self.layer, step, self.rope_base, cfg.attn_scale, self.window,
                                 self.head_norms, gated=True)
        return self.o(self.ops.output_gate(out.reshape(n, cfg.n_head * cfg.head_dim_v), gate))


class Qwen35Layer:
    """``mlp``: the feed-forward block's class (GatedMLP; qwen35moe's routed + shared experts);
    ``deltanet``: the recurrent layers' block (GatedDeltaNet; qwen3next's variant)."""

    def __init__(self, cfg: ModelConfig, i: int, w: WeightSource, mlp=GatedMLP, deltanet=GatedDeltaNet):
        self.attn_norm = RMSNorm(w.vector(f"blk.{i}.attn_norm.weight", cfg.n_embd), cfg.rms_eps, w.ops)
        self.recurrent = cfg.is_recurrent(i)
        self.mixer = deltanet(cfg, i, w) if self.recurrent else GatedAttention(cfg, i, w)
        self.ffn_norm = RMSNorm(w.vector(f"blk.{i}.post_attention_norm.weight", cfg.n_embd), cfg.rms_eps,
                                w.ops)
        self.mlp = mlp(cfg, i, w)
        # a MoE block's output, but the last layer's, goes only to the next layer's attn_norm:
        # the ops may leave the experts' sum to that norm's launch (Ops.moe's defer)
        self.defer_sum = isinstance(self.mlp, (MoE, MoEShared)) and i < cfg.n_layer - 1

    @property
    def moe(self):
        """The routed experts (what the GPU expert placement and offload look for), or None."""
        return getattr(self.mlp, "moe", None)

    def __call__(self, hidden, residual, step):
        hidden, residual = self.attn_norm(hidden, residual)
        if self.recurrent:
            hidden = self.mixer(hidden, step.batch, step_states(step.batch))
        else:
            hidden = self.mixer(hidden, step)
        hidden, residual = self.ffn_norm(hidden, residual)
        return (self.mlp(hidden, defer=True) if self.defer_sum else self.mlp(hidden)), residual


class Qwen35Model(DecoderModel):
    """A hybrid model: ``step(batch)`` needs ``batch.kv`` to be a ``HybridKV`` (the pool and one
    RecurrentState per sequence); the states advance by the step's tokens."""

    mlp_block = GatedMLP  # every layer's feed-forward block (the MoE variants set theirs)
    deltanet_block = GatedDeltaNet  # the recurrent layers' block

    def __init__(self, cfg: ModelConfig, w: WeightSource):
        super().__init__(cfg, w)
        self.layers = [Qwen35Layer(cfg, i, w, self.mlp_block, self.deltanet_block)
                       for i in range(cfg.n_layer)]
        self.state_layout = "kernel" if w.triton_ops else "reference"
        self.state_device = self.norm.weight.device  # "cuda:0", as the tensors say
        # the MTP layers: built here on the CPU reference; on the kernel path on first use
        # (``load_mtp``: their weights take device memory only when a drafter asks for them)
        self.mtp: MTPHead | None = None
        self._mtp_source = w if cfg.n_mtp_layers else None
        if cfg.n_mtp_layers and not (w.kernels or w.triton_ops):
            self.mtp = MTPHead(cfg, w, self, self._mtp_layer)

    def load_mtp(self) -> MTPHead:
        """``self.mtp``, built now if it was not (the kernel path: the MTP layer's tensors
        packed and moved to the device). A file without MTP layers, or a MoE model whose
        routed experts live on the host (the offload wires only the main layers), is refused."""
        if self.mtp is not None:
            return self.mtp
        w, cfg = self._mtp_source, self.config
        if w is None:
            raise ValueError(f"this {cfg.arch} file has no MTP (nextn) layers "
                             "('nextn_predict_layers' is 0 or absent)")
        gpu = getattr(w, "gpu", None)
        if cfg.n_expert and gpu is not None and gpu.expert_device != gpu.device:
            raise ValueError("MTP drafting with the routed experts on the host (offloaded) is not "
                             "supported: the MTP layer's experts would need the offload's cache; "
                             "use --speculative ngram, or --experts gpu where they fit")
        self.mtp = MTPHead(cfg, w, self, self._mtp_layer)
        return self.mtp

    def _mtp_layer(self, cfg: ModelConfig, i: int, w: WeightSource) -> Qwen35Layer:
        """An MTP layer's decoder block: this model's layer (full attention: i >= n_layer)."""
        return Qwen35Layer(cfg, i, w, self.mlp_block, self.deltanet_block)

    @property
    def graph_safe(self) -> bool:
        """Steps on the kernel path whose states come in a state pool (``HybridKV.store``,
        slots on the device; deimos.runtime.state_pool) read nothing from the host. A padded
        prefill chunk's recurrent layers see only its real rows (the token offsets end there)."""
        return self.state_layout == "kernel" and super().graph_safe

    def new_state(self) -> RecurrentState:
        """A fresh RecurrentState for this model: its layout, on its device."""
        return RecurrentState.zeros(self.config, self.state_device, layout=self.state_layout)

    def step(self, batch: Batch, hidden_at: torch.Tensor | None = None):
        """-> logits [N, V] of ``batch.logits_at``; with ``hidden_at`` (indices into the step's
        tokens) (logits, hidden [M, D] float32): those tokens' hidden states after the final
        norm (llama.cpp's h_nextn: what the MTP head takes, deimos.models.mtp)."""
        states = step_states(batch)
        for st in states:  # a no-op unless made for the other path (RecurrentState.zeros' default)
            st.adopt(self.state_layout, self.state_device)
        step = self.ops.begin(batch)
        hidden = self.embed(batch.tokens)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, step)
        at = batch.logits_at
        if at is None:
            at = torch.tensor([hidden.shape[0] - 1], device=hidden.device)
        out, _ = self.norm(hidden[at], residual[at])
        for st, n in zip(states, batch.seqs.q_lens):
            st.length += n
        logits = self.lm_head(out).float()
        if hidden_at is None:
            return logits
        rows, _ = self.norm(hidden[hidden_at], residual[hidden_at])
        return logits, rows.float()
