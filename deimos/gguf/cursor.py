"""A bounds-checked forward cursor over the mapped file, and the GGUF value decoders.

Every read checks the bytes left first; every count or length read from the file is checked
against the bytes left (using the smallest possible encoding of one item) before anything is
allocated for it. Problems are raised as GGUFError naming the file, what was being read and the
byte offset.

String values are decoded as UTF-8 with ``errors="surrogateescape"`` (lossless: the exact file
bytes come back with ``s.encode("utf-8", "surrogateescape")``); names (keys, tensor names) must
be non-empty, strictly valid UTF-8.
"""

from __future__ import annotations

import mmap
import struct
from typing import Any

import numpy as np

from .constants import GGUFValueType
from .errors import GGUFError

U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")

# Fixed-size value types: (struct for a scalar, little-endian numpy dtype for an array).
FIXED: dict[GGUFValueType, tuple[struct.Struct, np.dtype]] = {
    GGUFValueType.UINT8: (struct.Struct("<B"), np.dtype("<u1")),
    GGUFValueType.INT8: (struct.Struct("<b"), np.dtype("<i1")),
    GGUFValueType.UINT16: (struct.Struct("<H"), np.dtype("<u2")),
    GGUFValueType.INT16: (struct.Struct("<h"), np.dtype("<i2")),
    GGUFValueType.UINT32: (struct.Struct("<I"), np.dtype("<u4")),
    GGUFValueType.INT32: (struct.Struct("<i"), np.dtype("<i4")),
    GGUFValueType.FLOAT32: (struct.Struct("<f"), np.dtype("<f4")),
    GGUFValueType.BOOL: (struct.Struct("<B"), np.dtype("?")),
    GGUFValueType.UINT64: (struct.Struct("<Q"), np.dtype("<u8")),
    GGUFValueType.INT64: (struct.Struct("<q"), np.dtype("<i8")),
    GGUFValueType.FLOAT64: (struct.Struct("<d"), np.dtype("<f8")),
}

MIN_ARRAY_BYTES = 4 + 8  # item type, count
MAX_ARRAY_DEPTH = 8  # nesting deeper than this is refused (llama.cpp allows none)
CORRUPT = " (corrupt count or truncated file)"


class Cursor:
    """One pass over the header, metadata and tensor infos; ``pos`` only moves forward."""

    def __init__(self, path: str, buf: mmap.mmap, size: int):
        self.path, self.buf, self.size, self.pos = path, buf, size, 0

    def fail(self, problem: str, offset: int | None = None) -> GGUFError:
        return GGUFError(self.path, problem, offset)

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(
                f"truncated file: {what} needs {n} bytes at byte {self.pos}, "
                f"but the file ends at byte {self.size}"
            )

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def raw_string(self, what: str) -> bytes:
        start = self.pos
        n = self.u64(f"length of {what}")
        if n > self.size - self.pos:
            raise self.fail(
                f"{what} has length {n}, past the end of the file ({self.size} bytes)", start
            )
        data = self.buf[self.pos : self.pos + n]
        self.pos += n
        return data

    def name(self, what: str) -> str:
        """A key or tensor name: non-empty, strict UTF-8."""
        start = self.pos
        data = self.raw_string(what)
        if not data:
            raise self.fail(f"{what} is empty", start)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8: {data[:64]!r}", start) from None

    def value_type(self, what: str) -> GGUFValueType:
        start = self.pos
        t = self.u32(what)
        try:
            return GGUFValueType(t)
        except ValueError:
            raise self.fail(f"{what} is {t}, not a known GGUF value type", start) from None

    def value(self, vtype: GGUFValueType, what: str, depth: int = 0) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.raw_string(what).decode("utf-8", "surrogateescape")
        if vtype == GGUFValueType.ARRAY:
            return self.array(what, depth)
        st, _ = FIXED[vtype]
        start = self.pos
        self.need(st.size, what)
        (v,) = st.unpack_from(self.buf, self.pos)
        self.pos += st.size
        if vtype == GGUFValueType.BOOL:
            if v > 1:
                raise self.fail(f"{what} is a bool stored as {v} (must be 0 or 1)", start)
            return bool(v)
        return v

    def array(self, what: str, depth: int) -> Any:
        if depth >= MAX_ARRAY_DEPTH:
            raise self.fail(f"{what} nests arrays deeper than {MAX_ARRAY_DEPTH}", self.pos)
        item_type = self.value_type(f"item type of {what}")
        count_at = self.pos
        count = self.u64(f"length of {what}")
        left = self.size - self.pos
        if item_type in FIXED:
            _, dtype = FIXED[item_type]
            if count > left // dtype.itemsize:
                raise self.fail(
                    f"{what} claims {count} items of {item_type.name} "
                    f"({count * dtype.itemsize} bytes), past the end of the file{CORRUPT}",
                    count_at,
                )
            return self.fixed_array(dtype, count, what)
        min_item = 8 if item_type == GGUFValueType.STRING else MIN_ARRAY_BYTES
        if count > left // min_item:
            raise self.fail(
                f"{what} claims {count} items of {item_type.name}, "
                f"more than fit in the {left} bytes left{CORRUPT}", count_at
            )
        if item_type == GGUFValueType.STRING:
            return self.string_array(count, what)
        return [self.array(f"{what}[{i}]", depth + 1) for i in range(count)]

    def fixed_array(self, dtype: np.dtype, count: int, what: str) -> np.ndarray:
        start, nbytes = self.pos, count * dtype.itemsize
        if count == 0:
            arr = np.empty(0, dtype)
        else:
            arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=start)
            if dtype == np.bool_ and int(arr.view(np.uint8).max()) > 1:
                raise self.fail(f"{what} holds a bool that is not 0 or 1", start)
        arr.flags.writeable = False
        self.pos += nbytes
        return arr

    def string_array(self, count: int, what: str) -> list[str]:
        # The hot loop of a vocabulary (100k+ strings): locals only, one bounds check per item.
        buf, size, pos = self.buf, self.size, self.pos
        unpack = U64.unpack_from
        out: list[str] = []
        append = out.append
        for i in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.need(8, f"length of {what}[{i}]")
            (n,) = unpack(buf, pos)
            pos += 8
            end = pos + n
            if end > size:
                raise self.fail(
                    f"{what}[{i}] has length {n}, past the end of the file ({size} bytes)", pos - 8
                )
            append(buf[pos:end].decode("utf-8", "surrogateescape"))
            pos = end
        self.pos = pos
        return out
