"""Per-tensor GGML types: one type for every matrix, or a llama.cpp quantization mix (ftype).

A mix is named like llama-quantize's file types (Q4_K_M, Q4_K_S, Q5_K_M, Q6_K, Q8_0, Q4_0,
IQ4_XS, ...) and gives each tensor the type llama-quantize would give it without an importance
matrix and without overrides: llama.cpp src/llama-quant.cpp, llama_tensor_get_type_impl and
tensor_type_fallback (build 11434), transcribed for the architectures of ``presets.ARCHS``
(the Falcon, 70B, GLM5, BailingMoE3 and fused-QKV special cases do not occur in them).

llama.cpp walks the tensors sorted by layer, so its running counters (i_attention_wv,
i_ffn_down, ...) equal the layer index here; the rules are written with the layer index.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from deimos.gguf.constants import GGMLType
from deimos.quant import get_format
from deimos.synth.arch import Kind, TensorSpec
from deimos.synth.presets import SynthPreset

T = GGMLType

# llama-quantize's ftype names -> (LLAMA_FTYPE_* value written as general.file_type, the default
# tensor type of llama_ftype_get_default_type). llama-quantize's aliases Q3_K/Q4_K/Q5_K (for the
# _M mixes) are left out: here those names mean one GGML type for every matrix.
FTYPES: dict[str, tuple[int, GGMLType]] = {
    "Q4_0": (2, T.Q4_0), "Q4_1": (3, T.Q4_1), "Q8_0": (7, T.Q8_0), "Q5_0": (8, T.Q5_0),
    "Q5_1": (9, T.Q5_1), "Q2_K": (10, T.Q2_K), "Q3_K_S": (11, T.Q3_K), "Q3_K_M": (12, T.Q3_K),
    "Q3_K_L": (13, T.Q3_K), "Q4_K_S": (14, T.Q4_K), "Q4_K_M": (15, T.Q4_K),
    "Q5_K_S": (16, T.Q5_K), "Q5_K_M": (17, T.Q5_K), "Q6_K": (18, T.Q6_K),
    "IQ2_XXS": (19, T.IQ2_XXS), "IQ2_XS": (20, T.IQ2_XS), "Q2_K_S": (21, T.Q2_K),
    "IQ3_XS": (22, T.IQ3_S), "IQ3_XXS": (23, T.IQ3_XXS), "IQ1_S": (24, T.IQ1_S),
    "IQ4_NL": (25, T.IQ4_NL), "IQ3_S": (26, T.IQ3_S), "IQ3_M": (27, T.IQ3_S),
    "IQ2_S": (28, T.IQ2_XS), "IQ2_M": (29, T.IQ2_S), "IQ4_XS": (30, T.IQ4_XS),
    "IQ1_M": (31, T.IQ1_M), "TQ1_0": (36, T.TQ1_0), "TQ2_0": (37, T.TQ2_0),
    "MXFP4_MOE": (38, T.MXFP4),
}

# Types a weight matrix may have: floats and block quants. Not the integer types or F64 (no
# matmul), not Q8_K (only the activation side of ggml's k-quant dot products).
_NOT_WEIGHT_TYPES = {T.F64, T.I8, T.I16, T.I32, T.I64, T.Q8_K}

# tensor_type_fallback: the type used when the row length is not a multiple of the block.
_FALLBACK = {
    **dict.fromkeys((T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S,
                     T.IQ4_XS), T.IQ4_NL),
    **dict.fromkeys((T.Q2_K, T.Q3_K, T.TQ1_0, T.TQ2_0), T.Q4_0),
    T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0,
}

_IQ_LOW = {"IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ2_S", "IQ2_M", "IQ1_M"}


class Cat(Enum):
    """llama.cpp's tensor_category, by the same substring tests in the same order."""

    OUTPUT, TOKEN_EMBD, ATTN_V, ATTN_K, ATTN_Q, ATTN_OUTPUT, FFN_UP, FFN_GATE, FFN_DOWN, OTHER = (
        range(10))


def category(name: str) -> Cat:
    if name == "output.weight":
        return Cat.OUTPUT
    if name == "token_embd.weight":
        return Cat.TOKEN_EMBD
    # attn_qkv (the hybrids' Gated DeltaNet input projection) is llama.cpp's ATTENTION_QKV, which
    # every rule that applies here treats as attn_v (category_is_attn_v: the rule and the
    # i_attention_wv counter; its own branch comes after the attn_v one and is never reached)
    for key, cat in (("attn_qkv.weight", Cat.ATTN_V), ("attn_v.weight", Cat.ATTN_V),
                     ("attn_k.weight", Cat.ATTN_K), ("attn_q.weight", Cat.ATTN_Q),
                     ("attn_output.weight", Cat.ATTN_OUTPUT), ("ffn_up", Cat.FFN_UP),
                     ("ffn_gate", Cat.FFN_GATE), ("ffn_down", Cat.FFN_DOWN)):
        if key in name:
            return cat
    return Cat.OTHER


@dataclass(frozen=True)
class WeightTypes:
    """How the weight matrices get their types: ``ftype`` set = a llama.cpp mix of that name,
    else every matrix is ``default``."""

    name: str
    default: GGMLType
    ftype: int | None = None

    @property
    def is_mix(self) -> bool:
        return self.ftype is not None

    def tensor_types(self, p: SynthPreset, specs: list[TensorSpec]) -> list[GGMLType]:
        """The type of each spec: F32 for norms, biases and the router; matrices by the mix
        (with llama.cpp's fallbacks) or the single type (rows must fit its block)."""
        tied = not any(s.name == "output.weight" for s in specs)
        counters = _counters(specs)
        out = []
        for s in specs:
            if s.kind is not Kind.MATRIX:
                out.append(T.F32)
            elif self.is_mix:
                t = _mix_rule(self.name, self.default, s, p, tied, counters.get(s.name))
                out.append(_fallback(t, s.dims[0]))
            else:
                _check_rows(s, self.default)
                out.append(self.default)
        return out


def weight_types(name: str | GGMLType | int, pure: bool = False) -> WeightTypes:
    """``name``: an ftype of ``FTYPES`` (a mix) or a GGML type (every matrix that type).
    ``pure``: no mix; a name that is both (Q8_0, IQ2_S) is then the GGML type, an ftype-only
    name (Q4_K_M) its default type (Q4_K). F32/F16/BF16 have no mix rules: always pure."""
    key = name.upper() if isinstance(name, str) else None
    if key in FTYPES and not pure:
        ftype, default = FTYPES[key]
        return WeightTypes(key, default, ftype)
    try:
        if key is None:
            t = T(name)
        elif key in T.__members__:
            t = T[key]
        else:
            t = FTYPES[key][1]
    except (KeyError, ValueError):
        known = [t.name for t in T if t not in _NOT_WEIGHT_TYPES]
        raise ValueError(f"unknown GGML type {name!r} (types: {', '.join(known)}; "
                         f"llama.cpp mixes: {', '.join(FTYPES)})") from None
    if t in _NOT_WEIGHT_TYPES:
        raise ValueError(f"GGML type {t.name} is not a weight type")
    get_format(t)  # raises QuantError if deimos.quant has no such format
    return WeightTypes(t.name, t)


class LayerCounts(NamedTuple):
    """What the mix rules read of a model besides a tensor's name and dims (a ``SynthPreset``
    has these fields too): for a real file, from its ``<arch>.block_count``,
    ``.attention.head_count``, ``.attention.head_count_kv`` and ``.expert_count``."""

    n_layer: int
    n_head: int
    n_head_kv: int
    n_expert: int = 0


def matrix_type(types: WeightTypes, name: str, dims: tuple[int, ...],
                model: LayerCounts | SynthPreset, tied: bool) -> GGMLType:
    """The type llama-quantize gives the weight matrix ``name`` (ggml ``dims``) of ``model``:
    the mix's rule (``types.is_mix``) or the single type (as ``llama-quantize --pure``), then
    tensor_type_fallback when the rows do not fit its block. Unlike ``tensor_types``, a single
    type falls back instead of refusing: for real models, whose row lengths are given.
    ``tied``: the model has no output.weight (token_embd.weight is the output projection).
    llama.cpp's attn_v and ffn_down counters are taken to be the layer index (``tensor_types``
    counts them: they differ where a layer has two ffn_down tensors, a shared expert's, or some
    layers no attn_v-like one)."""
    if types.is_mix:
        t = _mix_rule(types.name, types.default, TensorSpec(name, dims, Kind.MATRIX), model, tied)
    else:
        t = types.default
    return _fallback(t, dims[0])


def _check_rows(s: TensorSpec, t: GGMLType) -> None:
    block = get_format(t).block_size
    if s.dims[0] % block:
        raise ValueError(
            f"tensor {s.name}: row length {s.dims[0]} is not a multiple of the {t.name} block "
            f"size {block}; pick a preset whose widths are multiples of {block}, or a mix"
        )


def _fallback(t: GGMLType, ncols: int) -> GGMLType:
    if ncols % get_format(t).block_size == 0:
        return t
    t = _FALLBACK.get(t, t)  # a 32-block type without a smaller block stays, then F16 below
    return t if ncols % get_format(t).block_size == 0 else T.F16


def _use_more_bits(i: int, n: int) -> bool:
    # The first and last eighth of the layers and every third layer in between.
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


class Counter(NamedTuple):
    """llama.cpp's running counter of a tensor's category at that tensor, and its total."""

    i: int
    n: int


def _counters(specs: list[TensorSpec]) -> dict[str, Counter]:
    """The counters the rules read where they are not the layer index (llama-quantize walks
    the tensors sorted by layer, then name): i_attention_wv / n_attention_wv of the attn_v-like
    tensors (qwen3next's ssm_in layout has attn_v in every fourth layer only) and i_ffn_down of
    the ffn_down ones (two a layer with a shared expert; the IQ1/IQ2 rules read it raw)."""
    def layer(s: TensorSpec) -> int:
        return int(s.name.split(".")[1]) if s.name.startswith("blk.") else -1

    walk = sorted((s for s in specs if s.kind is Kind.MATRIX), key=lambda s: (layer(s), s.name))
    out = {}
    for cat in (Cat.ATTN_V, Cat.FFN_DOWN):
        names = [s.name for s in walk if category(s.name) is cat]
        out.update({name: Counter(i, len(names)) for i, name in enumerate(names)})
    return out


def _mix_rule(ft: str, t: GGMLType, s: TensorSpec, p: SynthPreset | LayerCounts,
              tied: bool, counter: Counter | None = None) -> GGMLType:
    """llama_tensor_get_type_impl for ftype ``ft`` (no imatrix), before the fallback.
    ``counter``: the tensor's category counter (``_counters``); None: its layer index (exact
    where every layer has one tensor of the category)."""
    cat = category(s.name)
    layer = int(s.name.split(".")[1]) if s.name.startswith("blk.") else -1
    n = p.n_layer + getattr(p, "n_mtp_layers", 0)  # llama.cpp's n_layer_all: MTP layers counted
    gqa = p.n_head // p.n_head_kv
    n_expert = p.n_expert

    if cat is Cat.OUTPUT or (tied and cat is Cat.TOKEN_EMBD):
        if ft == "MXFP4_MOE" or s.dims[0] % get_format(t).block_size:
            return T.Q8_0
        if ft in _IQ_LOW:
            return T.Q5_K
        return t if t == T.Q8_0 else T.Q6_K
    if ft == "MXFP4_MOE":
        return T.MXFP4 if len(s.dims) == 3 and s.dims[2] > 1 else T.Q8_0
    if cat is Cat.TOKEN_EMBD:
        if ft in ("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ1_M"):
            return T.Q2_K
        if ft in ("IQ2_S", "IQ2_M", "IQ3_XXS"):
            return T.IQ3_S
        if ft in ("TQ1_0", "TQ2_0"):
            return T.Q4_K
        return t
    if ft in ("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ2_S", "IQ2_M", "IQ1_M"):
        iq2s = ft in ("IQ2_S", "IQ2_M")
        if cat is Cat.ATTN_V:
            return T.Q4_K if gqa >= 4 or n_expert >= 4 else (T.IQ3_S if iq2s else T.Q2_K)
        if n_expert == 8 and cat is Cat.ATTN_K:
            return T.Q4_K
        if cat is Cat.FFN_DOWN:  # the raw counter against n_ffn_down = the layer count
            i_down = counter.i if counter else layer
            return (T.IQ3_S if iq2s else T.Q2_K) if i_down < n // 8 else t
        if cat is Cat.ATTN_OUTPUT:
            if n_expert == 8:
                return T.Q5_K
            if ft in ("IQ1_S", "IQ1_M"):
                return T.IQ2_XXS
            return T.IQ3_S if iq2s else t
        return t
    if cat is Cat.ATTN_V:
        i_wv, n_wv = counter or (layer, n)
        if ft == "Q2_K":
            t = T.Q4_K if gqa >= 4 else T.Q3_K
        elif ft == "Q2_K_S" and gqa >= 4:
            t = T.Q4_K
        elif ft == "IQ3_XXS":
            t = T.Q4_K if gqa >= 4 else T.IQ3_S
        elif ft in ("IQ3_XS", "IQ3_S") and gqa >= 4:
            t = T.Q4_K
        elif ft == "IQ3_M":
            t = T.Q4_K
        elif ft == "Q3_K_M":
            t = T.Q5_K if i_wv < 2 else T.Q4_K
        elif ft == "Q3_K_L":
            t = T.Q5_K
        elif ft in ("IQ4_NL", "IQ4_XS") and gqa >= 4:
            t = T.Q5_K
        elif ft in ("Q4_K_M", "Q5_K_M") and _use_more_bits(i_wv, n_wv):
            t = T.Q6_K
        elif ft == "Q4_K_S" and i_wv < 4:
            t = T.Q5_K
        return T.Q8_0 if n_expert == 8 else t
    if cat is Cat.ATTN_K:
        if n_expert == 8:
            return T.Q8_0
        return {"IQ3_XS": T.IQ3_XXS, "IQ3_XXS": T.IQ2_S}.get(ft, t)
    if cat is Cat.ATTN_Q:
        return {"IQ3_XS": T.IQ3_XXS, "IQ3_XXS": T.IQ2_S}.get(ft, t)
    if cat is Cat.FFN_DOWN:
        first = layer < n // 8
        if ft == "Q2_K":
            return T.Q3_K
        if ft == "Q2_K_S":
            return T.Q4_K if first else t
        if ft == "IQ3_XXS":
            return T.Q4_K if first else T.Q3_K
        if ft == "Q3_K_M":
            return T.Q5_K if layer < n // 16 else T.Q4_K
        if ft == "IQ3_M" and (first or (n_expert == 8 and _use_more_bits(layer, n))):
            return T.Q4_K
        if ft == "Q3_K_L":
            return T.Q5_K
        if ft == "Q4_K_M":
            return T.Q6_K if _use_more_bits(layer, n) else t
        if first and ft in ("IQ4_NL", "IQ4_XS"):
            return T.Q5_K
        if ft == "Q5_K_M" and _use_more_bits(layer, n):
            return T.Q6_K
        if ft == "Q4_K_S" and first:
            return T.Q5_K
        return t
    if cat is Cat.ATTN_OUTPUT:
        if n_expert == 8:
            eight = ("Q2_K", "IQ3_XS", "IQ3_XXS", "Q3_K_S", "Q3_K_M", "IQ4_NL", "Q4_K_S",
                     "Q4_K_M", "IQ3_S", "IQ3_M", "IQ4_XS")
            return T.Q5_K if ft in eight else t
        return {"Q2_K": T.Q3_K, "IQ3_XXS": T.IQ3_S, "Q3_K_M": T.Q4_K, "Q3_K_L": T.Q5_K,
                "IQ3_M": T.Q4_K}.get(ft, t)
    if cat in (Cat.FFN_GATE, Cat.FFN_UP):
        if ft == "IQ3_XS" and n // 8 <= layer < 7 * n // 8:
            return T.IQ3_XXS
    return t
