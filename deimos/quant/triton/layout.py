"""GPU weight layouts: GGUF blocks repacked once at load into separate, aligned arrays.

Every format is cut into groups of 32 consecutive elements of a row (group ``u`` holds row
elements ``32u .. 32u+31``). The low 4 bits of a group's codes become four int32 words, and
the element order inside the words is chosen so that one thread's 16-byte load holds a whole
group and the activations it needs are contiguous::

    word w (0..3) of group u, nibble k (0..7, bits 4k..4k+3)  <->  element 32u + 4k + w

      bit 31        27        23        19        15        11         7         3      0
          | e28+w   | e24+w   | e20+w   | e16+w   | e12+w   | e8+w    | e4+w    | e0+w  |

So the kernel takes nibble k of all four words of a group at once and multiplies them with
x[32u + 4k .. 32u + 4k + 3], a 16-byte vector. Q8_0 uses eight words per group, one byte per
code (word w, byte b <-> element 32u + 8b + w); Q2_K two words, 2 bits a code (word w, crumb
k <-> element 32u + 2k + w). Extra code bits go to their own arrays in the
same (group, word) order, scales to theirs. Bytes per weight stay exactly GGUF's: a repack
moves bytes, it never widens them. The one exception is a format packed in another format's
layout (``KERNEL_TYPE``: Q3_K as Q6_K codes, exact values, 6.56 instead of 3.44 bits per
weight; TQ1_0, TQ2_0, IQ4_NL as Q8_0, 8.5 bits; IQ4_XS, MXFP4 and the IQ1_S..IQ3_S formats
with one scale per 32 as Q8_0 with float32 scales, 9 bits; IQ2_XS, IQ2_S, IQ1_M with one per 16,
10 bits) until it has a layout of its own;
it is still far below fp16's 16.

``pack(blocks, ggml_type)`` works on CPU numpy (uint8 ``[rows, row_bytes]``, the raw GGUF tensor
bytes) and returns a ``PackedWeight`` of torch CPU tensors; move it with ``.to(device)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from deimos.gguf.constants import GGML_BLOCK, GGMLType
from deimos.quant import get_format
from deimos.quant.kquants import _crumbs, _q3k_scales, _scale_min_k4


@dataclass(frozen=True)
class PackedWeight:
    """A quantized matrix ``[n, k]`` (n output rows) in its GPU layout.

    ``tensors`` maps array names to tensors; what each holds is drawn in the format's
    ``_pack_*`` function below.
    """

    ggml_type: GGMLType
    n: int
    k: int
    tensors: dict[str, torch.Tensor]

    def to(self, device: torch.device | str) -> PackedWeight:
        moved = {name: t.to(device) for name, t in self.tensors.items()}
        return PackedWeight(self.ggml_type, self.n, self.k, moved)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def stack_key(self) -> tuple:
        """Equal for two matrices whose rows can be stacked into one packed matrix: the same
        kernel format and K, and every array of the same dtype and row width (formats in Q8_0's
        layout differ in their scales: f16 or f32, per 32 or per 16)."""
        arrays = tuple((name, t.dtype, tuple(t.shape[1:])) for name, t in sorted(self.tensors.items()))
        return (self.ggml_type, self.k, arrays)

    @property
    def device(self) -> torch.device:
        return next(iter(self.tensors.values())).device


# ---- helpers: codes [m, 32] of each group -> words ----------------------------------------------

_NIBBLE_SHIFT = (4 * np.arange(8, dtype=np.uint32)).reshape(1, 8, 1)


def _nibble_words(codes: np.ndarray) -> np.ndarray:
    """Low 4 bits of codes ``[g, 32]`` (element order) -> int32 ``[g, 4]`` (layout drawn above)."""
    c = (codes.astype(np.uint32) & 0xF).reshape(-1, 8, 4)  # [g, k, w]: element 4k + w
    return np.bitwise_or.reduce(c << _NIBBLE_SHIFT, axis=1).view(np.int32)


def _bit_bytes(bits: np.ndarray, width: int) -> np.ndarray:
    """Bits ``[g, 32]`` of ``width`` (1 or 2) per element -> ``[g, 4]`` uint8 (width 1) or
    int16 (width 2, the uint16 bits): element 32u + 4k + w is at bits k*width.. of entry w."""
    b = bits.astype(np.uint32).reshape(-1, 8, 4)
    shift = (width * np.arange(8, dtype=np.uint32)).reshape(1, 8, 1)
    out = np.bitwise_or.reduce(b << shift, axis=1)
    return out.astype(np.uint8) if width == 1 else out.astype(np.uint16).view(np.int16)


# Q6_K's high 2 bits: code k of word w (element 32u + 4k + w) at bits Q6_HIGH_SHIFT[k].. of
# int16 entry 4u + w. Codes 2j and 2j + 1 share nibble j, placed at bits (4, 12, 0, 8)[j] so
# that (h & 0xF0F0) | (h << 20 & 0xF0F00000) puts nibble j at bits 4-7 of byte j: the high
# bits of the GEMV's two code words (codes 0,2,4,6 and 1,3,5,7 in bytes 0..3) in three
# operations instead of a spread per byte.
Q6_HIGH_SHIFT = (4, 6, 12, 14, 0, 2, 8, 10)


def _q6_high(bits: np.ndarray) -> np.ndarray:
    """2-bit values ``[g, 32]`` (element order) -> int16 ``[g, 4]`` (``Q6_HIGH_SHIFT``)."""
    b = bits.astype(np.uint32).reshape(-1, 8, 4)
    shift = np.array(Q6_HIGH_SHIFT, dtype=np.uint32).reshape(1, 8, 1)
    return np.bitwise_or.reduce(b << shift, axis=1).astype(np.uint16).view(np.int16)


def _f16(blocks: np.ndarray, off: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[:, off : off + 2]).view(np.float16)[:, 0]


def _torch(a: np.ndarray, rows: int, dtype: np.dtype | None = None) -> torch.Tensor:
    a = np.ascontiguousarray(a if dtype is None else a.view(dtype))
    return torch.from_numpy(a.reshape(rows, -1).copy())


# ---- per format ---------------------------------------------------------------------------------


def _pack_q4_k(b: np.ndarray, rows: int) -> dict[str, torch.Tensor]:
    # GGUF block (144 bytes / 256 elements): d f16 | dmin f16 | scales[12] | qs[128]
    # element 32j + l (sub-block j) = nibble j % 2 of qs[32 * (j // 2) + l]
    # qw   int32 [n, k/8]      codes, layout above
    # meta int32 [n, k/64]    4 words per block (_k4_meta)
    qs = b[:, 16:144].reshape(-1, 4, 1, 32)
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=2).reshape(-1, 32)  # group 8*blk + j
    return {
        "qw": _torch(_nibble_words(codes), rows),
        "meta": _torch(_k4_meta(b), rows, np.int32),
    }


def _k4_meta(b: np.ndarray) -> np.ndarray:
    """A Q4_K/Q5_K block's first 16 bytes (d, dmin, 12 bytes of 6-bit scales and mins) -> the
    same 16 bytes arranged so a group's scale and min take two loads and a few operations:
      word 0 = d | dmin << 16 (f16 bits, unchanged)
      byte j of word 1 (j < 4) / word 2 (group j + 4): scale | (min & 3) << 6
      nibble j of word 3 (bits 4j..4j+3): min >> 2 of group j"""
    sc, mn = _scale_min_k4(b[:, 4:16])  # uint8 [blocks, 8]
    out = np.empty((b.shape[0], 16), dtype=np.uint8)
    out[:, 0:4] = b[:, 0:4]
    out[:, 4:12] = sc | ((mn & 3) << 6)
    hi = (mn >> 2).astype(np.uint32) << (4 * np.arange(8, dtype=np.uint32))
    out[:, 12:16] = np.bitwise_or.reduce(hi, axis=1).astype("<u4").view(np.uint8).reshape(-1, 4)
    return out


def _pack_q5_k(b: np.ndarray, rows: int) -> dict[str, torch.Tensor]:
    # GGUF block (176 bytes): d | dmin | scales[12] | qh[32] | qs[128]
    # element 32j + l: low 4 bits as Q4_K, bit 4 = bit j of qh[l]
    # qw, meta as Q4_K; qh uint8 [n, k/8]: bit k of byte 4u + w = bit 4 of element 32u + 4k + w
    qs = b[:, 48:176].reshape(-1, 4, 1, 32)
    low = np.concatenate([qs & 0xF, qs >> 4], axis=2).reshape(-1, 32)
    qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    return {
        "qw": _torch(_nibble_words(low), rows),
        "qh": _torch(_bit_bytes((qh & 1).reshape(-1, 32), 1), rows),
        "meta": _torch(_k4_meta(b), rows, np.int32),
    }


def _pack_q6_k(b: np.ndarray, rows: int) -> dict[str, torch.Tensor]:
    # GGUF block (210 bytes): ql[128] | qh[64] | scales int8[16] | d f16
    # element 128h + 32g + l: low 4 bits = nibble g // 2 of ql[64h + 32(g % 2) + l],
    # high 2 bits = bits 2g.. of qh[32h + l]; w = d * sc[element // 16] * (q - 32)
    # qw int32 [n, k/8]   low 4 bits, layout above
    # qh int16 [n, k/8]   bits Q6_HIGH_SHIFT[k].. of entry 4u + w = high bits of element 32u + 4k + w
    # sc int8 [n, k/16]   the 16 scales of each block, in order; d f16 [n, k/256]
    ql = b[:, 0:128].reshape(-1, 2, 2, 32)
    low = np.concatenate([ql & 0xF, ql >> 4], axis=2)  # [m, h, g, l]
    qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    return {
        "qw": _torch(_nibble_words(low.reshape(-1, 32)), rows),
        "qh": _torch(_q6_high((qh & 3).reshape(-1, 32)), rows),
        "sc": _torch(b[:, 192:208], rows, np.int8),
        "d": _torch(_f16(b, 208), rows),
    }


_CRUMB_SHIFT = (2 * np.arange(16, dtype=np.uint32)).reshape(1, 16, 1)


def _crumb_words(codes: np.ndarray) -> np.ndarray:
    """2-bit codes ``[g, 32]`` (element order) -> int32 ``[g, 2]``: crumb k (bits 2k, 2k+1) of
    word w = element 2k + w. (Shifted by 2p and masked with 0x03030303, a word holds codes
    p, p+4, p+8, p+12 in its bytes: elements 2p + w + 8j, the GEMV's x word 2p + w.)"""
    c = (codes.astype(np.uint32) & 3).reshape(-1, 16, 2)  # [g, k, w]
    return np.bitwise_or.reduce(c << _CRUMB_SHIFT, axis=1).view(np.int32)


def _pack_q2_k(b: np.ndarray, rows: int) -> dict[str, torch.Tensor]:
    # GGUF block (84 bytes / 256 elements): scales[16] (sub-block of 16: low nibble scale,
    # high nibble min) | qs[64] 2-bit (kquants._crumbs) | d f16 | dmin f16;
    # w = d * (sc & 15) * q - dmin * (sc >> 4)
    # qw int32 [n, k/16]  crumb k of word 2u + w = element 32u + 2k + w (_crumb_words)
    # sc int16 [n, k/32]  group u's two scale bytes (low byte: elements 0-15), GGUF's bytes
    # d, m f16 [n, k/256] d, dmin. 2.625 bits per weight, as GGUF.
    return {
        "qw": _torch(_crumb_words(_crumbs(b[:, 16:80]).reshape(-1, 32)), rows),
        "sc": _torch(b[:, 0:16], rows, np.int16),
        "d": _torch(_f16(b, 80), rows),
        "m": _torch(_f16(b, 82), rows),
    }


def _pack_q8_0(b: np.ndarray, rows: int) -> dict[str, torch.Tensor]:
    # GGUF block (34 bytes / 32 elements): d f16 | qs int8[32]
    # qw int32 [n, k/4]: byte b (bits 8b..8b+7) of word 8u + w = code of element 32u + 8b + w
    # d  f16 [n, k/32]
    return {"qw": _torch(_q8_words(b[:, 2:34]), rows, np.int32), "d": _torch(_f16(b, 0), rows)}


def _q8_words(codes: np.ndarray) -> np.ndarray:
    """Code bytes ``[g, 32]`` (element order) -> ``[g, 8, 4]`` bytes: word w, byte b = element 8b + w."""
    return np.ascontiguousarray(codes.reshape(-1, 4, 8).transpose(0, 2, 1))


def _legacy_nibbles(qs: np.ndarray) -> np.ndarray:
    # byte j of qs: element j in the low nibble, element j + 16 in the high nibble
    return np.concatenate([qs & 0xF, qs >> 4], axis=1)


def _fifth_bits(b: np.ndarray, off: int) -> np.ndarray:
    qh = np.ascontiguousarray(b[:, off : off + 4]).view("<u4")  # bit e = fifth bit of element e
    return ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _pack_q4_0(b: np.ndarray, rows: int) -> dict[str, torch.Tensor]:
    # GGUF block (18 bytes): d f16 | qs[16]; w = d * (q - 8)
    # qw int32 [n, k/8] layout above; d f16 [n, k/32]
    return {
        "qw": _torch(_nibble_words(_legacy_nibbles(b[:, 2:18])), rows),
        "d": _torch(_f16(b, 0), rows),
    }


def _pack_q4_1(b: np.ndarray, rows: int) -> dict[str, torch.Tensor]:
    # GGUF block (20 bytes): d f16 | m f16 | qs[16]; w = d * q + m
    # qw as Q4_0; d, m f16 [n, k/32]
    return {
        "qw": _torch(_nibble_words(_legacy_nibbles(b[:, 4:20])), rows),
        "d": _torch(_f16(b, 0), rows),
        "m": _torch(_f16(b, 2), rows),
    }


def _pack_q5_0(b: np.ndarray, rows: int) -> dict[str, torch.Tensor]:
    # GGUF block (22 bytes): d f16 | qh u32 (bit e = fifth bit of element e) | qs[16];
    # w = d * (q - 16). qw as Q4_0; qh uint8 [n, k/8] as Q5_K's; d f16 [n, k/32]
    return {
        "qw": _torch(_nibble_words(_legacy_nibbles(b[:, 6:22])), rows),
        "qh": _torch(_bit_bytes(_fifth_bits(b, 2), 1), rows),
        "d": _torch(_f16(b, 0), rows),
    }


def _pack_q5_1(b: np.ndarray, rows: int) -> dict[str, torch.Tensor]:
    # GGUF block (24 bytes): d f16 | m f16 | qh u32 (bit e = fifth bit of element e) | qs[16];
    # w = d * q + m. qw as Q4_0; qh as Q5_0's; d, m f16 [n, k/32]
    return {
        "qw": _torch(_nibble_words(_legacy_nibbles(b[:, 8:24])), rows),
        "qh": _torch(_bit_bytes(_fifth_bits(b, 4), 1), rows),
        "d": _torch(_f16(b, 0), rows),
        "m": _torch(_f16(b, 2), rows),
    }


def _pack_q3_k(b: np.ndarray, rows: int) -> dict[str, torch.Tensor]:
    # GGUF block (110 bytes): hmask[32] | qs[64] 2-bit | scales[12] 6-bit packed | d f16;
    # w = d * (sc - 32) * (q + 4 hbit - 4) per sub-block of 16 (deimos.quant.kquants.Q3_K).
    # The same values as Q6_K codes q6 = q + 4 hbit + 28 (28..35) with Q6_K's int8 scales
    # (sc - 32) and d: packed in Q6_K's layout (qw, qh, sc, d as _pack_q6_k), run by its
    # kernels. Exact, but 6.56 bits per weight on the GPU instead of GGUF's 3.44.
    n = b.shape[0]
    hm = b[:, 0:32].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    hbit = (hm & 1).reshape(n, 256)
    codes = (_crumbs(b[:, 32:96]) + 4 * hbit + 28).astype(np.uint8)
    return {
        "qw": _torch(_nibble_words(codes.reshape(-1, 32)), rows),
        "qh": _torch(_q6_high((codes >> 4).reshape(-1, 32)), rows),
        "sc": _torch(_q3k_scales(b[:, 96:108]), rows),
        "d": _torch(_f16(b, 108), rows),
    }


def _as_q8_0(t: GGMLType, scale_dtype: type = np.float16) -> Callable[[np.ndarray, int], dict[str, torch.Tensor]]:
    """A format whose weights are int8 codes times one scale per 32 or per block, packed in
    Q8_0's layout (``codes_and_scale`` of its class): TQ1_0/TQ2_0 (codes -1..1, f16 d per
    256) and IQ4_NL (kvalues_iq4nl, f16 d per 32) with Q8_0's f16 scales; IQ4_XS (d * (ls - 32)
    per 32), MXFP4 (2^(e - 128)), IQ2_XXS, IQ3_XXS, IQ3_S (signed grid values, db per 32) and
    IQ1_S (8 * (grid +- 1/8), db / 8) with float32 scales, which f16 cannot hold exactly;
    IQ2_XS, IQ2_S and IQ1_M with a float32 scale per 16 elements (``d`` [n, k/16], which the
    kernels detect: ``scale16``). The same values, on the Q8_0 kernels (they read the scale in
    its own dtype): 8.5, 9 or 10 bits a weight instead of the fp16 fallback's 16."""
    fmt = get_format(t)

    def packer(b: np.ndarray, rows: int) -> dict[str, torch.Tensor]:
        codes, scale = fmt.codes_and_scale(b)
        per = fmt.block_size // scale.shape[1]  # elements a scale covers: 16, or 32 and up
        d = scale.astype(scale_dtype)
        if per > 16:  # one scale per group of 32
            d = np.repeat(d, per // 32, axis=1)
        return {"qw": _torch(_q8_words(codes.reshape(-1, 32).view(np.uint8)), rows, np.int32),
                "d": _torch(d.reshape(-1), rows)}

    return packer


_PACKERS: dict[GGMLType, Callable[[np.ndarray, int], dict[str, torch.Tensor]]] = {
    GGMLType.Q4_K: _pack_q4_k,
    GGMLType.Q6_K: _pack_q6_k,
    GGMLType.Q8_0: _pack_q8_0,
    GGMLType.Q5_K: _pack_q5_k,
    GGMLType.Q4_0: _pack_q4_0,
    GGMLType.Q4_1: _pack_q4_1,
    GGMLType.Q5_0: _pack_q5_0,
    GGMLType.Q5_1: _pack_q5_1,
    GGMLType.Q3_K: _pack_q3_k,
    GGMLType.Q2_K: _pack_q2_k,
    GGMLType.TQ1_0: _as_q8_0(GGMLType.TQ1_0),
    GGMLType.TQ2_0: _as_q8_0(GGMLType.TQ2_0),
    GGMLType.IQ4_NL: _as_q8_0(GGMLType.IQ4_NL),
    GGMLType.IQ4_XS: _as_q8_0(GGMLType.IQ4_XS, np.float32),
    GGMLType.MXFP4: _as_q8_0(GGMLType.MXFP4, np.float32),
    **{t: _as_q8_0(t, np.float32) for t in (GGMLType.IQ2_XXS, GGMLType.IQ3_XXS, GGMLType.IQ3_S,
                                            GGMLType.IQ1_S)},
    # a float32 scale per 16 elements (d [n, k/16]: the kernels' SCALE16)
    **{t: _as_q8_0(t, np.float32) for t in (GGMLType.IQ2_XS, GGMLType.IQ2_S, GGMLType.IQ1_M)},
}
# formats packed in another format's layout (same values): the kernels see that format
KERNEL_TYPE: dict[GGMLType, GGMLType] = {
    GGMLType.Q3_K: GGMLType.Q6_K,
    GGMLType.TQ1_0: GGMLType.Q8_0,
    GGMLType.TQ2_0: GGMLType.Q8_0,
    GGMLType.IQ4_NL: GGMLType.Q8_0,
    GGMLType.IQ4_XS: GGMLType.Q8_0,
    GGMLType.MXFP4: GGMLType.Q8_0,
    GGMLType.IQ2_XXS: GGMLType.Q8_0,
    GGMLType.IQ3_XXS: GGMLType.Q8_0,
    GGMLType.IQ3_S: GGMLType.Q8_0,
    GGMLType.IQ1_S: GGMLType.Q8_0,
    GGMLType.IQ2_XS: GGMLType.Q8_0,
    GGMLType.IQ2_S: GGMLType.Q8_0,
    GGMLType.IQ1_M: GGMLType.Q8_0,
}

PACKED_TYPES: tuple[GGMLType, ...] = tuple(_PACKERS)


def pack(blocks: np.ndarray, ggml_type: GGMLType | int, name: str = "?") -> PackedWeight:
    """Raw GGUF bytes of a matrix, uint8 ``[n, row_bytes]``, -> its GPU layout (CPU tensors).

    ``row_bytes`` must be a whole number of blocks; ``k = row_bytes / type_size * block_size``.
    """
    try:
        t = GGMLType(ggml_type)
    except ValueError:
        raise ValueError(f"pack {name!r}: unknown GGML type {int(ggml_type)}") from None
    if t not in _PACKERS:
        have = ", ".join(x.name for x in PACKED_TYPES)
        raise ValueError(f"pack {name!r}: no GPU layout for {t.name} (have {have})")
    blocks = np.asarray(blocks)
    if blocks.dtype != np.uint8 or blocks.ndim != 2:
        raise ValueError(
            f"pack {name!r}: want uint8 [rows, row_bytes], got {blocks.dtype} {blocks.shape}"
        )
    block_size, type_size = GGML_BLOCK[t]
    rows, row_bytes = blocks.shape
    if row_bytes == 0 or row_bytes % type_size:
        raise ValueError(
            f"pack {name!r} ({t.name}): row of {row_bytes} bytes is not a whole number of "
            f"{type_size}-byte blocks"
        )
    k = row_bytes // type_size * block_size
    flat = np.ascontiguousarray(blocks).reshape(-1, type_size)
    return PackedWeight(KERNEL_TYPE.get(t, t), rows, k, _PACKERS[t](flat, rows))
