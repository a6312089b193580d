"""i-quants: lattice-codebook formats (IQ1/IQ2/IQ3) and the non-linear 4-bit ones (IQ4_NL/XS).

A group of 8 weights is one grid row (a point of the E8 / D4-like lattice tables in iq_grids.py)
times a sub-block scale, with per-coordinate signs. ggml writes ``db * grid[j] * (neg ? -1.f :
1.f)``; multiplying by +-1 is exact, so the decoders multiply by tables of +-1 in the same order.
"""

from __future__ import annotations

import numpy as np

from deimos.gguf.constants import GGMLType
from deimos.quant import iq_grids as g
from deimos.quant.base import (
    QuantFormat,
    as_f32,
    f16_at,
    put_f16_scale,
    put_u16,
    random_bytes,
    random_f16_bits,
    u16_at,
    u32_at,
)


def _ro(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


# SIGN8[b, j] = -1 if bit j of b is set else +1; KSIGN[i] = SIGN8[ksigns_iq2xs[i]]
# (lookups use .take(..., axis=0): several times faster than fancy indexing)
SIGN8 = _ro(np.where((np.arange(256)[:, None] >> np.arange(8)) & 1, -1.0, 1.0).astype(np.float32))
KSIGN = _ro(SIGN8[g.KSIGNS_IQ2XS])
_F = {name: _ro(getattr(g, name).astype(np.float32)) for name in (
    "IQ2XXS_GRID", "IQ2XS_GRID", "IQ2S_GRID", "IQ3XXS_GRID", "IQ3S_GRID")}
_KV_IQ4NL = _ro(g.KVALUES_IQ4NL.astype(np.float32))
_KV_IQ4NL_I8 = _ro(g.KVALUES_IQ4NL.astype(np.int8))
_I1S = _ro(g.IQ1S_GRID.astype(np.int8))

_SHIFT_7 = np.array([0, 7, 14, 21], dtype=np.uint32)  # 4 x 7-bit sign indices in a u32


def _scaled(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """int8 codes ``[n, 256]`` times float32 scales ``[n, s]`` (one per 256 / s elements: 32 or
    16): float32 ``[n, 256]``. The products are exact (codes and scales have few significant
    bits), so this equals ggml's ``db * grid * sign`` bit for bit."""
    n, s = scale.shape
    return (scale[:, :, None] * as_f32(codes).reshape(n, s, 256 // s)).reshape(n, 256)


def _halves(b: np.ndarray) -> np.ndarray:
    """uint8 ``[n, k]`` -> ``[n, k, 2]`` (low nibble, high nibble)."""
    return np.stack([b & 0x0F, b >> 4], axis=-1)


class IQ2_XXS(QuantFormat, ggml_type=GGMLType.IQ2_XXS):
    # 0 d (f16) | 2 qs[64]: 8 x (4 grid indices u8 | u32 aux)
    # aux: 4 x 7-bit sign index (bits 0-27) | 4-bit scale s (bits 28-31)
    # w = (d * (0.5 + s) * 0.25) * iq2xxs_grid[idx][j] * sign

    def codes_and_scale(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(int8 codes ``[n, 256]`` = signed grid values, float32 scales ``[n, 8]`` = db)."""
        n = blocks.shape[0]
        d = f16_at(blocks, 0)
        q = blocks[:, 2:66].reshape(n, 8, 8)
        aux = np.ascontiguousarray(q[:, :, 4:8]).view("<u4")  # [n, 8, 1]
        db = d * (0.5 + as_f32(aux[:, :, 0] >> 28)) * 0.25  # [n, 8]
        grid = _F["IQ2XXS_GRID"].take(q[:, :, 0:4], axis=0)  # [n, 8, 4, 8]
        sign = KSIGN.take((aux >> _SHIFT_7) & 127, axis=0)  # [n, 8, 4, 8]
        return (grid * sign).astype(np.int8).reshape(n, 256), db

    def decode_blocks(self, blocks: np.ndarray) -> np.ndarray:
        return _scaled(*self.codes_and_scale(blocks))

    def random_blocks(self, n: int, rng: np.random.Generator) -> np.ndarray:
        b = random_bytes(n, self.type_size, rng)
        put_f16_scale(b, 0, rng, 0.1 / 166)
        return b


class IQ2_XS(QuantFormat, ggml_type=GGMLType.IQ2_XS):
    # 0 d (f16) | 2 qs[32] u16: 9-bit grid index | 7-bit sign index << 9 | 66 scales[8] 2 x 4-bit
    # group l of sub-block ib uses nibble l // 2 of scales[ib]: db = d * (0.5 + s) * 0.25

    def codes_and_scale(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(int8 codes ``[n, 256]`` = signed grid values, float32 scales ``[n, 16]`` = db, one
        per 16 elements)."""
        n = blocks.shape[0]
        d = f16_at(blocks, 0)
        qs = u16_at(blocks, 2, 32).reshape(n, 8, 4)
        db = d * (0.5 + as_f32(_halves(blocks[:, 66:74]).reshape(n, 16))) * 0.25
        grid = _F["IQ2XS_GRID"].take(qs & 511, axis=0)
        sign = KSIGN.take(qs >> 9, axis=0)
        return (grid * sign).astype(np.int8).reshape(n, 256), db

    def decode_blocks(self, blocks: np.ndarray) -> np.ndarray:
        return _scaled(*self.codes_and_scale(blocks))

    def random_blocks(self, n: int, rng: np.random.Generator) -> np.ndarray:
        b = random_bytes(n, self.type_size, rng)
        put_f16_scale(b, 0, rng, 0.1 / 166)
        return b


class IQ2_S(QuantFormat, ggml_type=GGMLType.IQ2_S):
    # 0 d (f16) | 2 qs[32] grid index low 8 bits | 34 signs[32] | 66 qh[8] | 74 scales[8] 2 x 4-bit
    # group l of sub-block ib: index = qs[4ib + l] | bits 2l..2l+1 of qh[ib] << 8,
    # sign bits = signs[4ib + l], db = d * (0.5 + nibble l // 2 of scales[ib]) * 0.25

    def codes_and_scale(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(int8 codes ``[n, 256]`` = signed grid values, float32 scales ``[n, 16]`` = db, one
        per 16 elements)."""
        n = blocks.shape[0]
        d = f16_at(blocks, 0)
        qs = blocks[:, 2:34].reshape(n, 8, 4).astype(np.uint16)
        qh = blocks[:, 66:74, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)
        idx = qs | ((qh & 3).astype(np.uint16) << 8)
        db = d * (0.5 + as_f32(_halves(blocks[:, 74:82]).reshape(n, 16))) * 0.25
        grid = _F["IQ2S_GRID"].take(idx, axis=0)
        sign = SIGN8.take(blocks[:, 34:66].reshape(n, 8, 4), axis=0)
        return (grid * sign).astype(np.int8).reshape(n, 256), db

    def decode_blocks(self, blocks: np.ndarray) -> np.ndarray:
        return _scaled(*self.codes_and_scale(blocks))

    def random_blocks(self, n: int, rng: np.random.Generator) -> np.ndarray:
        b = random_bytes(n, self.type_size, rng)
        put_f16_scale(b, 0, rng, 0.1 / 166)
        return b


class IQ3_XXS(QuantFormat, ggml_type=GGMLType.IQ3_XXS):
    # 0 d (f16) | 2 qs[64] grid indices (4 coords each) | 66 aux[8] u32:
    # 4 x 7-bit sign index (bits 0-27) | scale s (bits 28-31); db = d * (0.5 + s) * 0.5
    # group l of sub-block ib = grid[qs[8ib + 2l]] ++ grid[qs[8ib + 2l + 1]]

    def codes_and_scale(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(int8 codes ``[n, 256]`` = signed grid values, float32 scales ``[n, 8]`` = db)."""
        n = blocks.shape[0]
        d = f16_at(blocks, 0)
        aux = u32_at(blocks, 66, 8)[:, :, None]  # [n, 8, 1]
        db = d * (0.5 + as_f32(aux[:, :, 0] >> 28)) * 0.5
        grid = _F["IQ3XXS_GRID"].take(blocks[:, 2:66].reshape(n, 8, 8), axis=0).reshape(n, 8, 4, 8)
        sign = KSIGN.take((aux >> _SHIFT_7) & 127, axis=0)
        return (grid * sign).astype(np.int8).reshape(n, 256), db

    def decode_blocks(self, blocks: np.ndarray) -> np.ndarray:
        return _scaled(*self.codes_and_scale(blocks))

    def random_blocks(self, n: int, rng: np.random.Generator) -> np.ndarray:
        b = random_bytes(n, self.type_size, rng)
        put_f16_scale(b, 0, rng, 0.1 / 480)
        return b


class IQ3_S(QuantFormat, ggml_type=GGMLType.IQ3_S):
    # 0 d (f16) | 2 qs[64] grid index low 8 bits | 66 qh[8] | 74 signs[32] | 106 scales[4] 2 x 4-bit
    # sub-block ib: index p (0..7) = qs[8ib + p] | bit p of qh[ib] << 8; sign bits of group l =
    # signs[4ib + l]; db = d * (1 + 2 * nibble ib % 2 of scales[ib // 2])

    def codes_and_scale(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(int8 codes ``[n, 256]`` = signed grid values, float32 scales ``[n, 8]`` = db)."""
        n = blocks.shape[0]
        d = f16_at(blocks, 0)
        qs = blocks[:, 2:66].reshape(n, 8, 8).astype(np.uint16)
        qh = (blocks[:, 66:74, None] >> np.arange(8, dtype=np.uint8)) & 1
        idx = qs | (qh.astype(np.uint16) << 8)
        s = _halves(blocks[:, 106:110]).reshape(n, 8)
        db = d * as_f32(1 + 2 * s)  # [n, 8]
        grid = _F["IQ3S_GRID"].take(idx, axis=0).reshape(n, 8, 4, 8)
        sign = SIGN8.take(blocks[:, 74:106].reshape(n, 8, 4), axis=0)
        return (grid * sign).astype(np.int8).reshape(n, 256), db

    def decode_blocks(self, blocks: np.ndarray) -> np.ndarray:
        return _scaled(*self.codes_and_scale(blocks))

    def random_blocks(self, n: int, rng: np.random.Generator) -> np.ndarray:
        b = random_bytes(n, self.type_size, rng)
        put_f16_scale(b, 0, rng, 0.1 / 465)
        return b


class IQ1_S(QuantFormat, ggml_type=GGMLType.IQ1_S):
    # 0 d (f16) | 2 qs[32] grid index low 8 bits | 34 qh[8] u16:
    # 4 x 3-bit index high bits (bits 0-11) | scale s (bits 12-14) | delta sign (bit 15)
    # w = (d * (2s + 1)) * (iq1s_grid[idx][j] + (+-0.125))

    def codes_and_scale(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(int8 codes ``[n, 256]`` = 8 * (grid + delta) in -9..9, float32 scales ``[n, 8]`` =
        d * (2s + 1) / 8: the same products, exact)."""
        n = blocks.shape[0]
        d = f16_at(blocks, 0)
        qh = u16_at(blocks, 34, 8)  # [n, 8]
        dl = d * as_f32(2 * ((qh >> 12) & 7) + 1)
        delta = np.where(qh & 0x8000, -1, 1).astype(np.int8)  # 8 * (+-0.125)
        hi = (qh[:, :, None] >> np.array([0, 3, 6, 9], dtype=np.uint16)) & 7
        idx = blocks[:, 2:34].reshape(n, 8, 4).astype(np.uint16) | (hi << 8)
        grid = _I1S.take(idx, axis=0)  # [n, 8, 4, 8] int8 -1..1
        return (8 * grid + delta[:, :, None, None]).reshape(n, 256), dl * np.float32(0.125)

    def decode_blocks(self, blocks: np.ndarray) -> np.ndarray:
        return _scaled(*self.codes_and_scale(blocks))

    def random_blocks(self, n: int, rng: np.random.Generator) -> np.ndarray:
        b = random_bytes(n, self.type_size, rng)
        put_f16_scale(b, 0, rng, 0.1 / 17)
        return b


class IQ1_M(QuantFormat, ggml_type=GGMLType.IQ1_M):
    # 0 qs[32] grid index low 8 bits | 32 qh[16] 2 x (3-bit index high bits | delta sign bit 3)
    # 48 sc[4] u16: 4 x 3-bit group-pair scales (bits 0-11) | one nibble of d (bits 12-15);
    # d (f16) = sc[0] >> 12 | sc[1] >> 12 << 4 | sc[2] >> 12 << 8 | sc[3] >> 12 << 12
    # group l of sub-block ib: index = qs[4ib + l] | (nibble l % 2 of qh[2ib + l // 2]) & 7 << 8,
    # scale field k = 2ib + l // 2 is bits 3(k % 4).. of sc[k // 4];
    # w = (d * (2s + 1)) * (grid + delta)

    def codes_and_scale(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(int8 codes ``[n, 256]`` = 8 * (grid + delta) in -9..9, float32 scales ``[n, 16]`` =
        d * (2s + 1) / 8, one per 16 elements: the same products, exact)."""
        n = blocks.shape[0]
        sc = u16_at(blocks, 48, 4)
        d16 = (sc >> 12) << np.array([0, 4, 8, 12], dtype=np.uint16)
        d16 = d16[:, 0] | d16[:, 1] | d16[:, 2] | d16[:, 3]
        d = d16.view(np.float16).astype(np.float32)[:, None]
        s = (sc[:, :, None] >> np.array([0, 3, 6, 9], dtype=np.uint16)) & 7
        dl = d * as_f32(2 * s.reshape(n, 16) + 1)
        nib = _halves(blocks[:, 32:48]).reshape(n, 8, 4)
        idx = blocks[:, 0:32].reshape(n, 8, 4).astype(np.uint16) | ((nib & 7).astype(np.uint16) << 8)
        delta = np.where(nib & 8, -1, 1).astype(np.int8)  # 8 * (+-0.125)
        grid = _I1S.take(idx, axis=0)  # [n, 8, 4, 8] int8 -1..1
        return (8 * grid + delta[..., None]).reshape(n, 256), dl * np.float32(0.125)

    def decode_blocks(self, blocks: np.ndarray) -> np.ndarray:
        return _scaled(*self.codes_and_scale(blocks))

    def random_blocks(self, n: int, rng: np.random.Generator) -> np.ndarray:
        b = random_bytes(n, self.type_size, rng)
        d16 = random_f16_bits(rng, (n, 1), 0.05 / 17, 0.1 / 17)
        nibbles = (d16 >> np.array([0, 4, 8, 12], dtype=np.uint16)) & 0xF
        put_u16(b, 48, (u16_at(b, 48, 4) & 0x0FFF) | (nibbles << 12))
        return b


class IQ4_NL(QuantFormat, ggml_type=GGMLType.IQ4_NL):
    # 0 d (f16) | 2 qs[16] nibbles (byte j: element j low, element j+16 high)
    # w = d * kvalues_iq4nl[q]

    def codes_and_scale(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(int8 codes ``[n, 32]`` = kvalues_iq4nl[q], d ``[n, 1]`` (an f16 widened)): w = d * code."""
        qs = blocks[:, 2:18]
        return _KV_IQ4NL_I8.take(np.concatenate([qs & 0x0F, qs >> 4], axis=1)), f16_at(blocks, 0)

    def decode_blocks(self, blocks: np.ndarray) -> np.ndarray:
        codes, d = self.codes_and_scale(blocks)
        return d * as_f32(codes)

    def random_blocks(self, n: int, rng: np.random.Generator) -> np.ndarray:
        b = random_bytes(n, self.type_size, rng)
        put_f16_scale(b, 0, rng, 0.1 / 127)
        return b


class IQ4_XS(QuantFormat, ggml_type=GGMLType.IQ4_XS):
    # 0 d (f16) | 2 scales_h (u16, 2 bits per sub-block) | 4 scales_l[4] 2 x 4-bit | 8 qs[128]
    # sub-block ib: ls = nibble ib % 2 of scales_l[ib // 2] | bits 2ib..2ib+1 of scales_h << 4;
    # qs[16ib + j]: element j low nibble, element j+16 high; w = (d * (ls - 32)) * kvalues_iq4nl[q]

    def codes_and_scale(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(int8 codes ``[n, 256]`` = kvalues_iq4nl[q], float32 scales ``[n, 8]`` = d * (ls - 32)
        of each sub-block of 32): w = scale * code."""
        n = blocks.shape[0]
        d = f16_at(blocks, 0)
        low = _halves(blocks[:, 4:8]).reshape(n, 8)
        high = (u16_at(blocks, 2) >> (2 * np.arange(8, dtype=np.uint16))) & 3
        ls = (low | (high << 4)).astype(np.int16) - 32
        qs = blocks[:, 8:136].reshape(n, 8, 16)
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, 256)
        return _KV_IQ4NL_I8.take(q), d * as_f32(ls)

    def decode_blocks(self, blocks: np.ndarray) -> np.ndarray:
        return _scaled(*self.codes_and_scale(blocks))

    def random_blocks(self, n: int, rng: np.random.Generator) -> np.ndarray:
        b = random_bytes(n, self.type_size, rng)
        put_f16_scale(b, 0, rng, 0.1 / 4064)
        return b
