"""The validated, memory-mapped GGUF reader.

File layout (GGUF v2/v3, little-endian; v1 used u32 counts and is not supported):

    magic "GGUF" | version u32 | n_tensors u64 | n_kv u64
    n_kv      x  key: string | value_type u32 | value
    n_tensors x  name: string | n_dims u32 | dims u64[n_dims] (ne0 first) | ggml_type u32
                 | offset u64
    padding to `alignment` (metadata `general.alignment`, default 32)
    data section: tensor `offset`s are relative to its start and multiples of `alignment`

    string = len u64 | bytes[len] (UTF-8, not NUL-terminated)
    array  = item_type u32 | count u64 | items (no per-item type; nested arrays repeat this header)

Everything is validated in ``GGUFFile.__init__`` (bounds-checked reads and value decoding live
in ``cursor.py``); after that the tensor byte ranges are known to
be inside the file, aligned and disjoint. Before any allocation whose size comes from the file
(a count, a length), the reader checks that the smallest possible encoding of that many items
still fits in the bytes left, so a forged count is an error, never a huge allocation.

String values (not keys) are decoded as UTF-8 with ``errors="surrogateescape"``: invalid bytes
survive as lone surrogates, so ``s.encode("utf-8", "surrogateescape")`` gives back the exact file
bytes (tokenizer vocabularies are byte sequences; a lossy decode would corrupt them). Keys and
tensor names must be valid, non-empty UTF-8.

Numeric arrays are read-only numpy views into the map (zero-copy). They, and the arrays from
``tensor_bytes``, keep the mapping alive: ``close()`` drops the reader's reference and the map
is unmapped once the last such view is gone.
"""

from __future__ import annotations

import mmap
import os
from typing import Any, NamedTuple

import numpy as np

from .constants import (
    GGML_BLOCK,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGUF_SUPPORTED_VERSIONS,
    GGMLType,
    GGUFValueType,
)
from .cursor import CORRUPT, U32, Cursor
from .errors import GGUFError

# Smallest encodings, used to reject counts that cannot fit in the rest of the file.
_MIN_KV_BYTES = 8 + 1 + 4 + 1  # key len, 1-byte key, value type, 1-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8  # name len, 1-byte name, n_dims, 1 dim, type, offset
_MAX_DIMS = 4  # GGML_MAX_DIMS
_INT64_MAX = 2**63 - 1
_INT_TYPES = frozenset(
    {
        GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
        GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64,
    }
)


class TensorInfo(NamedTuple):
    name: str
    ggml_type: GGMLType
    dims: tuple[int, ...]  # ggml order: ne0 (the contiguous row length) first
    shape: tuple[int, ...]  # numpy order: reversed dims
    n_elements: int
    offset: int  # absolute byte offset in the file
    nbytes: int


_MISSING: Any = object()


class GGUFFile:
    """A GGUF file, opened, memory-mapped and fully validated (see the module docstring)."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        self._mm: mmap.mmap | None = None
        try:
            with open(self.path, "rb") as fh:
                self.file_size = os.fstat(fh.fileno()).st_size
                if self.file_size == 0:
                    raise GGUFError(self.path, "empty file (0 bytes), not a GGUF file")
                # The map keeps its own handle to the file; ours closes with the `with`.
                self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise GGUFError(self.path, f"cannot open: {e.strerror or e}") from None
        try:
            self._parse(Cursor(self.path, self._mm, self.file_size))
        except BaseException:
            self.close()
            raise

    # -- parsing ---------------------------------------------------------------------------

    def _parse(self, p: Cursor) -> None:
        magic = bytes(p.buf[:4])
        if magic != GGUF_MAGIC:
            if len(magic) < 4 and GGUF_MAGIC.startswith(magic):
                raise p.fail(f"truncated file: only {len(magic)} bytes, the magic needs 4")
            raise p.fail(f"not a GGUF file: magic is {magic!r}, expected {GGUF_MAGIC!r}", 0)
        p.pos = 4
        version = p.u32("version")
        if version not in GGUF_SUPPORTED_VERSIONS:
            if version & 0xFFFF == 0 and (version >> 24) in GGUF_SUPPORTED_VERSIONS:
                raise p.fail(f"big-endian GGUF (version {version >> 24}) is not supported", 4)
            raise p.fail(
                f"unsupported GGUF version {version} (supported: "
                f"{', '.join(map(str, GGUF_SUPPORTED_VERSIONS))})", 4
            )
        self.version = version
        n_tensors = p.u64("tensor count")
        n_kv = p.u64("metadata key/value count")
        left = p.size - p.pos
        if n_kv > left // _MIN_KV_BYTES:
            raise p.fail(f"metadata count {n_kv} cannot fit in the {left} bytes left{CORRUPT}", 16)
        if n_tensors > left // _MIN_TENSOR_INFO_BYTES:
            raise p.fail(
                f"tensor count {n_tensors} cannot fit in the {left} bytes left{CORRUPT}", 8
            )
        if n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES > left:
            raise p.fail(
                f"{n_kv} metadata entries and {n_tensors} tensor infos cannot fit "
                f"in the {left} bytes left{CORRUPT}", 8
            )
        self._parse_metadata(p, n_kv)
        self.alignment = self._alignment()
        infos = self._parse_tensor_infos(p, n_tensors)
        self.data_offset = -(-p.pos // self.alignment) * self.alignment
        self.tensors = self._place_tensors(p, infos)

    def _parse_metadata(self, p: Cursor, n_kv: int) -> None:
        self.metadata: dict[str, Any] = {}
        # (value type,) for scalars, (ARRAY, item type) for arrays; the metadata values lose
        # the width of integers, and inspect/config code sometimes wants it.
        self.value_types: dict[str, tuple[GGUFValueType, ...]] = {}
        for i in range(n_kv):
            key_at = p.pos
            key = p.name(f"metadata key #{i}")
            if key in self.metadata:
                raise p.fail(f"duplicate metadata key '{key}'", key_at)
            vtype = p.value_type(f"value type of metadata key '{key}'")
            value_at = p.pos
            self.metadata[key] = p.value(vtype, f"value of metadata key '{key}'")
            if vtype == GGUFValueType.ARRAY:  # the item type was validated by p.value
                item = GGUFValueType(U32.unpack_from(p.buf, value_at)[0])
                self.value_types[key] = (vtype, item)
            else:
                self.value_types[key] = (vtype,)

    def _alignment(self) -> int:
        if "general.alignment" not in self.metadata:
            return GGUF_DEFAULT_ALIGNMENT
        a = self.metadata["general.alignment"]
        if self.value_types["general.alignment"][0] not in _INT_TYPES:
            raise GGUFError(self.path, f"general.alignment must be an integer, got {a!r}")
        if a <= 0 or a & (a - 1):
            raise GGUFError(self.path, f"general.alignment is {a}, not a nonzero power of two")
        return a

    def _parse_tensor_infos(self, p: Cursor, n_tensors: int) -> list[tuple]:
        infos: list[tuple] = []
        seen: set[str] = set()
        for i in range(n_tensors):
            at = p.pos
            name = p.name(f"name of tensor #{i}")
            if name in seen:
                raise p.fail(f"duplicate tensor name '{name}'", at)
            seen.add(name)
            what = f"tensor '{name}'"
            n_dims_at = p.pos
            n_dims = p.u32(f"dimension count of {what}")
            if not 1 <= n_dims <= _MAX_DIMS:
                raise p.fail(f"{what} has {n_dims} dimensions (must be 1..{_MAX_DIMS})", n_dims_at)
            dims_at = p.pos
            dims = tuple(p.u64(f"dimension {d} of {what}") for d in range(n_dims))
            n_elements = 1
            for d, ne in enumerate(dims):
                if ne == 0 or ne > _INT64_MAX:
                    shown = ne if ne == 0 else ne - 2**64
                    raise p.fail(f"{what} has dimension {d} = {shown} (must be positive)", dims_at)
                n_elements *= ne
            if n_elements > _INT64_MAX:
                raise p.fail(f"{what}: element count of dims {list(dims)} overflows int64", dims_at)
            type_at = p.pos
            t = p.u32(f"type of {what}")
            try:
                ggml_type = GGMLType(t)
            except ValueError:
                raise p.fail(f"{what} has unknown GGML type {t}", type_at) from None
            block, type_size = GGML_BLOCK[ggml_type]
            # ggml requires whole blocks per row, which implies n_elements % block == 0.
            if dims[0] % block:
                raise p.fail(
                    f"{what} of type {ggml_type.name}: row length {dims[0]} (dims {list(dims)}) "
                    f"is not a multiple of the block size {block}", dims_at
                )
            off_at = p.pos
            rel = p.u64(f"data offset of {what}")
            nbytes = n_elements // block * type_size
            infos.append((name, ggml_type, dims, n_elements, rel, nbytes, off_at))
        return infos

    def _place_tensors(self, p: Cursor, infos: list[tuple]) -> dict[str, TensorInfo]:
        tensors: dict[str, TensorInfo] = {}
        for name, ggml_type, dims, n_elements, rel, nbytes, off_at in infos:
            if rel % self.alignment:
                raise p.fail(
                    f"tensor '{name}' has data offset {rel}, "
                    f"not a multiple of the alignment {self.alignment}", off_at
                )
            start = self.data_offset + rel
            if start + nbytes > p.size:
                raise p.fail(
                    f"tensor '{name}' data (bytes {start}..{start + nbytes}) runs past the end "
                    f"of the file ({p.size} bytes)", off_at
                )
            tensors[name] = TensorInfo(
                name, ggml_type, dims, dims[::-1], n_elements, start, nbytes
            )
        ordered = sorted(tensors.values(), key=lambda t: t.offset)
        for a, b in zip(ordered, ordered[1:]):
            if a.offset + a.nbytes > b.offset:
                raise p.fail(
                    f"tensor '{a.name}' (bytes {a.offset}..{a.offset + a.nbytes}) overlaps "
                    f"tensor '{b.name}' (starting at byte {b.offset})"
                )
        return tensors

    # -- access ----------------------------------------------------------------------------

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The raw bytes of tensor ``name``: a read-only uint8 view into the map (zero-copy)."""
        info = self.tensors.get(name)
        if info is None:
            raise GGUFError(self.path, f"no tensor named '{name}'")
        if self._mm is None:
            raise GGUFError(self.path, "file is closed")
        arr = np.frombuffer(self._mm, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        arr.flags.writeable = False
        return arr

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def _typed(self, key: str, default: Any, kind: str, ok) -> Any:
        if key not in self.metadata:
            if default is _MISSING:
                raise GGUFError(self.path, f"missing metadata key '{key}' ({kind})")
            return default
        value = self.metadata[key]
        if not ok(value):
            types = "/".join(t.name for t in self.value_types[key])
            raise GGUFError(self.path, f"metadata key '{key}' is {types}, expected {kind}")
        return value

    def get_int(self, key: str, default: Any = _MISSING) -> int:
        return self._typed(key, default, "an integer", lambda v: type(v) is int)

    def get_float(self, key: str, default: Any = _MISSING) -> float:
        v = self._typed(key, default, "a number", lambda v: type(v) in (int, float))
        return float(v) if type(v) is int else v

    def get_bool(self, key: str, default: Any = _MISSING) -> bool:
        return self._typed(key, default, "a bool", lambda v: type(v) is bool)

    def get_str(self, key: str, default: Any = _MISSING) -> str:
        return self._typed(key, default, "a string", lambda v: type(v) is str)

    def get_str_list(self, key: str, default: Any = _MISSING) -> list[str]:
        def ok(v: Any) -> bool:
            return type(v) is list and all(type(s) is str for s in v)

        return self._typed(key, default, "an array of strings", ok)

    def get_array(self, key: str, default: Any = _MISSING) -> np.ndarray:
        """A numeric array (read-only numpy view)."""
        return self._typed(key, default, "a numeric array", lambda v: isinstance(v, np.ndarray))

    # -- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # numpy views still use the map; it is unmapped when the last one goes

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._mm is None else f"{len(self.tensors)} tensors"
        return f"GGUFFile({self.path!r}, v{getattr(self, 'version', '?')}, {state})"
