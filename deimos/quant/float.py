"""Unquantized element types: one element per "block".

F32/F16/BF16 widen exactly. F64 and the integer types are rounded to nearest float32 (ggml has
no to_float for them; they occur in GGUF files only as small auxiliary tensors).
"""

from __future__ import annotations

import numpy as np

from deimos.gguf.constants import GGMLType
from deimos.quant.base import QuantFormat, random_bytes


def _uniform(n: int, rng: np.random.Generator) -> np.ndarray:
    """Uniform in [-0.1, 0.1): cheaper than normal draws, same spread as the quantized formats."""
    return 0.2 * (rng.random(n, dtype=np.float32) - 0.5)


class _Plain(QuantFormat):
    """Little-endian scalars of ``dtype``; random blocks uniform in [-0.1, 0.1)."""

    dtype: np.dtype

    def decode_blocks(self, blocks: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(blocks).view(self.dtype).astype(np.float32)

    def random_blocks(self, n: int, rng: np.random.Generator) -> np.ndarray:
        v = _uniform(n, rng).astype(self.dtype)
        return v.reshape(n, 1).view(np.uint8)


class F32(_Plain, ggml_type=GGMLType.F32):
    # 0 f32
    dtype = np.dtype("<f4")


class F16(_Plain, ggml_type=GGMLType.F16):
    # 0 f16
    dtype = np.dtype("<f2")


class F64(_Plain, ggml_type=GGMLType.F64):
    # 0 f64
    dtype = np.dtype("<f8")


class BF16(QuantFormat, ggml_type=GGMLType.BF16):
    # 0 bf16: the high 16 bits of an f32 (sign, 8-bit exponent, 7-bit mantissa)

    def decode_blocks(self, blocks: np.ndarray) -> np.ndarray:
        hi = np.ascontiguousarray(blocks).view("<u2").astype(np.uint32) << 16
        return hi.view(np.float32)

    def random_blocks(self, n: int, rng: np.random.Generator) -> np.ndarray:
        v = _uniform(n, rng)
        bits = v.view(np.uint32) + 0x8000  # round half up on the dropped 16 bits
        return (bits >> 16).astype("<u2").reshape(n, 1).view(np.uint8)


class _Int(QuantFormat):
    dtype: np.dtype

    def decode_blocks(self, blocks: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(blocks).view(self.dtype).astype(np.float32)

    def random_blocks(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return random_bytes(n, self.type_size, rng)


class I8(_Int, ggml_type=GGMLType.I8):
    # 0 i8
    dtype = np.dtype("i1")


class I16(_Int, ggml_type=GGMLType.I16):
    # 0 i16
    dtype = np.dtype("<i2")


class I32(_Int, ggml_type=GGMLType.I32):
    # 0 i32
    dtype = np.dtype("<i4")


class I64(_Int, ggml_type=GGMLType.I64):
    # 0 i64
    dtype = np.dtype("<i8")
