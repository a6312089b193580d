"""qwen3next (Qwen3-Next-80B-A3B): hybrid layers like qwen35's with routed experts plus a shared
expert in every layer; its Gated DeltaNet layers lay out their heads differently.

As llama_model_qwen3next::graph (llama.cpp 11434):
    h   = x + mixer(attn_norm(x))              mixer: Qwen3NextDeltaNet or GatedAttention
    out = h + moe_shared(post_attention_norm(h))
- GatedAttention is qwen35's (attn_q gives per head [q | gate], q/k head norms, sigmoid(gate)
  on the output) with plain neox RoPE on the first ``rope.dimension_count`` dims of a head
  (partial RoPE; no IMROPE sections);
- the feed-forward block is deimos.models.moe.MoEShared (as qwen35moe);
- the Gated DeltaNet block differs from qwen35's in three ways (the converter keeps the HF
  head order): value head h reads key head h // (Hv / Hk) ("grouped", ggml's repeat of the
  key heads interleaved, where qwen35 tiles them: h % Hk); beta and alpha come from one
  projection ``ssm_ba`` [D -> 2 Hv], per key head its Hv / Hk betas then its Hv / Hk
  alphas; and files written by older converters hold q, k, v and z in one projection
  ``ssm_in`` [D -> 2 Hk Dk + 2 Hv Dv], per key head [q (Dk) | k (Dk) | v (Hv/Hk Dv) | z (Hv/Hk Dv)]
  (llama.cpp's "legacy" path), where newer ones have qwen35's ``attn_qkv`` and ``attn_gate``.

On the kernel path (deimos.models.gpu.deltanet_ops) the block's ``projections`` and its
grouped head map (``head_map``) feed the same Triton gated delta kernels as qwen35's.
MTP layers as qwen35's (``model.mtp``, deimos.models.mtp): this model's full-attention layer
(plain partial neox RoPE) and MoE block (llama_model_qwen3next::graph_mtp).
"""

from __future__ import annotations

import torch

from deimos.models.config import ModelConfig
from deimos.models.deltanet import GatedDeltaNet
from deimos.models.moe import MoEShared
from deimos.models.qwen35 import Qwen35Model
from deimos.models.weights import WeightSource


class Qwen3NextDeltaNet(GatedDeltaNet):
    """qwen3next's Gated DeltaNet block of recurrent layer ``layer``: ``block(x, batch, states)``
    with x [T, D] -> [T, D], advancing each sequence's state (on the kernel path through
    deimos.models.gpu.deltanet_ops)."""

    head_map = "grouped"  # value head h reads key head h // (Hv / Hk)

    def load_projections(self, cfg: ModelConfig, p: str, w: WeightSource) -> None:
        """ssm_in (q, k, v, z per key head: the older converters' layout) or attn_qkv +
        attn_gate, and ssm_ba (beta, alpha per key head)."""
        hv, dh, d = cfg.ssm_n_v_heads, cfg.ssm_head_dim, cfg.n_embd
        self.legacy = w.has(f"{p}.ssm_in.weight") and not w.has(f"{p}.attn_qkv.weight")
        if self.legacy:
            self.qkvz = w.linear(f"{p}.ssm_in", cfg.ssm_conv_dim + hv * dh, d, bias=None)
        else:
            self.qkv, self.gate = w.linears(
                [(f"{p}.attn_qkv", cfg.ssm_conv_dim), (f"{p}.attn_gate", hv * dh)], d)
        self.beta_alpha = w.linear(f"{p}.ssm_ba", 2 * hv, d, bias=None)

    def raw_projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] -> (conv input [T, (2 Hk + Hv) Dh] as [q | k | v], z [T, Hv, Dh], b,
        alpha [T, Hk, Hv / Hk]: ssm_ba's per-key-head betas and alphas, as views), every head
        in the grouped order."""
        n, hk, hv, dh = x.shape[0], self.hk, self.hv, self.dh
        r = hv // hk
        if self.legacy:
            qkvz = self.qkvz(x).view(n, hk, 2 * dh + 2 * r * dh)
            q, k = qkvz[..., :dh], qkvz[..., dh : 2 * dh]
            v, z = qkvz[..., 2 * dh : (2 + r) * dh], qkvz[..., (2 + r) * dh :]
            mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=1)
            z = z.reshape(n, hv, dh)
        else:
            mixed, z = self.qkv(x), self.gate(x).view(n, hv, dh)
        ba = self.beta_alpha(x).view(n, hk, 2, r)  # per key head: its r betas, then its r alphas
        return mixed, z, ba[:, :, 0], ba[:, :, 1]


class Qwen3NextModel(Qwen35Model):
    mlp_block = MoEShared
    deltanet_block = Qwen3NextDeltaNet

