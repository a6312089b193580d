"""Model hyper-parameters, read once from GGUF metadata into a frozen dataclass.

Nothing below this boundary reads raw metadata keys. Defaults follow llama.cpp
(src/llama-model.cpp and src/models/<arch>.cpp) so that the same file means the
same model in both engines.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    """A model file's metadata is missing a key, has a wrong value, or names an unsupported model."""


SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")

# Rotary embedding variants: "norm" rotates adjacent pairs (x0,x1),(x2,x3)...;
# "neox" rotates the two halves (x_i, x_{i+d/2}).
_ROPE_TYPE = {"llama": "norm", "qwen2": "neox", "qwen3": "neox", "gemma3": "neox"}


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

    @property
    def n_gqa(self) -> int:
        return self.n_head // self.n_head_kv

    def is_swa(self, layer: int) -> bool:
        return bool(self.swa_layers) and self.swa_layers[layer]

    def layer_rope_base(self, layer: int) -> float:
        return self.rope_base_swa if self.is_swa(layer) else self.rope_base

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any], source: str = "model") -> ModelConfig:
        """Build the config from a GGUF file's metadata; ``source`` names the file in errors."""
        return _Reader(metadata, source).config()


class _Reader:
    def __init__(self, metadata: Mapping[str, Any], source: str) -> None:
        self.md = metadata
        self.source = source
        arch = metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ConfigError(f"{source}: metadata key 'general.architecture' is missing")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"{source}: architecture '{arch}' is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        self.arch = arch

    def _raw(self, key: str, required: bool) -> Any:
        full = f"{self.arch}.{key}"
        if full not in self.md:
            if required:
                raise ConfigError(f"{self.source}: required metadata key '{full}' is missing")
            return None
        return self.md[full]

    def int(self, key: str, default: int | None = None) -> int:
        value = self._raw(key, default is None)
        if value is None:
            return default  # type: ignore[return-value]
        if isinstance(value, bool) or not isinstance(value, int):
            # per-layer arrays (e.g. head counts that vary by layer) are not supported yet
            raise ConfigError(
                f"{self.source}: metadata key '{self.arch}.{key}' must be an integer, got {value!r:.60}"
            )
        if value <= 0:
            raise ConfigError(f"{self.source}: metadata key '{self.arch}.{key}' must be positive, got {value}")
        return value

    def float(self, key: str, default: float | None = None) -> float:
        value = self._raw(key, default is None)
        if value is None:
            return default  # type: ignore[return-value]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(
                f"{self.source}: metadata key '{self.arch}.{key}' must be a finite number, got {value!r:.60}"
            )
        return float(value)

    def config(self) -> ModelConfig:
        arch = self.arch
        n_embd = self.int("embedding_length")
        n_layer = self.int("block_count")
        n_head = self.int("attention.head_count")
        n_head_kv = self.int("attention.head_count_kv", n_head)
        if n_head % n_head_kv:
            raise ConfigError(
                f"{self.source}: head_count {n_head} is not a multiple of head_count_kv {n_head_kv}"
            )
        head_dim = self.int("attention.key_length", n_embd // n_head)
        head_dim_v = self.int("attention.value_length", head_dim)
        tokens = self.md.get("tokenizer.ggml.tokens")
        n_vocab = self.int("vocab_size", len(tokens) if tokens is not None else None)
        rope_dim = self.int("rope.dimension_count", head_dim)
        if rope_dim > head_dim or rope_dim % 2:
            raise ConfigError(f"{self.source}: rope.dimension_count {rope_dim} does not fit head size {head_dim}")

        scaling = self._raw("rope.scaling.type", False) or "linear"
        if scaling not in ("none", "linear"):
            raise ConfigError(f"{self.source}: rope scaling type '{scaling}' is not supported yet")
        factor = self.float("rope.scaling.factor", 0.0)
        rope_scale = 1.0 / factor if factor and scaling == "linear" else 1.0

        common = dict(
            arch=arch,
            n_vocab=n_vocab,
            n_embd=n_embd,
            n_layer=n_layer,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            head_dim_v=head_dim_v,
            n_ff=self.int("feed_forward_length"),
            rms_eps=self.float("attention.layer_norm_rms_epsilon"),
            context_length=self.int("context_length", 4096),
            rope_type=_ROPE_TYPE[arch],
            rope_dim=rope_dim,
            rope_base=self.float("rope.freq_base", 10000.0),
            rope_scale=rope_scale,
            attn_scale=self.float("attention.scale", 0.0) or 1.0 / math.sqrt(head_dim),
            activation="silu",
            final_logit_softcap=self.float("final_logit_softcapping", 0.0),
        )
        if arch == "qwen3":
            common["qk_norm"] = True
        if arch == "gemma3":
            window = self.int("attention.sliding_window", 0) if self._raw("attention.sliding_window", False) else 0
            pattern = self._raw("attention.sliding_window_pattern", False)
            if window:
                if isinstance(pattern, (list, tuple)) or hasattr(pattern, "tolist"):
                    swa = tuple(bool(x) for x in list(pattern))
                    if len(swa) != n_layer:
                        raise ConfigError(f"{self.source}: sliding_window_pattern has {len(swa)} entries, expected {n_layer}")
                else:
                    period = int(pattern) if pattern is not None else 6
                    swa = tuple(period == 0 or (i % period < period - 1) for i in range(n_layer))
                common["sliding_window"] = window
                common["swa_layers"] = swa
                common["rope_base_swa"] = self.float("rope.freq_base_swa", 10000.0)
            common.update(
                embed_scale=math.sqrt(n_embd),
                qk_norm=True,
                sandwich_norm=True,
                activation="gelu_tanh",
                # gemma3 27B scales by the model width per head; the others by the head size
                attn_scale=1.0 / math.sqrt(n_embd // n_head if n_layer == 62 else head_dim),
            )
        return ModelConfig(**common)
