"""Model hyper-parameters, read once from GGUF metadata into a frozen dataclass.

Nothing below this boundary reads raw metadata keys. Defaults follow llama.cpp
(src/llama-model.cpp and src/models/<arch>.cpp) so that the same file means the
same model in both engines.

The metadata is untrusted: every count and size is checked for type and range, against the
other keys, and (given the file's tensor table) against the tensors actually present, before
anything is allocated or looped over. A forged ``block_count`` of 2**31 - 1 is an error in
microseconds, not a loop; each error names the file, the key(s) and the tensor.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np


class ConfigError(ValueError):
    """A model file's metadata is missing a key, has a wrong value, or names an unsupported model."""


SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "qwen3moe", "qwen35", "qwen35moe",
                           "qwen3next")
# Gated DeltaNet layers with full-attention layers between
_HYBRID_ARCHITECTURES = ("qwen35", "qwen35moe", "qwen3next")
_MOE_ARCHITECTURES = ("qwen3moe", "qwen35moe", "qwen3next")  # every layer's MLP is routed experts
# routed experts plus a shared expert gated by sigmoid(x . ffn_gate_inp_shexp)
_SHARED_EXPERT_ARCHITECTURES = ("qwen35moe", "qwen3next")

# Rotary embedding variants: "norm" rotates adjacent pairs (x0,x1),(x2,x3)...;
# "neox" rotates the two halves (x_i, x_{i+d/2}).
_ROPE_TYPE = {"llama": "norm", "qwen2": "neox", "qwen3": "neox", "gemma3": "neox", "qwen3moe": "neox",
              "qwen35": "neox", "qwen35moe": "neox",  # IMROPE; for text (t = h = w) neox (checked)
              "qwen3next": "neox"}
_IMROPE_ARCHITECTURES = ("qwen35", "qwen35moe")  # rope.dimension_sections read and checked

MAX_LAYERS = 512  # llama.cpp's LLAMA_MAX_LAYERS: it asserts 0 < block_count <= this
MAX_EXPERTS = 1024  # llama.cpp's LLAMA_MAX_EXPERTS: it asserts expert_count <= this
_U32_MAX = 2**32 - 1  # llama.cpp reads the counts and sizes into uint32
_F32_MAX = float(np.finfo(np.float32).max)
_LAYER_RE = re.compile(r"blk\.(\d+)\.")


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int  # per-head width of q and k
    head_dim_v: int  # per-head width of v
    n_ff: int
    rms_eps: float
    context_length: int
    rope_type: str  # "norm" | "neox"
    rope_dim: int  # leading dims of each head that are rotated
    rope_base: float
    rope_scale: float  # position multiplier (1 / linear scaling factor)
    attn_scale: float  # multiplies q.k
    activation: str  # "silu" | "gelu_tanh": the gated MLP's gate activation
    embed_scale: float = 1.0  # multiplies token embeddings (gemma: sqrt(n_embd))
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (qwen3, gemma3)
    sandwich_norm: bool = False  # extra norms after attention and after the MLP (gemma3)
    sliding_window: int = 0  # 0: every layer attends to the whole context
    swa_layers: tuple[bool, ...] = ()  # per layer: uses the sliding window
    rope_base_swa: float = 10000.0  # rope base of the sliding-window layers
    final_logit_softcap: float = 0.0
    # mixture of experts (qwen3moe); n_expert 0: a dense gated MLP of n_ff
    n_expert: int = 0  # routed experts per layer
    n_expert_used: int = 0  # experts each token goes to (top-k of the router's softmax)
    n_ff_exp: int = 0  # hidden width of one expert's gated MLP
    expert_weights_norm: bool = False  # the k chosen weights rescaled to sum 1
    n_ff_shexp: int = 0  # shared expert's hidden width (qwen35moe, qwen3next); 0: no shared expert
    # hybrid (qwen35, qwen35moe, qwen3next): Gated DeltaNet layers; () = every layer full attention
    recurrent_layers: tuple[bool, ...] = ()  # per layer: a Gated DeltaNet (linear attention) layer
    ssm_conv_kernel: int = 0  # K: width of the short causal convolution ('ssm.conv_kernel')
    ssm_head_dim: int = 0  # Dk = Dv: width of a key/value head ('ssm.state_size')
    ssm_n_k_heads: int = 0  # Hk: q/k heads ('ssm.group_count')
    ssm_n_v_heads: int = 0  # Hv: value heads, one state [Dv, Dk] each ('ssm.time_step_rank')
    attn_output_gate: bool = False  # attn_q carries a sigmoid gate per head after q (the hybrids)
    # MTP (multi-token prediction, "nextn") layers: blk.n_layer .. blk.n_layer + n_mtp_layers - 1,
    # after the main layers ('<arch>.block_count' counts both, '<arch>.nextn_predict_layers' the
    # MTP ones); the main forward never runs them (deimos.models.mtp)
    n_mtp_layers: int = 0

    @property
    def is_hybrid(self) -> bool:
        return bool(self.recurrent_layers)

    def is_recurrent(self, layer: int) -> bool:
        """Layer ``layer`` is a Gated DeltaNet layer (never an MTP layer: they are full attention)."""
        return layer < len(self.recurrent_layers) and self.recurrent_layers[layer]

    @property
    def mtp_layers(self) -> range:
        """The MTP layers' indices (blk.N) in the file: after the main layers."""
        return range(self.n_layer, self.n_layer + self.n_mtp_layers)

    @property
    def ssm_conv_dim(self) -> int:
        """Channels of the convolution: q, k (Hk x Dk each) and v (Hv x Dv)."""
        return (2 * self.ssm_n_k_heads + self.ssm_n_v_heads) * self.ssm_head_dim

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0

    @property
    def has_shared_expert(self) -> bool:
        return self.n_ff_shexp > 0

    @property
    def n_gqa(self) -> int:
        return self.n_head // self.n_head_kv

    def is_swa(self, layer: int) -> bool:
        return bool(self.swa_layers) and self.swa_layers[layer]

    def layer_rope_base(self, layer: int) -> float:
        return self.rope_base_swa if self.is_swa(layer) else self.rope_base

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any], source: str = "model",
                  tensors: Mapping[str, Any] | None = None) -> ModelConfig:
        """Build the config from a GGUF file's metadata; ``source`` names the file in errors.

        ``tensors`` (``GGUFFile.tensors``): the counts and sizes are also checked against the
        tensors present (layers, embedding and per-layer matrix shapes), so that a config
        that passes describes the weights in the file.
        """
        cfg = _Reader(metadata, source).config(tensors)
        if tensors is not None:
            _check_tensors(cfg, tensors, metadata, source)
        return cfg


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


class _Reader:
    def __init__(self, metadata: Mapping[str, Any], source: str) -> None:
        self.md = metadata
        self.source = source
        arch = metadata.get("general.architecture")
        if not isinstance(arch, str):
            what = "missing" if arch is None else f"not a string ({arch!r:.60})"
            raise ConfigError(f"{source}: metadata key 'general.architecture' is {what}")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"{source}: architecture {arch!r:.60} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        self.arch = arch

    def fail(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.source}: metadata key '{self.arch}.{key}' {problem}")

    def _raw(self, key: str, required: bool) -> Any:
        full = f"{self.arch}.{key}"
        if full not in self.md:
            if required:
                raise ConfigError(f"{self.source}: required metadata key '{full}' is missing")
            return None
        return self.md[full]

    def int(self, key: str, default: int | None = None, lo: int = 1, hi: int = _U32_MAX) -> int:
        """An integer in [lo, hi]; ``default`` (not checked) when the key is absent."""
        value = self._raw(key, default is None)
        if value is None:
            return default  # type: ignore[return-value]
        if not _is_int(value):
            raise self.fail(key, f"must be an integer, got {value!r:.60}")
        return self._in_range(key, int(value), lo, hi)

    def _in_range(self, key: str, value: int, lo: int, hi: int) -> int:
        if not lo <= value <= hi:
            raise self.fail(key, f"is {value}, outside [{lo}, {hi}]")
        return value

    def per_layer(self, key: str, n_layer: int, default: int | None = None, lo: int = 1,
                  hi: int = _U32_MAX) -> int:
        """A count that llama.cpp allows per layer (get_key_or_arr): a scalar, or an array of
        ``n_layer`` entries; Deimos runs only models where every layer has the same value."""
        value = self._raw(key, default is None)
        if value is None:
            return default  # type: ignore[return-value]
        if isinstance(value, np.ndarray):
            if value.ndim != 1 or value.dtype.kind not in "iu":
                raise self.fail(key, f"must be an integer or an array of integers, got {value.dtype} array")
            if len(value) != n_layer:
                raise self.fail(key, f"has {len(value)} entries, expected one per layer "
                                     f"(block_count {n_layer})")
            values = {int(x) for x in value}
            if len(values) != 1:
                raise self.fail(key, f"varies by layer ({sorted(values)[:8]}): per-layer "
                                     "values are not supported")
            return self._in_range(key, values.pop(), lo, hi)
        return self.int(key, default, lo, hi)

    def float(self, key: str, default: float | None = None, lo: float = -math.inf,
              positive: bool = False) -> float:
        """A finite number >= lo (> 0 with ``positive``); ``default`` when the key is absent."""
        value = self._raw(key, default is None)
        if value is None:
            return default  # type: ignore[return-value]
        if not (_is_int(value) or isinstance(value, (float, np.floating))) or not math.isfinite(value):
            raise self.fail(key, f"must be a finite number, got {value!r:.60}")
        value = float(value)
        if value < lo or (positive and value <= 0):
            raise self.fail(key, f"is {value!r}, must be {'> 0' if positive else f'>= {lo}'}")
        return value

    def config(self, tensors: Mapping[str, Any] | None) -> ModelConfig:
        arch = self.arch
        # llama.cpp's n_layer_all: the main layers and the MTP layers after them
        n_all = self.int("block_count", hi=MAX_LAYERS)
        if tensors is not None:
            # before anything loops over the layers: the count must be what the file holds
            _check_layer_count(n_all, tensors, f"{self.source}: metadata key '{arch}.block_count'")
        n_mtp = self._mtp_layers(n_all)
        n_layer = n_all - n_mtp  # llama.cpp's hparams.n_layer(): what the main graph runs
        if tensors is not None and (n_mtp or arch in _HYBRID_ARCHITECTURES):
            _check_mtp_count(arch, n_layer, n_all, tensors, self.md, self.source)
        n_embd = self.int("embedding_length")
        n_head = self.per_layer("attention.head_count", n_all)
        n_head_kv = self.per_layer("attention.head_count_kv", n_all, n_head)
        if n_head % n_head_kv:
            raise ConfigError(
                f"{self.source}: metadata key '{arch}.attention.head_count' {n_head} is not a "
                f"multiple of '{arch}.attention.head_count_kv' {n_head_kv}"
            )
        if self._raw("attention.key_length", False) is None and n_embd % n_head:
            if n_head > n_embd:
                raise ConfigError(
                    f"{self.source}: metadata key '{arch}.attention.head_count' {n_head} is larger "
                    f"than '{arch}.embedding_length' {n_embd} (a head would have no width)"
                )
            raise ConfigError(
                f"{self.source}: metadata key '{arch}.embedding_length' {n_embd} is not a multiple "
                f"of '{arch}.attention.head_count' {n_head} (and there is no "
                f"'{arch}.attention.key_length' to give the head size)"
            )
        head_dim = self.int("attention.key_length", n_embd // n_head)
        head_dim_v = self.int("attention.value_length", head_dim)
        n_vocab = self._vocab_size()
        rope_dim = self.int("rope.dimension_count", head_dim)
        if rope_dim > head_dim or rope_dim % 2:
            raise self.fail("rope.dimension_count", f"{rope_dim} does not fit the head size {head_dim} "
                                                    "(must be even and at most the head size)")

        scaling = self._raw("rope.scaling.type", False)
        if scaling is None:
            scaling = "linear"
        if not isinstance(scaling, str) or scaling not in ("none", "linear"):
            raise self.fail("rope.scaling.type",
                            f"is {scaling!r:.60}: only 'none' and 'linear' are supported")
        factor = self.float("rope.scaling.factor", 0.0, lo=0.0)
        rope_scale = 1.0 / factor if factor and scaling == "linear" else 1.0
        if not 0.0 < rope_scale <= _F32_MAX:  # the rotation runs in float32
            raise self.fail("rope.scaling.factor", f"{factor!r} gives no usable position scale")

        moe = arch in _MOE_ARCHITECTURES
        if moe:  # its feed_forward_length is metadata only (llama.cpp: optional)
            n_ff = self.per_layer("feed_forward_length", n_all, 0, lo=0)
        else:
            n_ff = self.per_layer("feed_forward_length", n_all)
        common = dict(
            arch=arch,
            n_vocab=n_vocab,
            n_embd=n_embd,
            n_layer=n_layer,
            n_mtp_layers=n_mtp,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            head_dim_v=head_dim_v,
            n_ff=n_ff,
            rms_eps=self.float("attention.layer_norm_rms_epsilon", positive=True),
            context_length=self.int("context_length", 4096),
            rope_type=_ROPE_TYPE[arch],
            rope_dim=rope_dim,
            rope_base=self.float("rope.freq_base", 10000.0, positive=True),
            rope_scale=rope_scale,
            attn_scale=self.float("attention.scale", 0.0, lo=0.0) or 1.0 / math.sqrt(head_dim),
            activation="silu",
            final_logit_softcap=self.float("final_logit_softcapping", 0.0, lo=0.0),
        )
        if arch in ("qwen3", "qwen3moe"):
            common["qk_norm"] = True
        if moe:
            common.update(self._experts(n_all, n_ff))
        if arch in _HYBRID_ARCHITECTURES:
            common.update(self._hybrid(n_layer, n_all, rope_dim), qk_norm=True, attn_output_gate=True)
        if arch == "gemma3":
            common.update(self._sliding_window(n_layer))
            # gemma3 27B scales by the model width per head; the others by the head size
            width = n_embd // n_head if n_layer == 62 else head_dim
            if width == 0:
                raise ConfigError(f"{self.source}: metadata key '{arch}.attention.head_count' {n_head} "
                                  f"is larger than '{arch}.embedding_length' {n_embd}")
            common.update(
                embed_scale=math.sqrt(n_embd),
                qk_norm=True,
                sandwich_norm=True,
                activation="gelu_tanh",
                attn_scale=1.0 / math.sqrt(width),
            )
        return ModelConfig(**common)

    def _mtp_layers(self, n_all: int) -> int:
        """'<arch>.nextn_predict_layers': how many of the 'block_count' layers are MTP layers
        (llama.cpp's n_layer_nextn; 0 when absent). The hybrids only: llama.cpp's other graphs
        here do not know them."""
        a, key = self.arch, "nextn_predict_layers"
        n = self.int(key, 0, lo=0)
        if n and a not in _HYBRID_ARCHITECTURES:
            raise self.fail(key, f"is {n}: MTP layers are supported for "
                                 f"{', '.join(_HYBRID_ARCHITECTURES)} only, not {a}")
        if n >= n_all:
            raise ConfigError(f"{self.source}: metadata key '{a}.{key}' {n} leaves no main layer of "
                              f"'{a}.block_count' {n_all} (a file of the MTP head alone is not "
                              "supported)")
        return n

    def _experts(self, n_all: int, n_ff: int) -> dict[str, Any]:
        a = self.arch
        n_expert = self.int("expert_count", hi=MAX_EXPERTS)
        n_used = self.per_layer("expert_used_count", n_all)
        if n_used > n_expert:
            raise ConfigError(f"{self.source}: metadata key '{a}.expert_used_count' {n_used} is greater "
                              f"than '{a}.expert_count' {n_expert}")
        groups = self.int("expert_group_count", 0, lo=0)
        if groups > 1:  # llama.cpp would pick groups of experts first (DeepSeek V3's routing)
            raise self.fail("expert_group_count", f"is {groups}: grouped expert selection is not "
                                                  "supported")
        # llama.cpp's fallback when the key is absent: feed_forward_length / expert_used_count
        n_ff_exp = self.per_layer("expert_feed_forward_length", n_all, n_ff // n_used)
        if n_ff_exp == 0:
            raise ConfigError(f"{self.source}: metadata key '{a}.expert_feed_forward_length' is missing "
                              f"and '{a}.feed_forward_length' {n_ff} / '{a}.expert_used_count' "
                              f"{n_used} gives no expert width")
        # qwen3moe, qwen35moe and qwen3next renormalize the top-k weights: llama.cpp's graphs
        # pass norm_w = true and read neither '<arch>.expert_weights_norm' nor
        # '<arch>.expert_weights_scale' (so a file's value of either changes nothing there, and
        # nothing here)
        out = {"n_expert": n_expert, "n_expert_used": n_used, "n_ff_exp": n_ff_exp,
               "expert_weights_norm": True}
        if a in _SHARED_EXPERT_ARCHITECTURES:
            # llama.cpp: expert_shared_feed_forward_length, where absent or 0 the feed_forward_length
            n_ff_shexp = self.int("expert_shared_feed_forward_length", 0, lo=0) or n_ff
            if n_ff_shexp == 0:
                raise ConfigError(f"{self.source}: metadata key '{a}.expert_shared_feed_forward_length' "
                                  f"is missing and there is no '{a}.feed_forward_length' to give the "
                                  "shared expert's width")
            out["n_ff_shexp"] = n_ff_shexp
        return out

    def _hybrid(self, n_layer: int, n_all: int, rope_dim: int) -> dict[str, Any]:
        """The Gated DeltaNet sizes and layer pattern (llama_model_qwen35::load_arch_hparams; the
        same keys for qwen35moe and qwen3next) of the ``n_layer`` main layers; the pattern
        array has an entry for each of the ``n_all`` layers, 0 for the MTP ones."""
        a = self.arch
        d_conv = self.int("ssm.conv_kernel", hi=64)
        d_inner = self.int("ssm.inner_size")
        d_state = self.int("ssm.state_size", hi=4096)
        n_v = self.int("ssm.time_step_rank", hi=4096)
        n_k = self.int("ssm.group_count", hi=4096)
        if n_v % n_k:
            raise ConfigError(f"{self.source}: metadata key '{a}.ssm.time_step_rank' {n_v} (value heads) "
                              f"is not a multiple of '{a}.ssm.group_count' {n_k} (key heads)")
        if d_inner != d_state * n_v:  # llama.cpp sizes tensors by state_size, the graph by inner/rank
            raise ConfigError(f"{self.source}: metadata key '{a}.ssm.inner_size' {d_inner} is not "
                              f"'{a}.ssm.state_size' {d_state} x '{a}.ssm.time_step_rank' {n_v}")
        key = "attention.recurrent_layers"
        pattern = self._raw(key, False)
        if pattern is not None:
            if not isinstance(pattern, np.ndarray) or pattern.ndim != 1 or pattern.dtype.kind not in "biu":
                raise self.fail(key, "must be an array of per-layer flags")
            if len(pattern) != n_all:
                raise self.fail(key, f"has {len(pattern)} entries, expected one per layer "
                                     f"(block_count {n_all})")
            marked = [i for i in range(n_layer, n_all) if pattern[i]]
            if marked:  # llama.cpp's MTP block is full attention whatever the array says
                raise self.fail(key, f"marks layer {marked[0]} recurrent, but it is an MTP layer "
                                     f"(full attention) by '{a}.nextn_predict_layers' {n_all - n_layer}")
            recurrent = tuple(bool(x) for x in pattern[:n_layer])
        else:
            interval = self.int("full_attention_interval", 4, hi=MAX_LAYERS)
            recurrent = tuple((i + 1) % interval != 0 for i in range(n_layer))
        sections = self._raw("rope.dimension_sections", False) if a in _IMROPE_ARCHITECTURES else None
        if sections is not None:  # (qwen3next's plain neox RoPE reads no sections)
            # IMROPE: rotated pair i takes the t/h/w position (all equal for text) when its
            # sector i % sum(sections) falls in sections[0..2], else the e position (0 for
            # text): the neox rotation used here needs every pair in t/h/w
            if not isinstance(sections, np.ndarray) or sections.dtype.kind not in "iu" or len(sections) > 4:
                raise self.fail("rope.dimension_sections", "must be an array of at most 4 integers")
            sec = [int(x) for x in sections] + [0] * (4 - len(sections))
            total = sum(sec)
            for i in range(rope_dim // 2):
                r = i % total if total else 0
                if not ((r % 3 == 0 and r < 3 * sec[0]) or (r % 3 == 1 and r < 3 * sec[1])
                        or (r % 3 == 2 and r < 3 * sec[2])):
                    raise self.fail("rope.dimension_sections",
                                    f"{sec} leave rotated pair {i} of '{a}.rope.dimension_count' "
                                    f"{rope_dim} to the 4th (e) section: not supported")
        return {"recurrent_layers": recurrent, "ssm_conv_kernel": d_conv, "ssm_head_dim": d_state,
                "ssm_n_k_heads": n_k, "ssm_n_v_heads": n_v}

    def _vocab_size(self) -> int:
        # as llama.cpp: the tokenizer's token count; '<arch>.vocab_size' only without tokens
        tokens = self.md.get("tokenizer.ggml.tokens")
        if tokens is None:
            return self.int("vocab_size")
        if not isinstance(tokens, list) or not tokens:
            raise ConfigError(f"{self.source}: metadata key 'tokenizer.ggml.tokens' must be a "
                              f"non-empty string array, got {type(tokens).__name__}")
        return len(tokens)

    def _sliding_window(self, n_layer: int) -> dict[str, Any]:
        window = self.int("attention.sliding_window", 0, lo=0)
        if not window:
            return {}
        key = "attention.sliding_window_pattern"
        pattern = self._raw(key, False)
        if isinstance(pattern, np.ndarray):  # llama.cpp: an array gives each layer's flag
            if pattern.ndim != 1 or pattern.dtype.kind not in "biu":
                raise self.fail(key, f"must be an integer or an array of flags, got {pattern.dtype} array")
            if len(pattern) != n_layer:
                raise self.fail(key, f"has {len(pattern)} entries, expected one per layer "
                                     f"(block_count {n_layer})")
            swa = tuple(bool(x) for x in pattern)
        else:
            # every period-th layer attends globally; 0: every layer slides (set_swa_pattern)
            period = self.int(key, 6, lo=0)
            swa = tuple(period == 0 or (i % period < period - 1) for i in range(n_layer))
        return dict(sliding_window=window, swa_layers=swa,
                    rope_base_swa=self.float("rope.freq_base_swa", 10000.0, positive=True))


def _check_layer_count(n_layer: int, tensors: Mapping[str, Any], what: str) -> None:
    present = set()
    for name in tensors:
        m = _LAYER_RE.match(name)
        if m:
            present.add(int(m.group(1)))
    if present != set(range(n_layer)):
        if not present:
            held = "no layer tensors (blk.N.*)"
        elif present == set(range(len(present))):
            held = f"tensors of {len(present)} layers (blk.0 .. blk.{len(present) - 1})"
        else:  # a gap (the first one; a forged blk.2147483647 is no loop)
            gap = next(i for i in range(len(present) + 1) if i not in present)
            held = f"layer tensors up to blk.{max(present)} with blk.{gap} missing"
        raise ConfigError(f"{what} is {n_layer}, but the file has {held}")


_NEXTN_RE = re.compile(r"blk\.(\d+)\.nextn\.")


def _check_mtp_count(arch: str, n_layer: int, n_all: int, tensors: Mapping[str, Any],
                     md: Mapping[str, Any], source: str) -> None:
    """'<arch>.nextn_predict_layers' against the tensors: every MTP layer has its
    nextn.eh_proj, no main layer has a nextn tensor. Errors name the key and the tensor."""
    key = f"{arch}.nextn_predict_layers"
    n_mtp = n_all - n_layer
    count = f"'{key}' {n_mtp}" if key in md else f"'{key}' absent (0)"
    for name in tensors:
        m = _NEXTN_RE.match(name)
        if m and int(m.group(1)) < n_layer:
            raise ConfigError(f"{source}: tensor '{name}' is an MTP (nextn) tensor of layer "
                              f"{m.group(1)}, but metadata key {count} makes layer {m.group(1)} a "
                              f"main layer (of '{arch}.block_count' {n_all})")
    for i in range(n_layer, n_all):
        name = f"blk.{i}.nextn.eh_proj.weight"
        if name not in tensors:
            raise ConfigError(f"{source}: metadata key {count} makes blk.{n_layer} .. blk.{n_all - 1} "
                              f"the MTP layers (of '{arch}.block_count' {n_all}), but tensor "
                              f"'{name}' is missing")


def _check_tensors(cfg: ModelConfig, tensors: Mapping[str, Any], md: Mapping[str, Any], source: str) -> None:
    """Every tensor the architecture reads is present with the shape the config implies
    (ggml order, ne0 first). The message names the keys the expected size comes from."""
    a = cfg.arch
    embd = f"'{a}.embedding_length' {cfg.n_embd}"
    vocab = f"the vocabulary size {cfg.n_vocab} ('tokenizer.ggml.tokens')"
    if "tokenizer.ggml.tokens" not in md:
        vocab = f"'{a}.vocab_size' {cfg.n_vocab}"
    has_k, has_v = f"{a}.attention.key_length" in md, f"{a}.attention.value_length" in md
    k_from = f"'{a}.attention.key_length'" if has_k else "embedding_length / head_count"
    v_from = f"'{a}.attention.value_length'" if has_v else "the head size"
    hd = f"head size {cfg.head_dim} ({k_from})"
    vd = f"value size {cfg.head_dim_v} ({v_from})"
    q = f"'{a}.attention.head_count' {cfg.n_head} x {hd}"
    k = f"'{a}.attention.head_count_kv' {cfg.n_head_kv} x {hd}"
    v = f"'{a}.attention.head_count_kv' {cfg.n_head_kv} x {vd}"
    o = f"'{a}.attention.head_count' {cfg.n_head} x {vd}"

    def expect(name: str, dims: tuple[tuple[int, str], ...], required: bool = True) -> None:
        info = tensors.get(name)
        if info is None:
            if required:
                raise ConfigError(f"{source}: tensor '{name}' is missing")
            return
        want = tuple(n for n, _ in dims)
        if tuple(info.dims) != want:
            why = "; ".join(f"ne{i} = {n} from {src}" for i, (n, src) in enumerate(dims))
            raise ConfigError(f"{source}: tensor '{name}' has dims {list(info.dims)}, expected "
                              f"{list(want)} ({why})")

    width, rows = (cfg.n_embd, embd), (cfg.n_vocab, vocab)
    expect("token_embd.weight", (width, rows))
    expect("output.weight", (width, rows), required=False)
    expect("output_norm.weight", (width,))
    rope = f"'{a}.rope.dimension_count' {cfg.rope_dim} / 2"
    expect("rope_freqs.weight", ((cfg.rope_dim // 2, rope),), required=False)
    norms = ["attn_norm", "ffn_norm"]
    if cfg.is_hybrid:  # qwen35: the MLP's norm is post_attention_norm
        norms = ["attn_norm", "post_attention_norm"]
    if cfg.attn_output_gate:  # attn_q: q and its gate, per head
        q = f"2 x {q}"
    if cfg.sandwich_norm:
        norms += ["post_attention_norm", "post_ffw_norm"]
    q_rows, k_rows = (cfg.n_head * cfg.head_dim, q), (cfg.n_head_kv * cfg.head_dim, k)
    if cfg.attn_output_gate:
        q_rows = (2 * cfg.n_head * cfg.head_dim, q)
    v_rows, o_cols = (cfg.n_head_kv * cfg.head_dim_v, v), (cfg.n_head * cfg.head_dim_v, o)
    for i in range(cfg.n_layer):  # n_layer matches the blk.N tensors present
        p = f"blk.{i}."
        for n in norms:
            expect(f"{p}{n}.weight", (width,))
        if not (cfg.is_hybrid and _check_hybrid_layer(cfg, i, tensors, md, source, expect)):
            expect(f"{p}attn_q.weight", (width, q_rows))
            expect(f"{p}attn_k.weight", (width, k_rows))
            expect(f"{p}attn_v.weight", (width, v_rows))
            expect(f"{p}attn_output.weight", (o_cols, width))
            for bias, rows in (("attn_q", q_rows), ("attn_k", k_rows), ("attn_v", v_rows)):
                expect(f"{p}{bias}.bias", (rows,), required=False)
            if cfg.qk_norm:
                expect(f"{p}attn_q_norm.weight", ((cfg.head_dim, hd),))
                expect(f"{p}attn_k_norm.weight", ((cfg.head_dim, hd),))
        _expect_ffn(cfg, p, md, width, expect)
    for i in cfg.mtp_layers:
        _check_mtp_layer(cfg, i, tensors, (q_rows, k_rows, v_rows, o_cols), hd, md, source, expect)


def _check_mtp_layer(cfg: ModelConfig, i: int, tensors: Mapping[str, Any], attn, hd: str,
                     md: Mapping[str, Any], source: str, expect) -> None:
    """MTP layer i (llama_model_qwen35::load_arch_tensors' load_block_mtp; qwen35moe and
    qwen3next alike): a full-attention block with its feed-forward block, plus nextn.eh_proj
    [2 D -> D], nextn.enorm and nextn.hnorm [D]; its own embedding, output head and final norm
    are optional (llama.cpp falls back to token_embd, output and output_norm)."""
    a, p = cfg.arch, f"blk.{i}."
    found = [n for n in _SSM_TENSORS if p + n in tensors]
    if found:
        raise ConfigError(f"{source}: layer {i} is an MTP layer (full attention) by "
                          f"'{a}.nextn_predict_layers' {cfg.n_mtp_layers}, but the file has its Gated "
                          f"DeltaNet tensor '{p}{found[0]}'")
    width = (cfg.n_embd, f"'{a}.embedding_length' {cfg.n_embd}")
    rows = (cfg.n_vocab, f"the vocabulary size {cfg.n_vocab}")
    q_rows, k_rows, v_rows, o_cols = attn
    for n in ("attn_norm", "post_attention_norm", "nextn.enorm", "nextn.hnorm"):
        expect(f"{p}{n}.weight", (width,))
    expect(f"{p}attn_q.weight", (width, q_rows))
    expect(f"{p}attn_k.weight", (width, k_rows))
    expect(f"{p}attn_v.weight", (width, v_rows))
    expect(f"{p}attn_output.weight", (o_cols, width))
    expect(f"{p}attn_q_norm.weight", ((cfg.head_dim, hd),))
    expect(f"{p}attn_k_norm.weight", ((cfg.head_dim, hd),))
    _expect_ffn(cfg, p, md, width, expect)
    expect(f"{p}nextn.eh_proj.weight", ((2 * cfg.n_embd, f"2 x {width[1]}"), width))
    expect(f"{p}nextn.embed_tokens.weight", (width, rows), required=False)
    expect(f"{p}nextn.shared_head_head.weight", (width, rows), required=False)
    expect(f"{p}nextn.shared_head_norm.weight", (width,), required=False)


def _expect_ffn(cfg: ModelConfig, p: str, md: Mapping[str, Any], width, expect) -> None:
    """A layer's feed-forward tensors: the dense MLP, or the router and each projection of
    every expert as one 3-D tensor, with the shared expert where the architecture has one."""
    a = cfg.arch
    if not cfg.is_moe:
        ffn = (cfg.n_ff, f"'{a}.feed_forward_length' {cfg.n_ff}")
        expect(f"{p}ffn_gate.weight", (width, ffn))
        expect(f"{p}ffn_up.weight", (width, ffn))
        expect(f"{p}ffn_down.weight", (ffn, width))
        return
    experts = (cfg.n_expert, f"'{a}.expert_count' {cfg.n_expert}")
    ffn_exp = (cfg.n_ff_exp, f"'{a}.expert_feed_forward_length' {cfg.n_ff_exp}"
               if f"{a}.expert_feed_forward_length" in md else
               f"feed_forward_length / expert_used_count = {cfg.n_ff_exp}")
    expect(f"{p}ffn_gate_inp.weight", (width, experts))
    expect(f"{p}ffn_gate_exps.weight", (width, ffn_exp, experts))
    expect(f"{p}ffn_up_exps.weight", (width, ffn_exp, experts))
    expect(f"{p}ffn_down_exps.weight", (ffn_exp, width, experts))
    if cfg.has_shared_expert:
        key = f"{a}.expert_shared_feed_forward_length"
        shexp = (cfg.n_ff_shexp, f"'{key}' {cfg.n_ff_shexp}" if md.get(key) else
                 f"'{a}.feed_forward_length' {cfg.n_ff} ('{key}' absent or 0)")
        expect(f"{p}ffn_gate_inp_shexp.weight", (width,))
        expect(f"{p}ffn_gate_shexp.weight", (width, shexp))
        expect(f"{p}ffn_up_shexp.weight", (width, shexp))
        expect(f"{p}ffn_down_shexp.weight", (shexp, width))


_SSM_TENSORS = ("attn_qkv.weight", "attn_gate.weight", "ssm_conv1d.weight", "ssm_dt.bias", "ssm_a",
                "ssm_beta.weight", "ssm_alpha.weight", "ssm_norm.weight", "ssm_out.weight",
                "ssm_ba.weight", "ssm_in.weight")  # the last two: qwen3next's


def _check_hybrid_layer(cfg: ModelConfig, i: int, tensors: Mapping[str, Any], md: Mapping[str, Any],
                        source: str, expect) -> bool:
    """Layer i of a hybrid model against the layer pattern: a recurrent layer's Gated DeltaNet
    tensors with the state sizes of the metadata (True), or a full-attention layer without
    them (False: the caller checks its attention). Errors name the pattern's key and the tensor."""
    a, p = cfg.arch, f"blk.{i}."
    if f"{a}.attention.recurrent_layers" in md:
        why = f"'{a}.attention.recurrent_layers'"
    else:
        why = f"'{a}.full_attention_interval' {md.get(f'{a}.full_attention_interval', 4)}"
    if not cfg.is_recurrent(i):
        found = [n for n in _SSM_TENSORS if p + n in tensors]
        if found:
            raise ConfigError(f"{source}: layer {i} is full attention by {why}, but the file has its "
                              f"Gated DeltaNet tensor '{p}{found[0]}'")
        return False
    if f"{p}attn_q.weight" in tensors and f"{p}ssm_conv1d.weight" not in tensors:
        raise ConfigError(f"{source}: layer {i} is a Gated DeltaNet layer by {why}, but the file has "
                          f"the full-attention tensor '{p}attn_q.weight' and no '{p}ssm_conv1d.weight'")
    width = (cfg.n_embd, f"'{a}.embedding_length' {cfg.n_embd}")
    hd = f"'{a}.ssm.state_size' {cfg.ssm_head_dim}"
    nk = f"'{a}.ssm.group_count' {cfg.ssm_n_k_heads}"
    nv = f"'{a}.ssm.time_step_rank' {cfg.ssm_n_v_heads}"
    value = (cfg.ssm_n_v_heads * cfg.ssm_head_dim, f"{nv} x {hd}")
    heads = (cfg.ssm_n_v_heads, nv)
    conv = (cfg.ssm_conv_dim, f"(2 x {nk} + {nv}) x {hd}")
    if a == "qwen3next" and f"{p}ssm_in.weight" in tensors and f"{p}attn_qkv.weight" not in tensors:
        # the older qwen3next layout: q, k, v and z of each key head in one projection
        expect(f"{p}ssm_in.weight", (width, (conv[0] + value[0], f"{conv[1]} + {value[1]}")))
    else:
        expect(f"{p}attn_qkv.weight", (width, conv))
        expect(f"{p}attn_gate.weight", (width, value))
    expect(f"{p}ssm_conv1d.weight", ((cfg.ssm_conv_kernel, f"'{a}.ssm.conv_kernel' {cfg.ssm_conv_kernel}"),
                                     conv))
    expect(f"{p}ssm_dt.bias", (heads,))
    expect(f"{p}ssm_a", (heads,))
    if a == "qwen3next":  # beta and alpha of each key head's value heads in one projection
        expect(f"{p}ssm_ba.weight", (width, (2 * heads[0], f"2 x {nv}")))
    else:
        expect(f"{p}ssm_beta.weight", (width, heads))
        expect(f"{p}ssm_alpha.weight", (width, heads))
    expect(f"{p}ssm_norm.weight", ((cfg.ssm_head_dim, hd),))
    expect(f"{p}ssm_out.weight", (value, width))
    return True
