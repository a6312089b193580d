"""Decoding real tensors of the test models, against ggml's C decoder and gguf-py."""

from __future__ import annotations

import numpy as np
import pytest
from test_quant_formats import assert_bits_equal
from quant_support import ggml_to_float, gguf_dequantize
from testdata import REAL_MODELS, model_path

from deimos.gguf import GGUFFile
from deimos.quant import dequantize, get_format

ROWS = 8  # rows checked from the start of every tensor


@pytest.mark.parametrize("model", REAL_MODELS)
def test_model_tensors_bit_exact(model: str) -> None:
    seen: dict[str, int] = {}
    with GGUFFile(model_path(model)) as f:
        smallest = {}  # per type: the smallest tensor, decoded whole
        for info in f.tensors.values():
            fmt = get_format(info.ggml_type, info.name)
            best = smallest.get(info.ggml_type, (1 << 62, ""))[0]
            if len(info.shape) >= 2 and info.n_elements < best:
                smallest[info.ggml_type] = (info.n_elements, info.name)
            raw = f.tensor_bytes(info.name)
            ne0 = info.shape[-1]
            rows = min(ROWS, info.n_elements // ne0)
            row_bytes = ne0 // fmt.block_size * fmt.type_size
            part = raw[: rows * row_bytes]
            got = dequantize(part, info.ggml_type, (rows, ne0), info.name)
            blocks = part.reshape(-1, fmt.type_size)
            for who, want in (("ggml C", ggml_to_float(info.ggml_type, blocks)),
                              ("gguf-py", gguf_dequantize(info.ggml_type, blocks))):
                if want is not None:
                    assert_bits_equal(got.reshape(-1), want.reshape(-1), f"{info.name} vs {who}")
            seen[info.ggml_type.name] = seen.get(info.ggml_type.name, 0) + 1
        for _, name in smallest.values():
            info = f.tensors[name]
            got = dequantize(f.tensor_bytes(name), info.ggml_type, info.shape, name)
            assert got.shape == info.shape and got.dtype == np.float32
            fmt = get_format(info.ggml_type)
            want = ggml_to_float(info.ggml_type, f.tensor_bytes(name).reshape(-1, fmt.type_size))
            if want is None:  # F32
                want = f.tensor_bytes(name).view("<f4")
            assert_bits_equal(got.reshape(-1), want.reshape(-1), f"{name} (whole) vs ggml C")
    print(f"\n{model}: tensors per type {seen}")
    assert len(seen) >= 3
