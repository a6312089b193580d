"""k-quants: 256-element super-blocks with quantized sub-block scales (Q2_K..Q6_K, Q8_K).

Element order is what makes these decoders short: in Q2_K/Q3_K/Q6_K the 16 sub-blocks of 16 are
in output order (sub-block = element // 16), in Q4_K/Q5_K the 8 sub-blocks of 32 likewise.
"""

from __future__ import annotations

import numpy as np

from deimos.gguf.constants import GGMLType
from deimos.quant.base import (
    QuantFormat,
    as_f32,
    f16_at,
    put_f16_scale,
    random_bytes,
)

_SHIFT4 = np.array([0, 2, 4, 6], dtype=np.uint8)


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """2-bit codes of Q2_K/Q3_K: uint8 ``[n, 64]`` -> ``[n, 256]`` in output order.

    Element ``h*128 + j*32 + l`` (h half, j 0..3, l 0..31) is bits 2j..2j+1 of byte ``h*32 + l``.
    """
    n = qs.shape[0]
    q = qs.reshape(n, 2, 1, 32) >> _SHIFT4.reshape(1, 1, 4, 1)
    return (q & 3).reshape(n, 256)


def _scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12-byte scales field of Q4_K/Q5_K -> (8 scales, 8 mins), 6 bits each, uint8 ``[n, 8]``.

    Bytes 0-3: scale j low 6 bits (top 2 bits: high bits of scale j+4)
    Bytes 4-7: min j low 6 bits   (top 2 bits: high bits of min j+4)
    Bytes 8-11: scale j+4 low 4 bits | min j+4 low 4 bits << 4
    """
    a, b, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([a & 63, (c & 0x0F) | ((a >> 6) << 4)], axis=1)
    mn = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return sc, mn


def _by_sub(y: np.ndarray, n_sub: int) -> np.ndarray:
    return y.reshape(y.shape[0], n_sub, -1)


class Q2_K(QuantFormat, ggml_type=GGMLType.Q2_K):
    # 0 scales[16] (low nibble scale, high nibble min) | 16 qs[64] 2-bit
    # 80 d (f16) | 82 dmin (f16)
    # w = (d * sc) * q - (dmin * m), per sub-block of 16

    def decode_blocks(self, blocks: np.ndarray) -> np.ndarray:
        n = blocks.shape[0]
        d, dmin = f16_at(blocks, 80), f16_at(blocks, 82)
        sc = blocks[:, 0:16]
        dl = d * as_f32(sc & 0x0F)
        ml = dmin * as_f32(sc >> 4)
        q = as_f32(_by_sub(_crumbs(blocks[:, 16:80]), 16))
        return (dl[:, :, None] * q - ml[:, :, None]).reshape(n, 256)

    def random_blocks(self, n: int, rng: np.random.Generator) -> np.ndarray:
        b = random_bytes(n, self.type_size, rng)
        put_f16_scale(b, 80, rng, 0.1 / 45)
        put_f16_scale(b, 82, rng, 0.15 / 45)  # mean d*sc*q ~ 11 d; mean dmin*m ~ 7.5 dmin
        return b


def _q3k_scales(s: np.ndarray) -> np.ndarray:
    """Q3_K's 12-byte scales -> 16 signed scales (6-bit, minus 32) as int8 ``[n, 16]``.

    Scale j's low 4 bits: nibble (j // 8) of byte (j % 8); its high 2 bits: bits 2*(j // 4)..+1
    of byte 8 + j % 4.
    """
    a, b, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    low = np.concatenate([a & 0x0F, b & 0x0F, a >> 4, b >> 4], axis=1)
    high = np.concatenate([c & 3, (c >> 2) & 3, (c >> 4) & 3, c >> 6], axis=1)
    return (low | (high << 4)).astype(np.int8) - 32


class Q3_K(QuantFormat, ggml_type=GGMLType.Q3_K):
    # 0 hmask[32] | 32 qs[64] 2-bit | 96 scales[12] 6-bit packed | 108 d (f16)
    # w = (d * (sc - 32)) * (q - (hbit ? 0 : 4)), per sub-block of 16;
    # hbit of element h*128 + j*32 + k*16 + l is bit h*4 + j of hmask[k*16 + l]

    def decode_blocks(self, blocks: np.ndarray) -> np.ndarray:
        n = blocks.shape[0]
        d = f16_at(blocks, 108)
        dl = d * as_f32(_q3k_scales(blocks[:, 96:108]))
        hm = blocks[:, 0:32].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        hbit = (hm & 1).reshape(n, 256)
        q = _crumbs(blocks[:, 32:96]).astype(np.int8) - 4 * (1 - hbit).astype(np.int8)
        return (dl[:, :, None] * as_f32(_by_sub(q, 16))).reshape(n, 256)

    def random_blocks(self, n: int, rng: np.random.Generator) -> np.ndarray:
        b = random_bytes(n, self.type_size, rng)
        put_f16_scale(b, 108, rng, 0.1 / 128)
        return b


class Q4_K(QuantFormat, ggml_type=GGMLType.Q4_K):
    # 0 d (f16) | 2 dmin (f16) | 4 scales[12] 6-bit packed | 16 qs[128] nibbles
    # sub-block b (32 elements) = nibble b % 2 of qs[(b // 2) * 32 + l];
    # w = (d * sc) * q - (dmin * m)

    def decode_blocks(self, blocks: np.ndarray) -> np.ndarray:
        n = blocks.shape[0]
        d, dmin = f16_at(blocks, 0), f16_at(blocks, 2)
        sc, mn = _scale_min_k4(blocks[:, 4:16])
        qs = blocks[:, 16:144].reshape(n, 4, 1, 32)
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32)
        d1 = d * as_f32(sc)
        m1 = dmin * as_f32(mn)
        return (d1[:, :, None] * as_f32(q) - m1[:, :, None]).reshape(n, 256)

    def random_blocks(self, n: int, rng: np.random.Generator) -> np.ndarray:
        b = random_bytes(n, self.type_size, rng)
        put_f16_scale(b, 0, rng, 0.1 / 945)
        put_f16_scale(b, 2, rng, 7.5 * 0.1 / 945)
        return b


class Q5_K(QuantFormat, ggml_type=GGMLType.Q5_K):
    # 0 d (f16) | 2 dmin (f16) | 4 scales[12] 6-bit packed | 16 qh[32] | 48 qs[128] nibbles
    # sub-block b: low 4 bits = nibble b % 2 of qs[(b // 2) * 32 + l], bit 4 = bit b of qh[l];
    # w = (d * sc) * q - (dmin * m)

    def decode_blocks(self, blocks: np.ndarray) -> np.ndarray:
        n = blocks.shape[0]
        d, dmin = f16_at(blocks, 0), f16_at(blocks, 2)
        sc, mn = _scale_min_k4(blocks[:, 4:16])
        qs = blocks[:, 48:176].reshape(n, 4, 1, 32)
        low = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32)
        qh = blocks[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        q = low | ((qh & 1) << 4)
        d1 = d * as_f32(sc)
        m1 = dmin * as_f32(mn)
        return (d1[:, :, None] * as_f32(q) - m1[:, :, None]).reshape(n, 256)

    def random_blocks(self, n: int, rng: np.random.Generator) -> np.ndarray:
        b = random_bytes(n, self.type_size, rng)
        put_f16_scale(b, 0, rng, 0.1 / 1953)
        put_f16_scale(b, 2, rng, 15.5 * 0.1 / 1953)
        return b


class Q6_K(QuantFormat, ggml_type=GGMLType.Q6_K):
    # 0 ql[128] nibbles | 128 qh[64] 2-bit | 192 scales[16] int8 | 208 d (f16)
    # element h*128 + g*32 + l (g 0..3): low 4 bits = nibble g // 2 of ql[h*64 + (g % 2)*32 + l],
    # high 2 bits = bits 2g..2g+1 of qh[h*32 + l];
    # w = (d * sc) * (q - 32), sub-block = element // 16

    def decode_blocks(self, blocks: np.ndarray) -> np.ndarray:
        n = blocks.shape[0]
        d = f16_at(blocks, 208)
        ql = blocks[:, 0:128].reshape(n, 2, 1, 2, 32)
        low = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(n, 2, 4, 32)
        qh = blocks[:, 128:192].reshape(n, 2, 1, 32) >> _SHIFT4.reshape(1, 1, 4, 1)
        q = (low | ((qh & 3) << 4)).astype(np.int8) - 32
        ds = d * as_f32(blocks[:, 192:208].view(np.int8))
        return (ds[:, :, None] * as_f32(q.reshape(n, 16, 16))).reshape(n, 256)

    def random_blocks(self, n: int, rng: np.random.Generator) -> np.ndarray:
        b = random_bytes(n, self.type_size, rng)
        put_f16_scale(b, 208, rng, 0.1 / 4096)
        return b


class Q8_K(QuantFormat, ggml_type=GGMLType.Q8_K):
    # 0 d (f32) | 4 qs[256] int8 | 260 bsums[16] int16 (sum of each 16 qs; not needed to decode)
    # w = d * q

    def decode_blocks(self, blocks: np.ndarray) -> np.ndarray:
        d = np.ascontiguousarray(blocks[:, 0:4]).view("<f4")
        return d * as_f32(blocks[:, 4:260].view(np.int8))

    def random_blocks(self, n: int, rng: np.random.Generator) -> np.ndarray:
        b = random_bytes(n, self.type_size, rng)
        d = (0.1 / 127) * (0.5 + 0.5 * rng.random((n, 1), dtype=np.float32))
        b[:, 0:4] = d.astype("<f4").view(np.uint8)
        sums = b[:, 4:260].view(np.int8).reshape(n, 16, 16).sum(axis=2, dtype=np.int16)
        b[:, 260:292] = sums.astype("<i2").view(np.uint8)
        return b
