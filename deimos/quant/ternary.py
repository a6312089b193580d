"""Ternary formats (BitNet-style weights in {-1, 0, 1} times a per-block f16 scale)."""

from __future__ import annotations

import numpy as np

from deimos.gguf.constants import GGMLType
from deimos.quant.base import QuantFormat, as_f32, f16_at, put_f16_scale, random_bytes

_POW3_5 = np.array([1, 3, 9, 27, 81], dtype=np.uint8)
_SHIFT4 = np.array([0, 2, 4, 6], dtype=np.uint8)


def _trits(packed: np.ndarray, k: int) -> np.ndarray:
    """Base-3 fixed-point bytes -> trit n of each byte, uint8 ``[n, k, bytes]``.

    A byte b holds v = sum t_i 3^(4-i) as ceil(v * 256 / 243); multiplying by 3^n (mod 256)
    shifts trit n to the top, and (x * 3) >> 8 reads it.
    """
    x = packed[:, None, :] * _POW3_5[:k].reshape(1, k, 1)  # uint8: wraps, as in C
    return ((x.astype(np.uint16) * 3) >> 8).astype(np.uint8)


def _pack_trits(v: np.ndarray) -> np.ndarray:
    """Values 0..242 -> their ceil(v * 256 / 243) byte (the encoding above)."""
    return ((v.astype(np.uint16) * 256 + 242) // 243).astype(np.uint8)


class TQ1_0(QuantFormat, ggml_type=GGMLType.TQ1_0):
    # 0 qs[48] 5 trits per byte | 48 qh[4] 4 trits per byte | 52 d (f16)
    # elements 0..159: trit n of qs[m] (m < 32) -> element n*32 + m
    # elements 160..239: trit n of qs[32 + m] (m < 16) -> 160 + n*16 + m
    # elements 240..255: trit n of qh[j] -> 240 + n*4 + j;  w = (t - 1) * d

    def codes_and_scale(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(int8 codes ``[n, 256]`` in {-1, 0, 1}, d ``[n, 1]`` (an f16 widened)): w = code * d."""
        n = blocks.shape[0]
        t = np.concatenate(
            [
                _trits(blocks[:, 0:32], 5).reshape(n, 160),
                _trits(blocks[:, 32:48], 5).reshape(n, 80),
                _trits(blocks[:, 48:52], 4).reshape(n, 16),
            ],
            axis=1,
        )
        return t.astype(np.int8) - 1, f16_at(blocks, 52)

    def decode_blocks(self, blocks: np.ndarray) -> np.ndarray:
        codes, d = self.codes_and_scale(blocks)
        return as_f32(codes) * d

    def random_blocks(self, n: int, rng: np.random.Generator) -> np.ndarray:
        b = np.empty((n, self.type_size), dtype=np.uint8)
        b[:, 0:48] = _pack_trits(rng.integers(0, 243, (n, 48), dtype=np.uint16))
        # qh holds 4 trits, the first in the most significant position: value = 3 * (0..80)
        b[:, 48:52] = _pack_trits(3 * rng.integers(0, 81, (n, 4), dtype=np.uint16))
        put_f16_scale(b, 52, rng, 0.1)
        return b


class TQ2_0(QuantFormat, ggml_type=GGMLType.TQ2_0):
    # 0 qs[64] 2-bit (values 0..2) | 64 d (f16)
    # element h*128 + l*32 + m = bits 2l..2l+1 of qs[h*32 + m];  w = (q - 1) * d

    def codes_and_scale(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(int8 codes ``[n, 256]`` in {-1, 0, 1}, d ``[n, 1]`` (an f16 widened)): w = code * d."""
        n = blocks.shape[0]
        q = blocks[:, 0:64].reshape(n, 2, 1, 32) >> _SHIFT4.reshape(1, 1, 4, 1)
        return (q & 3).reshape(n, 256).astype(np.int8) - 1, f16_at(blocks, 64)

    def decode_blocks(self, blocks: np.ndarray) -> np.ndarray:
        codes, d = self.codes_and_scale(blocks)
        return as_f32(codes) * d

    def random_blocks(self, n: int, rng: np.random.Generator) -> np.ndarray:
        b = random_bytes(n, self.type_size, rng)
        t = rng.integers(0, 3, (n, 64, 4), dtype=np.uint8) << _SHIFT4
        b[:, 0:64] = t[..., 0] | t[..., 1] | t[..., 2] | t[..., 3]
        put_f16_scale(b, 64, rng, 0.1)
        return b
