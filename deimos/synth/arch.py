"""Tensor names, shapes and metadata keys of each architecture, as llama.cpp loads them.

Names and shapes follow llama.cpp src/models/<arch>.cpp (load_arch_tensors); shapes are in
ggml order (ne0 first: a matrix mapping n_in -> n_out is [n_in, n_out]).
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple

from deimos.synth.presets import SynthPreset


class Kind(Enum):
    MATRIX = "matrix"  # 2-D weight (3-D: one matrix per expert) in the requested GGML type
    ROUTER = "router"  # MoE gate logits weight (ffn_gate_inp), F32 as llama-quantize leaves it
    NORM = "norm"  # RMSNorm gain of the hidden state, F32
    HEAD_NORM = "head_norm"  # RMSNorm gain over one head (q/k norms), F32
    OUTPUT_NORM = "output_norm"  # final RMSNorm gain, F32, large (see writer.py)
    BIAS = "bias"  # F32
    DECAY = "decay"  # F32, negative: a Gated DeltaNet's ssm_a = -exp(A_log), A uniform in [1, 16]


class TensorSpec(NamedTuple):
    name: str
    dims: tuple[int, ...]  # ggml order
    kind: Kind


def tensor_specs(p: SynthPreset, n_vocab: int) -> list[TensorSpec]:
    """All tensors of preset ``p``, in the order they are written."""
    M, N, B = Kind.MATRIX, Kind.NORM, Kind.BIAS
    d, q_dim, kv_dim = p.n_embd, p.n_head * p.head_dim, p.n_head_kv * p.head_dim
    specs = [TensorSpec("token_embd.weight", (d, n_vocab), M)]
    for i in range(p.n_layer):
        b = f"blk.{i}."
        if p.is_hybrid:
            specs += _hybrid_layer(p, i)
            continue
        specs += [
            TensorSpec(b + "attn_norm.weight", (d,), N),
            TensorSpec(b + "attn_q.weight", (d, q_dim), M),
            TensorSpec(b + "attn_k.weight", (d, kv_dim), M),
            TensorSpec(b + "attn_v.weight", (d, kv_dim), M),
        ]
        if p.arch == "qwen2":
            specs += [
                TensorSpec(b + "attn_q.bias", (q_dim,), B),
                TensorSpec(b + "attn_k.bias", (kv_dim,), B),
                TensorSpec(b + "attn_v.bias", (kv_dim,), B),
            ]
        if p.arch in ("qwen3", "gemma3", "qwen3moe"):
            specs += [
                TensorSpec(b + "attn_q_norm.weight", (p.head_dim,), Kind.HEAD_NORM),
                TensorSpec(b + "attn_k_norm.weight", (p.head_dim,), Kind.HEAD_NORM),
            ]
        specs.append(TensorSpec(b + "attn_output.weight", (q_dim, d), M))
        if p.arch == "gemma3":
            specs.append(TensorSpec(b + "post_attention_norm.weight", (d,), N))
        specs += [TensorSpec(b + "ffn_norm.weight", (d,), N), *_ffn(p, i)]
        if p.arch == "gemma3":
            specs.append(TensorSpec(b + "post_ffw_norm.weight", (d,), N))
    for i in range(p.n_layer, p.n_layer + p.n_mtp_layers):
        specs += _mtp_layer(p, i, n_vocab)
    specs.append(TensorSpec("output_norm.weight", (d,), Kind.OUTPUT_NORM))
    if not p.tied_embeddings:
        specs.append(TensorSpec("output.weight", (d, n_vocab), M))
    return specs


def _ffn(p: SynthPreset, i: int) -> list[TensorSpec]:
    """Layer i's feed-forward matrices: the dense MLP, or the router and the routed experts
    (one 3-D tensor a projection) and, where the architecture has one, the shared expert and
    its gate (a vector: F32, random like the router)."""
    M, b, d = Kind.MATRIX, f"blk.{i}.", p.n_embd
    if not p.is_moe:
        return [TensorSpec(b + "ffn_gate.weight", (d, p.n_ff), M),
                TensorSpec(b + "ffn_up.weight", (d, p.n_ff), M),
                TensorSpec(b + "ffn_down.weight", (p.n_ff, d), M)]
    ff, e = p.n_ff_exp, p.n_expert
    specs = [TensorSpec(b + "ffn_gate_inp.weight", (d, e), Kind.ROUTER),
             TensorSpec(b + "ffn_gate_exps.weight", (d, ff, e), M),
             TensorSpec(b + "ffn_up_exps.weight", (d, ff, e), M),
             TensorSpec(b + "ffn_down_exps.weight", (ff, d, e), M)]
    if p.has_shared_expert:
        fs = p.n_ff_shexp
        specs += [TensorSpec(b + "ffn_gate_inp_shexp.weight", (d,), Kind.ROUTER),
                  TensorSpec(b + "ffn_gate_shexp.weight", (d, fs), M),
                  TensorSpec(b + "ffn_up_shexp.weight", (d, fs), M),
                  TensorSpec(b + "ffn_down_shexp.weight", (fs, d), M)]
    return specs


def _hybrid_layer(p: SynthPreset, i: int) -> list[TensorSpec]:
    """A qwen35 / qwen35moe / qwen3next layer (llama_model_<arch>::load_arch_tensors). The
    writer's kinds give the F32 vectors their values: ssm_dt.bias as a bias (N(0, 0.2^2)), ssm_a
    as a decay (-A, A uniform in [1, 16], as the models initialize A_log: every state decays, as
    in real files), ssm_conv1d as an F32 random matrix (the router's kind), ssm_norm as a head
    norm (gain 1). qwen3next: beta and alpha in one ssm_ba; ``p.ssm_in``: q, k, v and z
    in one ssm_in (the older layout)."""
    M, N, b = Kind.MATRIX, Kind.NORM, f"blk.{i}."
    d = p.n_embd
    specs = [TensorSpec(b + "attn_norm.weight", (d,), N),
             TensorSpec(b + "post_attention_norm.weight", (d,), N)]
    if p.is_recurrent(i):
        hv, dh = p.ssm_n_v_heads, p.ssm_head_dim
        value, conv = hv * dh, (2 * p.ssm_n_k_heads + hv) * dh
        if p.ssm_in:
            specs.append(TensorSpec(b + "ssm_in.weight", (d, conv + value), M))
        else:
            specs += [TensorSpec(b + "attn_qkv.weight", (d, conv), M),
                      TensorSpec(b + "attn_gate.weight", (d, value), M)]
        specs += [
            TensorSpec(b + "ssm_conv1d.weight", (p.ssm_conv_kernel, conv), Kind.ROUTER),
            TensorSpec(b + "ssm_dt.bias", (hv,), Kind.BIAS),
            TensorSpec(b + "ssm_a", (hv,), Kind.DECAY),
        ]
        if p.arch == "qwen3next":
            specs.append(TensorSpec(b + "ssm_ba.weight", (d, 2 * hv), M))
        else:
            specs += [TensorSpec(b + "ssm_beta.weight", (d, hv), M),
                      TensorSpec(b + "ssm_alpha.weight", (d, hv), M)]
        specs += [
            TensorSpec(b + "ssm_norm.weight", (dh,), Kind.HEAD_NORM),
            TensorSpec(b + "ssm_out.weight", (value, d), M),
        ]
    else:
        q_dim, kv_dim = p.n_head * p.head_dim, p.n_head_kv * p.head_dim
        specs += [
            TensorSpec(b + "attn_q.weight", (d, 2 * q_dim), M),  # q and its output gate per head
            TensorSpec(b + "attn_k.weight", (d, kv_dim), M),
            TensorSpec(b + "attn_v.weight", (d, kv_dim), M),
            TensorSpec(b + "attn_output.weight", (q_dim, d), M),
            TensorSpec(b + "attn_q_norm.weight", (p.head_dim,), Kind.HEAD_NORM),
            TensorSpec(b + "attn_k_norm.weight", (p.head_dim,), Kind.HEAD_NORM),
        ]
    return specs + _ffn(p, i)


def _mtp_layer(p: SynthPreset, i: int, n_vocab: int) -> list[TensorSpec]:
    """MTP layer i (llama_model_qwen35::load_arch_tensors' load_block_mtp): a full-attention
    layer of the hybrid (``_hybrid_layer``: i >= n_layer is never recurrent) plus the nextn
    tensors: eh_proj [2 D -> D], enorm, hnorm; shared_head_norm (a final norm: large gain), or
    with ``mtp_own_embed_head`` its own embedding and output head instead."""
    b, d = f"blk.{i}.nextn.", p.n_embd
    specs = _hybrid_layer(p, i) + [
        TensorSpec(b + "eh_proj.weight", (2 * d, d), Kind.MATRIX),
        TensorSpec(b + "enorm.weight", (d,), Kind.NORM),
        TensorSpec(b + "hnorm.weight", (d,), Kind.NORM),
    ]
    if p.mtp_own_embed_head:
        return specs + [TensorSpec(b + "embed_tokens.weight", (d, n_vocab), Kind.MATRIX),
                        TensorSpec(b + "shared_head_head.weight", (d, n_vocab), Kind.MATRIX)]
    return specs + [TensorSpec(b + "shared_head_norm.weight", (d,), Kind.OUTPUT_NORM)]


def arch_metadata(p: SynthPreset, n_vocab: int) -> list[tuple[str, str, object]]:
    """(suffix, GGUF scalar type, value) of the ``<arch>.`` keys, as HF conversion writes them."""
    kv: list[tuple[str, str, object]] = [
        ("context_length", "u32", p.context_length),
        ("embedding_length", "u32", p.n_embd),
        ("block_count", "u32", p.n_layer + p.n_mtp_layers),  # llama.cpp's n_layer_all
        *([("feed_forward_length", "u32", p.n_ff)] if p.n_ff else []),
        ("attention.head_count", "u32", p.n_head),
        ("attention.head_count_kv", "u32", p.n_head_kv),
        ("attention.layer_norm_rms_epsilon", "f32", p.rms_eps),
        ("rope.freq_base", "f32", p.rope_base),
    ]
    if p.arch == "llama":
        kv += [("vocab_size", "u32", n_vocab), ("rope.dimension_count", "u32", p.head_dim)]
    if p.is_hybrid:
        kv += [("ssm.conv_kernel", "u32", p.ssm_conv_kernel),
               ("ssm.state_size", "u32", p.ssm_head_dim),
               ("ssm.group_count", "u32", p.ssm_n_k_heads),
               ("ssm.time_step_rank", "u32", p.ssm_n_v_heads),
               ("ssm.inner_size", "u32", p.ssm_n_v_heads * p.ssm_head_dim),
               ("full_attention_interval", "u32", p.full_attention_interval),
               ("rope.dimension_count", "u32", p.rope_dim or p.head_dim)]
        if p.rope_sections:
            kv.append(("rope.dimension_sections", "i32[]", list(p.rope_sections)))
        if p.n_mtp_layers:
            kv.append(("nextn_predict_layers", "u32", p.n_mtp_layers))
    if p.arch in ("qwen3", "gemma3", "qwen3moe", "qwen35", "qwen35moe", "qwen3next"):
        kv += [("attention.key_length", "u32", p.head_dim),
               ("attention.value_length", "u32", p.head_dim)]
    if p.is_moe:
        kv += [("expert_count", "u32", p.n_expert), ("expert_used_count", "u32", p.n_expert_used),
               ("expert_feed_forward_length", "u32", p.n_ff_exp)]
    if p.has_shared_expert:
        kv.append(("expert_shared_feed_forward_length", "u32", p.n_ff_shexp))
    if p.sliding_window is not None:
        kv.append(("attention.sliding_window", "u32", p.sliding_window))
    if p.swa_pattern is not None:
        kv.append(("attention.sliding_window_pattern", "u32", p.swa_pattern))
    if p.rope_base_swa is not None:
        kv.append(("rope.freq_base_swa", "f32", p.rope_base_swa))
    return kv
