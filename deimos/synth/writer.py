"""Writes random-weight GGUF files of real architectures (test and benchmark models).

The file is a function of (preset, GGML type, donor tokenizer, seed) only: each tensor draws
from its own generator seeded by (seed, crc32(name)), so the bytes do not depend on the order
or the set of the other tensors, and a test can regenerate a file and compare its sha256.

Weight scales: the matrices are ``deimos.quant`` random blocks (values within about +-0.1);
a norm gain is a constant times (1 + N(0, 0.1^2)). Chosen by measuring llama.cpp's greedy runs
on the tiny presets:
- final norm gain OUTPUT_GAIN = 16: the normed hidden state has rms ~16, so the logits spread
  over many units and the next-token distribution is peaked (top-2 gap > 0.1 in ~95% of
  steps), which makes greedy tokens a stable comparison between implementations;
- hidden-state norm gains NORM_GAIN = 4: with gain 1 the layers add little to the residual
  stream, and with tied embeddings the logit of the input token itself then dominates, so
  greedy decoding repeats one token (90% of steps for qwen3-tiny); with 4 it rarely does;
- q/k norm gains 1: attention scores of order 1, neither uniform nor one-hot.
Biases are N(0, 0.2^2).
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from deimos.gguf import GGUFFile
from deimos.gguf.constants import GGMLType
from deimos.quant import get_format
from deimos.synth.arch import Kind, TensorSpec, arch_metadata, tensor_specs
from deimos.synth.presets import SynthPreset, get_preset

OUTPUT_GAIN = 16.0
NORM_GAIN = 4.0
NORM_NOISE = 0.1
BIAS_STD = 0.2

# Types a weight matrix may have: floats and block quants (not the integer types, not F64).
_NOT_WEIGHT_TYPES = {GGMLType.F64, GGMLType.I8, GGMLType.I16, GGMLType.I32, GGMLType.I64}

_SCALAR = {"u32": GGUFValueType.UINT32, "f32": GGUFValueType.FLOAT32}


def write_model(
    path: str | os.PathLike[str],
    arch: str,
    preset: str | SynthPreset,
    ggml_type: GGMLType | str | int,
    vocab_from: str | os.PathLike[str],
    seed: int = 0,
) -> Path:
    """Writes a random-weight model of ``preset`` (its arch must be ``arch``) to ``path``.

    ``ggml_type``: type of every 2-D weight (norms and biases are F32); its block size must
    divide the rows (n_embd, n_ff, head widths). ``vocab_from``: a GGUF whose ``tokenizer.*``
    keys are copied; the vocabulary size is its token count. Returns the path.
    """
    p = get_preset(preset) if isinstance(preset, str) else preset
    if p.arch != arch:
        raise ValueError(f"preset {p.name!r} is a {p.arch} model, not {arch}")
    wtype = _weight_type(ggml_type)
    tokenizer = read_tokenizer(vocab_from)
    n_vocab = len(tokenizer["tokenizer.ggml.tokens"][2])
    specs = tensor_specs(p, n_vocab)
    for s in specs:
        if s.kind is Kind.MATRIX:
            _check_rows(s, wtype)

    path = Path(path)
    w = GGUFWriter(path, arch)
    w.add_type("model")
    w.add_name(f"deimos-synth {p.name} {wtype.name} seed {seed}")
    if wtype not in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
        w.add_quantization_version(2)
    for suffix, t, value in arch_metadata(p, n_vocab):
        w.add_key_value(f"{arch}.{suffix}", value, _SCALAR[t])
    for key, (vtype, sub, value) in tokenizer.items():
        w.add_key_value(key, value, vtype, sub_type=sub)
    for s in specs:
        t = wtype if s.kind is Kind.MATRIX else GGMLType.F32
        fmt = get_format(t)
        n = int(np.prod(s.dims))
        nbytes = n // fmt.block_size * fmt.type_size
        w.add_tensor_info(s.name, tuple(reversed(s.dims)), np.dtype(np.float32), nbytes,
                          raw_dtype=GGMLQuantizationType(int(t)))
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for s in specs:
            w.write_tensor_data(_tensor_bytes(s, wtype, seed))
    finally:
        w.close()
    return path


def read_tokenizer(donor: str | os.PathLike[str]) -> dict[str, tuple]:
    """The donor's ``tokenizer.*`` keys as {key: (value type, item type or None, value)},
    in the form GGUFWriter packs back to the same bytes."""
    with GGUFFile(donor) as f:
        out: dict[str, tuple] = {}
        for key, value in f.metadata.items():
            if not key.startswith("tokenizer."):
                continue
            types = f.value_types[key]
            sub = types[1] if len(types) > 1 else None
            if sub is not None and len(value) == 0:
                continue  # GGUFWriter cannot write an empty array; llama.cpp treats it as absent
            out[key] = (GGUFValueType(int(types[0])),
                        None if sub is None else GGUFValueType(int(sub)), _writable(value))
        if "tokenizer.ggml.tokens" not in out:
            raise ValueError(f"{donor}: no tokenizer.ggml.tokens, not a usable vocabulary donor")
        return out


def _writable(value: object) -> object:
    # The reader decodes strings with surrogateescape (GGUF does not promise valid UTF-8);
    # bytes make GGUFWriter write them back unchanged. Numeric arrays come as numpy arrays,
    # which GGUFWriter does not take as a sequence.
    if isinstance(value, str):
        return value.encode("utf-8", "surrogateescape")
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, list):
        return [_writable(v) for v in value]
    return value


def _weight_type(t: GGMLType | str | int) -> GGMLType:
    try:
        wt = GGMLType[t.upper()] if isinstance(t, str) else GGMLType(t)
    except (KeyError, ValueError):
        raise ValueError(f"unknown GGML type {t!r}") from None
    if wt in _NOT_WEIGHT_TYPES:
        raise ValueError(f"GGML type {wt.name} is not a weight type")
    get_format(wt)  # raises QuantError if deimos.quant has no such format
    return wt


def _check_rows(s: TensorSpec, t: GGMLType) -> None:
    block = get_format(t).block_size
    if s.dims[0] % block:
        raise ValueError(
            f"tensor {s.name}: row length {s.dims[0]} is not a multiple of the {t.name} block "
            f"size {block}; pick a preset whose widths are multiples of {block}"
        )


def _tensor_bytes(s: TensorSpec, wtype: GGMLType, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, zlib.crc32(s.name.encode())])
    n = int(np.prod(s.dims))
    if s.kind is Kind.MATRIX:
        fmt = get_format(wtype)
        return fmt.random_blocks(n // fmt.block_size, rng).reshape(-1)
    if s.kind is Kind.BIAS:
        v = BIAS_STD * rng.standard_normal(n, dtype=np.float32)
    else:
        gain = {Kind.OUTPUT_NORM: OUTPUT_GAIN, Kind.NORM: NORM_GAIN, Kind.HEAD_NORM: 1.0}[s.kind]
        v = np.float32(gain) * (1.0 + NORM_NOISE * rng.standard_normal(n, dtype=np.float32))
    return v.astype("<f4").view(np.uint8)
