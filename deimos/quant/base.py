"""The format registry, the public ``dequantize`` and small helpers shared by the format files.

Every format is a stateless ``QuantFormat`` subclass; defining the class registers one instance
under its GGML type. Decoders work on a whole ``[n_blocks, type_size]`` uint8 array at once
(no per-block Python loop) and reproduce ggml's C ``dequantize_row_*`` bit for bit: same
float32 operations in the same order (``d * q - m`` is not ``d * q + (-m)``), no float64
intermediates. numpy promotes ``int32 * float32`` to float64, so integer codes are cast to
float32 explicitly before any multiply (exact: every code fits in 24 bits).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from deimos.gguf.constants import GGML_BLOCK, GGMLType


class QuantError(ValueError):
    """A tensor's bytes cannot be decoded: unknown type, or a size that does not fit the shape."""


_FORMATS: dict[GGMLType, QuantFormat] = {}

# Elements decoded per chunk in ``dequantize``: bounds the temporaries (a few arrays of this many
# float32/int values) and keeps them cache-friendly; 4096x4096 decodes in 16 chunks.
_CHUNK_ELEMENTS = 1 << 20


class QuantFormat:
    """One GGML tensor type: block geometry, vectorized decoder, random valid blocks.

    Subclasses pass ``ggml_type=`` in the class statement; block_size/type_size come from
    ``GGML_BLOCK`` (the single table of block geometry).
    """

    ggml_type: ClassVar[GGMLType]
    block_size: ClassVar[int]
    type_size: ClassVar[int]

    def __init_subclass__(cls, ggml_type: GGMLType | None = None, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if ggml_type is None:  # an abstract helper base, not a format
            return
        if ggml_type in _FORMATS:
            raise TypeError(f"{ggml_type.name} registered twice")
        cls.ggml_type = ggml_type
        cls.block_size, cls.type_size = GGML_BLOCK[ggml_type]
        _FORMATS[ggml_type] = cls()

    @property
    def name(self) -> str:
        return self.ggml_type.name

    def decode_blocks(self, blocks: np.ndarray) -> np.ndarray:
        """uint8 ``[n, type_size]`` -> float32 ``[n, block_size]``."""
        raise NotImplementedError

    def random_blocks(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` valid blocks (uint8 ``[n, type_size]``) of random codes and finite, bounded scales.

        Scales are chosen so that decoded weights are mostly within about +-0.1, a plausible
        magnitude for the weights of a random model.
        """
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<QuantFormat {self.name} block={self.block_size} bytes={self.type_size}>"


def get_format(ggml_type: GGMLType | int, name: str = "?") -> QuantFormat:
    try:
        t = GGMLType(ggml_type)
    except ValueError:
        raise QuantError(f"tensor {name!r}: unknown GGML type {int(ggml_type)}") from None
    fmt = _FORMATS.get(t)
    if fmt is None:
        raise QuantError(f"tensor {name!r}: GGML type {t.name} has no decoder in deimos.quant")
    return fmt


def formats() -> dict[GGMLType, QuantFormat]:
    """All registered formats (a copy)."""
    return dict(_FORMATS)


def dequantize(
    raw: np.ndarray | bytes | memoryview,
    ggml_type: GGMLType | int,
    shape: tuple[int, ...],
    name: str = "?",
) -> np.ndarray:
    """Decode a tensor's bytes to float32 of ``shape`` (numpy order: the last dim is ggml's ne0).

    Rows are contiguous runs of blocks, so the last dim must be a multiple of the block size.
    """
    fmt = get_format(ggml_type, name)
    shape = tuple(int(s) for s in shape)
    where = f"tensor {name!r} ({fmt.name}, shape {shape})"
    if any(s < 0 for s in shape):
        raise QuantError(f"{where}: negative dimension")
    last = shape[-1] if shape else 1
    if last % fmt.block_size:
        raise QuantError(
            f"{where}: last dim {last} is not a multiple of the block size {fmt.block_size}"
        )
    if isinstance(raw, (bytes, bytearray, memoryview)):
        raw = np.frombuffer(raw, dtype=np.uint8)
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raise QuantError(f"{where}: raw bytes must be a uint8 array, got {raw.dtype}")
    n_elements = int(np.prod(shape, dtype=np.int64))
    n_blocks = n_elements // fmt.block_size
    want = n_blocks * fmt.type_size
    if raw.size != want:
        raise QuantError(
            f"{where}: {raw.size} bytes, expected {want} "
            f"({n_blocks} blocks of {fmt.type_size} bytes)"
        )
    blocks = np.ascontiguousarray(raw.reshape(-1)).reshape(n_blocks, fmt.type_size)
    out = np.empty((n_blocks, fmt.block_size), dtype=np.float32)
    step = max(1, _CHUNK_ELEMENTS // fmt.block_size)
    for i in range(0, n_blocks, step):
        out[i : i + step] = fmt.decode_blocks(blocks[i : i + step])
    return out.reshape(shape)


# ---- field readers: little-endian fields at a byte offset of every block ----------------------


def f16_at(blocks: np.ndarray, off: int, count: int = 1) -> np.ndarray:
    """float16 field(s) at ``off`` as float32 ``[n, count]`` (exact widening)."""
    return u16_at(blocks, off, count).view(np.float16).astype(np.float32)


def u16_at(blocks: np.ndarray, off: int, count: int = 1) -> np.ndarray:
    return np.ascontiguousarray(blocks[:, off : off + 2 * count]).view("<u2")


def u32_at(blocks: np.ndarray, off: int, count: int = 1) -> np.ndarray:
    return np.ascontiguousarray(blocks[:, off : off + 4 * count]).view("<u4")


def low_high_nibbles(qs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return qs & 0x0F, qs >> 4


# ---- random block helpers -----------------------------------------------------------------------


def random_bytes(n: int, type_size: int, rng: np.random.Generator) -> np.ndarray:
    """Writable uint8 ``[n, type_size]`` of uniform random bytes (raw 64-bit generator output)."""
    total = n * type_size
    words = rng.bit_generator.random_raw((total + 7) // 8)
    return words.view(np.uint8)[:total].reshape(n, type_size)


def random_f16_bits(
    rng: np.random.Generator, size: tuple[int, ...], lo: float, hi: float
) -> np.ndarray:
    """uint16 bit patterns of float16 values uniform in ``[lo, hi)`` (finite by construction)."""
    v = lo + (hi - lo) * rng.random(size, dtype=np.float32)
    return v.astype(np.float16).view(np.uint16)


def put_u16(blocks: np.ndarray, off: int, values: np.ndarray) -> None:
    """Store uint16 values ``[n, count]`` little-endian at byte ``off`` of every block."""
    v = np.ascontiguousarray(values, dtype="<u2")
    blocks[:, off : off + 2 * v.shape[1]] = v.view(np.uint8).reshape(v.shape[0], -1)


def put_f16_scale(blocks: np.ndarray, off: int, rng: np.random.Generator, typical: float) -> None:
    """A positive f16 scale in ``[typical/2, typical)`` at ``off`` of every block."""
    put_u16(blocks, off, random_f16_bits(rng, (blocks.shape[0], 1), typical / 2, typical))


def as_f32(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32)
