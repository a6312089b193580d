"""Shapes of the synthetic models: a tiny test size per architecture and the real sizes.

The real sizes copy the published configs (layers, widths, heads, rope base, norm eps, window),
so that a random-weight file of that preset has the tensor shapes and memory traffic of the
real model; the vocabulary size comes from the donor tokenizer, not from the preset.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "qwen3moe", "qwen35", "qwen35moe", "qwen3next")
MOE_ARCHS = ("qwen3moe", "qwen35moe", "qwen3next")  # every layer routed experts
HYBRID_ARCHS = ("qwen35", "qwen35moe", "qwen3next")  # Gated DeltaNet + full-attention layers
SHARED_EXPERT_ARCHS = ("qwen35moe", "qwen3next")  # a sigmoid-gated shared expert beside them


@dataclass(frozen=True)
class SynthPreset:
    name: str
    arch: str  # one of ARCHS: the GGUF general.architecture
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int  # may differ from n_embd // n_head (qwen3, gemma3)
    rope_base: float
    rms_eps: float
    context_length: int
    tied_embeddings: bool  # no output.weight: llama.cpp then reuses token_embd as the output
    sliding_window: int | None = None  # gemma3: window of the local layers
    swa_pattern: int | None = None  # gemma3: every n-th layer global; None = key absent (6)
    rope_base_swa: float | None = None  # gemma3: rope base of local layers; None = absent (1e4)
    n_expert: int = 0  # MOE_ARCHS: routed experts per layer (every layer is MoE)
    n_expert_used: int = 0  # MOE_ARCHS: experts per token
    # MOE_ARCHS: hidden width of one expert (n_ff is then only metadata; 0: no
    # feed_forward_length key, as in Qwen3.5-MoE files)
    n_ff_exp: int = 0
    n_ff_shexp: int = 0  # SHARED_EXPERT_ARCHS: the shared expert's hidden width
    # HYBRID_ARCHS: every full_attention_interval-th layer full attention, the others
    # Gated DeltaNet with ssm_n_k_heads q/k heads and ssm_n_v_heads value heads of ssm_head_dim
    full_attention_interval: int = 0
    ssm_conv_kernel: int = 0
    ssm_head_dim: int = 0
    ssm_n_k_heads: int = 0
    ssm_n_v_heads: int = 0
    rope_dim: int = 0  # rotated dims of an attention head; 0: the whole head
    rope_sections: tuple[int, ...] = ()  # qwen35's IMROPE sections (t, h, w, e)
    ssm_in: bool = False  # qwen3next: the older converters' fused q/k/v/z projection (ssm_in)
    # HYBRID_ARCHS: MTP ("nextn") layers after the n_layer main ones (block_count counts both):
    # a full-attention block + feed-forward block each, with nextn.eh_proj/enorm/hnorm and, as
    # the Qwen converters write it, nextn.shared_head_norm; ``mtp_own_embed_head``: instead of
    # shared_head_norm their own nextn.embed_tokens and nextn.shared_head_head (DeepSeek's layout)
    n_mtp_layers: int = 0
    mtp_own_embed_head: bool = False

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"preset {self.name!r}: unknown arch {self.arch!r} (known: {ARCHS})")
        if self.n_head % self.n_head_kv:
            raise ValueError(f"preset {self.name!r}: n_head {self.n_head} is not a multiple of "
                             f"n_head_kv {self.n_head_kv}")
        if self.arch in ("llama", "qwen2") and self.head_dim * self.n_head != self.n_embd:
            raise ValueError(f"preset {self.name!r}: {self.arch} needs head_dim * n_head == n_embd")
        if (self.arch == "gemma3") != (self.sliding_window is not None):
            raise ValueError(f"preset {self.name!r}: sliding_window is for gemma3 only, and needed")
        moe = self.arch in MOE_ARCHS
        if moe != (self.n_expert > 0):
            raise ValueError(f"preset {self.name!r}: n_expert > 0 is for {', '.join(MOE_ARCHS)} only, "
                             "and needed")
        if moe and not (0 < self.n_expert_used <= self.n_expert and self.n_ff_exp > 0):
            raise ValueError(f"preset {self.name!r}: {self.arch} needs 0 < n_expert_used <= n_expert "
                             f"and n_ff_exp > 0")
        if (self.arch in SHARED_EXPERT_ARCHS) != (self.n_ff_shexp > 0):
            raise ValueError(f"preset {self.name!r}: n_ff_shexp > 0 is for "
                             f"{', '.join(SHARED_EXPERT_ARCHS)} only, and needed")
        if self.n_ff == 0 and not moe:
            raise ValueError(f"preset {self.name!r}: a dense {self.arch} model needs n_ff > 0")
        if self.ssm_in and self.arch != "qwen3next":
            raise ValueError(f"preset {self.name!r}: ssm_in is qwen3next's older layout only")
        if self.n_mtp_layers and self.arch not in HYBRID_ARCHS:
            raise ValueError(f"preset {self.name!r}: MTP layers are for {', '.join(HYBRID_ARCHS)} only")
        if self.mtp_own_embed_head and not self.n_mtp_layers:
            raise ValueError(f"preset {self.name!r}: mtp_own_embed_head needs MTP layers")

        hybrid = self.arch in HYBRID_ARCHS
        if hybrid != (self.full_attention_interval > 0):
            raise ValueError(f"preset {self.name!r}: full_attention_interval is for "
                             f"{', '.join(HYBRID_ARCHS)} only, and needed")
        if hybrid and not (self.ssm_conv_kernel > 1 and self.ssm_head_dim > 0 and self.ssm_n_k_heads > 0
                           and self.ssm_n_v_heads % self.ssm_n_k_heads == 0):
            raise ValueError(f"preset {self.name!r}: {self.arch} needs ssm sizes (conv kernel > 1, value "
                             f"heads a multiple of key heads)")

    @property
    def has_shared_expert(self) -> bool:
        return self.n_ff_shexp > 0

    @property
    def is_hybrid(self) -> bool:
        return self.full_attention_interval > 0

    def is_recurrent(self, layer: int) -> bool:
        """A Gated DeltaNet layer (the MTP layers, from n_layer on, are full attention)."""
        return self.is_hybrid and layer < self.n_layer and (layer + 1) % self.full_attention_interval != 0

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0


_PRESETS = [
    # Tiny test models: a few layers, GQA, every width a multiple of 32 (Q8_0/Q4_0 blocks).
    SynthPreset("llama-tiny", "llama", n_layer=2, n_embd=128, n_ff=256, n_head=4, n_head_kv=2,
                head_dim=32, rope_base=500000.0, rms_eps=1e-5, context_length=2048,
                tied_embeddings=False),
    # every width a multiple of 256: the k-quant formats' blocks fit every matrix
    SynthPreset("llama-tiny-k", "llama", n_layer=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2,
                head_dim=64, rope_base=500000.0, rms_eps=1e-5, context_length=2048,
                tied_embeddings=False),
    SynthPreset("qwen2-tiny", "qwen2", n_layer=2, n_embd=128, n_ff=256, n_head=4, n_head_kv=2,
                head_dim=32, rope_base=1000000.0, rms_eps=1e-6, context_length=2048,
                tied_embeddings=True),
    SynthPreset("qwen3-tiny", "qwen3", n_layer=3, n_embd=64, n_ff=192, n_head=4, n_head_kv=2,
                head_dim=32, rope_base=1000000.0, rms_eps=1e-6, context_length=2048,
                tied_embeddings=True),
    # Six layers so that the default pattern (every 6th layer global) has one global layer;
    # a window of 8 so that a short test sequence already slides.
    SynthPreset("gemma3-tiny", "gemma3", n_layer=6, n_embd=64, n_ff=128, n_head=2, n_head_kv=1,
                head_dim=64, rope_base=1000000.0, rms_eps=1e-6, context_length=2048,
                tied_embeddings=True, sliding_window=8),
    # MoE: 8 layers so that llama.cpp's layer-dependent mix rules (first/last eighth, every
    # third layer) all occur; widths multiples of 256 so that every block size fits (k-quants
    # too); n_ff_exp != n_embd so that a swapped expert shape shows; 4 experts, not 8: llama.cpp
    # has special mix rules for exactly 8 (Mixtral) that the real qwen3moe sizes do not meet.
    SynthPreset("qwen3moe-tiny", "qwen3moe", n_layer=8, n_embd=256, n_ff=1024, n_head=4,
                n_head_kv=2, head_dim=64, rope_base=1000000.0, rms_eps=1e-6,
                context_length=2048, tied_embeddings=False, n_expert=4, n_expert_used=2,
                n_ff_exp=512),
    # Hybrid: layers 0-2 Gated DeltaNet, 3 full attention (interval 4); 2 key heads, 4 value
    # heads (so the head sharing shows); partial RoPE (16 of 32 dims) with IMROPE sections.
    SynthPreset("qwen35-tiny", "qwen35", n_layer=4, n_embd=64, n_ff=128, n_head=4, n_head_kv=2,
                head_dim=32, rope_base=10000000.0, rms_eps=1e-6, context_length=2048,
                tied_embeddings=True, full_attention_interval=4, ssm_conv_kernel=4,
                ssm_head_dim=16, ssm_n_k_heads=2, ssm_n_v_heads=4, rope_dim=16,
                rope_sections=(3, 3, 2, 0)),
    # Hybrid MoE: qwen35-tiny's layers with 16 routed experts (4 a token, <= 16 so that equal
    # probs are ordered as llama.cpp's insertion sort orders them) and a shared expert of another
    # width than the experts' (a swapped shape shows); no feed_forward_length, as Qwen3.5-MoE.
    SynthPreset("qwen35moe-tiny", "qwen35moe", n_layer=4, n_embd=64, n_ff=0, n_head=4, n_head_kv=2,
                head_dim=32, rope_base=10000000.0, rms_eps=1e-6, context_length=2048,
                tied_embeddings=False, n_expert=16, n_expert_used=4, n_ff_exp=32, n_ff_shexp=64,
                full_attention_interval=4, ssm_conv_kernel=4, ssm_head_dim=16, ssm_n_k_heads=2,
                ssm_n_v_heads=4, rope_dim=16, rope_sections=(3, 3, 2, 0)),
    # qwen3next: 2 key heads, 4 value heads (the grouped head map differs from qwen35's tiled
    # one), a quarter of each attention head rotated (as the real model), 5 of 16 experts.
    SynthPreset("qwen3next-tiny", "qwen3next", n_layer=4, n_embd=64, n_ff=128, n_head=4, n_head_kv=2,
                head_dim=32, rope_base=5000000.0, rms_eps=1e-6, context_length=2048,
                tied_embeddings=False, n_expert=16, n_expert_used=5, n_ff_exp=32, n_ff_shexp=64,
                full_attention_interval=4, ssm_conv_kernel=4, ssm_head_dim=16, ssm_n_k_heads=2,
                ssm_n_v_heads=4, rope_dim=8),
    # the same shapes in the older converters' layout (ssm_in: q, k, v, z per key head)
    SynthPreset("qwen3next-tiny-ssmin", "qwen3next", n_layer=4, n_embd=64, n_ff=128, n_head=4,
                n_head_kv=2, head_dim=32, rope_base=5000000.0, rms_eps=1e-6, context_length=2048,
                tied_embeddings=False, n_expert=16, n_expert_used=5, n_ff_exp=32, n_ff_shexp=64,
                full_attention_interval=4, ssm_conv_kernel=4, ssm_head_dim=16, ssm_n_k_heads=2,
                ssm_n_v_heads=4, rope_dim=8, ssm_in=True),
    # Real sizes.
    SynthPreset("llama-1b", "llama", n_layer=16, n_embd=2048, n_ff=8192, n_head=32, n_head_kv=8,
                head_dim=64, rope_base=500000.0, rms_eps=1e-5, context_length=131072,
                tied_embeddings=True),
    SynthPreset("llama-8b", "llama", n_layer=32, n_embd=4096, n_ff=14336, n_head=32, n_head_kv=8,
                head_dim=128, rope_base=500000.0, rms_eps=1e-5, context_length=131072,
                tied_embeddings=False),
    SynthPreset("qwen2-0.5b", "qwen2", n_layer=24, n_embd=896, n_ff=4864, n_head=14, n_head_kv=2,
                head_dim=64, rope_base=1000000.0, rms_eps=1e-6, context_length=32768,
                tied_embeddings=True),
    SynthPreset("qwen3-0.6b", "qwen3", n_layer=28, n_embd=1024, n_ff=3072, n_head=16, n_head_kv=8,
                head_dim=128, rope_base=1000000.0, rms_eps=1e-6, context_length=40960,
                tied_embeddings=True),
    SynthPreset("qwen3-4b", "qwen3", n_layer=36, n_embd=2560, n_ff=9728, n_head=32, n_head_kv=8,
                head_dim=128, rope_base=1000000.0, rms_eps=1e-6, context_length=40960,
                tied_embeddings=True),
    SynthPreset("gemma3-270m", "gemma3", n_layer=18, n_embd=640, n_ff=2048, n_head=4, n_head_kv=1,
                head_dim=256, rope_base=1000000.0, rms_eps=1e-6, context_length=32768,
                tied_embeddings=True, sliding_window=512),
    # Qwen3-30B-A3B: n_ff is the config's intermediate_size (metadata only, no dense layer).
    SynthPreset("qwen3moe-30b-a3b", "qwen3moe", n_layer=48, n_embd=2048, n_ff=6144, n_head=32,
                n_head_kv=4, head_dim=128, rope_base=1000000.0, rms_eps=1e-6,
                context_length=40960, tied_embeddings=False, n_expert=128, n_expert_used=8,
                n_ff_exp=768),
]

_PRESETS += [
    # Qwen3.5-0.8B and -4B (text decoder): head 256 with a quarter rotated, mrope [11, 11, 10].
    SynthPreset("qwen35-0.8b", "qwen35", n_layer=24, n_embd=1024, n_ff=3584, n_head=8, n_head_kv=2,
                head_dim=256, rope_base=10000000.0, rms_eps=1e-6, context_length=262144,
                tied_embeddings=True, full_attention_interval=4, ssm_conv_kernel=4,
                ssm_head_dim=128, ssm_n_k_heads=16, ssm_n_v_heads=16, rope_dim=64,
                rope_sections=(11, 11, 10, 0)),
    SynthPreset("qwen35-4b", "qwen35", n_layer=32, n_embd=2560, n_ff=9216, n_head=16, n_head_kv=4,
                head_dim=256, rope_base=10000000.0, rms_eps=1e-6, context_length=262144,
                tied_embeddings=True, full_attention_interval=4, ssm_conv_kernel=4,
                ssm_head_dim=128, ssm_n_k_heads=16, ssm_n_v_heads=32, rope_dim=64,
                rope_sections=(11, 11, 10, 0)),
]

_PRESETS += [
    # Qwen3.5-35B-A3B (and Qwen3.6-35B-A3B, the same shapes), text decoder: 40 layers, 256
    # experts of 512 (8 a token) + a shared one of 512, no dense intermediate_size.
    SynthPreset("qwen35moe-35b-a3b", "qwen35moe", n_layer=40, n_embd=2048, n_ff=0, n_head=16,
                n_head_kv=2, head_dim=256, rope_base=10000000.0, rms_eps=1e-6, context_length=262144,
                tied_embeddings=False, n_expert=256, n_expert_used=8, n_ff_exp=512, n_ff_shexp=512,
                full_attention_interval=4, ssm_conv_kernel=4, ssm_head_dim=128, ssm_n_k_heads=16,
                ssm_n_v_heads=32, rope_dim=64, rope_sections=(11, 11, 10, 0)),
    # Qwen3-Next-80B-A3B: 48 layers, 512 experts of 512 (10 a token) + a shared one of 512,
    # intermediate_size 5120 (metadata), rope theta 5e6 on a quarter of each head of 256.
    SynthPreset("qwen3next-80b-a3b", "qwen3next", n_layer=48, n_embd=2048, n_ff=5120, n_head=16,
                n_head_kv=2, head_dim=256, rope_base=5000000.0, rms_eps=1e-6, context_length=262144,
                tied_embeddings=False, n_expert=512, n_expert_used=10, n_ff_exp=512, n_ff_shexp=512,
                full_attention_interval=4, ssm_conv_kernel=4, ssm_head_dim=128, ssm_n_k_heads=16,
                ssm_n_v_heads=32, rope_dim=64),
]

# MTP variants of the tiny hybrids: the same main weights (each tensor draws from its own name's
# seed), one MTP layer more. qwen35moe's with its own embedding and head, the other two as the
# Qwen converters write them (shared_head_norm; token_embd and the output head shared).
_TINY = {p.name: p for p in _PRESETS}
_PRESETS += [
    replace(_TINY["qwen35-tiny"], name="qwen35-tiny-mtp", n_mtp_layers=1),
    replace(_TINY["qwen35moe-tiny"], name="qwen35moe-tiny-mtp", n_mtp_layers=1, mtp_own_embed_head=True),
    replace(_TINY["qwen3next-tiny"], name="qwen3next-tiny-mtp", n_mtp_layers=1),
]

PRESETS: dict[str, SynthPreset] = {p.name: p for p in _PRESETS}

# Token count of the real model's vocabulary (llama-bpe, qwen2, gemma3 donors): only for the
# sizes that ``deimos synth --list`` reports; a written file takes its donor's count.
TYPICAL_VOCAB = {"llama": 128256, "qwen2": 151936, "qwen3": 151936, "qwen3moe": 151936, "qwen35": 248320,
                 "qwen35moe": 248320, "qwen3next": 151936, "gemma3": 262144}


def get_preset(name: str) -> SynthPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown synth preset {name!r}; known: {', '.join(PRESETS)}") from None
