"""Requantized real models for the tests (support module, no tests of its own).

``variant(model, type)`` builds ``model`` re-quantized to ``type`` by tools/requantize.py with
the fetched libggml-base.so, once per test session, in a temporary folder removed at exit;
``type`` is requantize's TYPE (a llama-quantize file type, or a GGML type), with a "-pure"
suffix for its --pure.
``write_tensors`` writes chosen tensors of a file to a small GGUF, as their raw blocks or
decoded to F32 (the higher-precision copies quant-check compares against).
"""

from __future__ import annotations

import atexit
import shutil
import sys
import tempfile
from functools import cache
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from testdata import REPO, llama_cpu_lib, model_path

from deimos.gguf import GGUFFile
from deimos.quant import dequantize

sys.path.insert(0, str(REPO / "tools"))
import requantize  # noqa: E402

SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3 = "gemma-3-270m-q4_k_m.gguf"


@cache
def _build_dir() -> Path:
    d = Path(tempfile.mkdtemp(prefix="deimos-requant-"))
    atexit.register(shutil.rmtree, d, True)
    return d


def ggml_lib_dir() -> Path:
    return llama_cpu_lib("libggml-base.so").parent  # fails with the fetch hint if missing


@cache
def variant(model: str, ggml_type: str) -> Path:
    out = _build_dir() / f"{model.removesuffix('.gguf')}-{ggml_type}.gguf"
    t = ggml_type.removesuffix("-pure")
    requantize.requantize(model_path(model), out, t, ggml_lib_dir(), pure=t != ggml_type)
    return out


def quantizer() -> requantize.Quantizer:
    return requantize.Quantizer(ggml_lib_dir() / "libggml-base.so")


def write_tensors(src: GGUFFile, names: list[str], dst: Path, f32: bool = False,
                  reshape: dict[str, tuple[int, ...]] | None = None) -> Path:
    """``names`` of ``src`` into a tensor-only GGUF at ``dst``: raw blocks, or F32 values
    (``f32``); ``reshape`` gives some tensors another (numpy-order) shape, F32 only."""
    w = GGUFWriter(dst, src.metadata.get("general.architecture", "llama"))
    for name in names:
        info = src.tensors[name]
        raw = src.tensor_bytes(name)
        if f32 or (reshape and name in reshape):
            x = dequantize(raw, info.ggml_type, tuple(info.shape), name=name)
            w.add_tensor(name, np.ascontiguousarray(x.reshape(reshape.get(name, x.shape)
                                                              if reshape else x.shape)))
        else:
            rows = info.n_elements // info.dims[0]
            w.add_tensor(name, np.array(raw).reshape(*info.shape[:-1], raw.size // rows),
                         raw_dtype=GGMLQuantizationType(int(info.ggml_type)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
