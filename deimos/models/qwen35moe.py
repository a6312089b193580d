"""qwen35moe (Qwen3.5/3.6 MoE, e.g. 35B-A3B): qwen35's hybrid layers (Gated DeltaNet, gated
full attention every ``full_attention_interval``-th layer) with routed experts plus a shared
expert as every layer's feed-forward block.

As llama_model_qwen35moe::graph (llama.cpp 11434): the layers of qwen35, their MLP replaced by
build_layer_ffn = build_moe_ffn (softmax router, top-k, weights renormalized, SwiGLU experts)
+ the shared expert times sigmoid(ffn_gate_inp_shexp . x) (deimos.models.moe.MoEShared).
Value head h of a Gated DeltaNet layer reads key head h % Hk, as in qwen35 (the converter
orders the value heads for ggml_repeat's tiling). MTP layers as qwen35's (``model.mtp``,
deimos.models.mtp), their feed-forward block this MoE one (llama_model_qwen35moe::graph_mtp).
"""

from __future__ import annotations

from deimos.models.moe import MoEShared
from deimos.models.qwen35 import Qwen35Model


class Qwen35MoeModel(Qwen35Model):
    mlp_block = MoEShared
