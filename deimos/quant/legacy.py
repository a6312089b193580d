"""The original 32-element block formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.

Nibble order in all of them: byte j holds element j in its low nibble and element j+16 in its
high nibble. The 5-bit formats keep the fifth bit of element e in bit e of a 32-bit ``qh``.
"""

from __future__ import annotations

import numpy as np

from deimos.gguf.constants import GGMLType
from deimos.quant.base import (
    QuantFormat,
    as_f32,
    f16_at,
    put_f16_scale,
    put_u16,
    random_bytes,
    random_f16_bits,
    u32_at,
)

_BIT = np.arange(32, dtype=np.uint32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """uint8 ``[n, 16]`` -> the 32 codes ``[n, 32]``: low nibbles, then high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """uint32 ``[n, 1]`` -> 16 * bit e of qh, as uint8 ``[n, 32]``."""
    return (((qh >> _BIT) & 1) << 4).astype(np.uint8)


def _put_min(blocks: np.ndarray, rng: np.random.Generator, code_mid: float) -> None:
    """Set the f16 min at byte 2 to about ``-d * code_mid`` so weights are centred on zero."""
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    jitter = random_f16_bits(rng, d.shape, 0.9, 1.1).view(np.float16).astype(np.float32)
    put_u16(blocks, 2, (-d * code_mid * jitter).astype(np.float16).view(np.uint16))


class Q4_0(QuantFormat, ggml_type=GGMLType.Q4_0):
    # 0 d (f16) | 2 qs[16] nibbles
    # w = (q - 8) * d

    def decode_blocks(self, blocks: np.ndarray) -> np.ndarray:
        d = f16_at(blocks, 0)
        q = _nibbles(blocks[:, 2:18]).astype(np.int8) - 8
        return as_f32(q) * d

    def random_blocks(self, n: int, rng: np.random.Generator) -> np.ndarray:
        b = random_bytes(n, self.type_size, rng)
        put_f16_scale(b, 0, rng, 0.1 / 8)
        return b


class Q4_1(QuantFormat, ggml_type=GGMLType.Q4_1):
    # 0 d (f16) | 2 m (f16) | 4 qs[16] nibbles
    # w = q * d + m

    def decode_blocks(self, blocks: np.ndarray) -> np.ndarray:
        d, m = f16_at(blocks, 0), f16_at(blocks, 2)
        return as_f32(_nibbles(blocks[:, 4:20])) * d + m

    def random_blocks(self, n: int, rng: np.random.Generator) -> np.ndarray:
        b = random_bytes(n, self.type_size, rng)
        put_f16_scale(b, 0, rng, 0.1 / 8)
        _put_min(b, rng, 7.5)
        return b


class Q5_0(QuantFormat, ggml_type=GGMLType.Q5_0):
    # 0 d (f16) | 2 qh (u32, bit e = fifth bit of element e) | 6 qs[16] nibbles
    # w = (q - 16) * d

    def decode_blocks(self, blocks: np.ndarray) -> np.ndarray:
        d = f16_at(blocks, 0)
        q = (_nibbles(blocks[:, 6:22]) | _fifth_bits(u32_at(blocks, 2))).astype(np.int8) - 16
        return as_f32(q) * d

    def random_blocks(self, n: int, rng: np.random.Generator) -> np.ndarray:
        b = random_bytes(n, self.type_size, rng)
        put_f16_scale(b, 0, rng, 0.1 / 16)
        return b


class Q5_1(QuantFormat, ggml_type=GGMLType.Q5_1):
    # 0 d (f16) | 2 m (f16) | 4 qh (u32, bit e = fifth bit of element e) | 8 qs[16] nibbles
    # w = q * d + m

    def decode_blocks(self, blocks: np.ndarray) -> np.ndarray:
        d, m = f16_at(blocks, 0), f16_at(blocks, 2)
        q = _nibbles(blocks[:, 8:24]) | _fifth_bits(u32_at(blocks, 4))
        return as_f32(q) * d + m

    def random_blocks(self, n: int, rng: np.random.Generator) -> np.ndarray:
        b = random_bytes(n, self.type_size, rng)
        put_f16_scale(b, 0, rng, 0.1 / 16)
        _put_min(b, rng, 15.5)
        return b


class Q8_0(QuantFormat, ggml_type=GGMLType.Q8_0):
    # 0 d (f16) | 2 qs[32] int8
    # w = q * d

    def decode_blocks(self, blocks: np.ndarray) -> np.ndarray:
        d = f16_at(blocks, 0)
        return as_f32(blocks[:, 2:34].view(np.int8)) * d

    def random_blocks(self, n: int, rng: np.random.Generator) -> np.ndarray:
        b = random_bytes(n, self.type_size, rng)
        put_f16_scale(b, 0, rng, 0.1 / 127)
        return b
