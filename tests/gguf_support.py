"""Test support for the GGUF reader: a byte-level GGUF builder and a field walker.

The builder writes GGUF bytes by hand (independently of deimos.gguf and of gguf-py) so tests
can construct precisely one defect. The walker lists the offset of every integer field of a
*valid* file so the fuzz test can overwrite counts and lengths with absurd values.
"""

from __future__ import annotations

import struct

# GGUF value types and GGML tensor types by number, spelled out so the builder does not
# depend on the code under test.
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = (
    range(13)
)
FIXED_SIZE = {UINT8: 1, INT8: 1, UINT16: 2, INT16: 2, UINT32: 4, INT32: 4, FLOAT32: 4, BOOL: 1,
              UINT64: 8, INT64: 8, FLOAT64: 8}
T_F32, T_F16, T_Q8_0 = 0, 1, 8


# -- byte-level builder ----------------------------------------------------------------------

def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def gstr(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return u64(len(b)) + b


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    """One metadata entry; ``payload`` is the encoded value (see the helpers below)."""
    return gstr(key) + u32(vtype) + payload


def kv_u32(key: str, v: int) -> bytes:
    return kv(key, UINT32, u32(v))


def kv_str(key: str, v: str | bytes) -> bytes:
    return kv(key, STRING, gstr(v))


def arr(item_type: int, items: list[bytes], count: int | None = None) -> bytes:
    return u32(item_type) + u64(len(items) if count is None else count) + b"".join(items)


def tinfo(name: str | bytes, dims: list[int], ggml_type: int, offset: int) -> bytes:
    encoded_dims = b"".join(u64(d) for d in dims)
    return gstr(name) + u32(len(dims)) + encoded_dims + u32(ggml_type) + u64(offset)


def pad(n: int, align: int) -> int:
    return -(-n // align) * align


def build(kvs: list[bytes], tinfos: list[bytes], data: bytes = b"", *, version: int = 3,
          alignment: int = 32, n_kv: int | None = None, n_tensors: int | None = None,
          magic: bytes = b"GGUF") -> bytes:
    head = magic + u32(version)
    head += u64(len(tinfos) if n_tensors is None else n_tensors)
    head += u64(len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(tinfos)
    return body + b"\0" * (pad(len(body), alignment) - len(body)) + data


# -- field walker ----------------------------------------------------------------------------

def int_fields(buf: bytes) -> list[tuple[int, int, str]]:
    """(offset, size in bytes, label) of every integer field of a valid little-endian GGUF file:
    header counts, string lengths, value types, array item types and counts, tensor n_dims,
    dims, types and offsets."""
    out: list[tuple[int, int, str]] = []
    pos = 0

    def take(size: int, label: str) -> int:
        nonlocal pos
        out.append((pos, size, label))
        v = int.from_bytes(buf[pos : pos + size], "little")
        pos += size
        return v

    def string(label: str) -> None:
        nonlocal pos
        n = take(8, f"len {label}")
        pos += n

    def value(vt: int, label: str) -> None:
        nonlocal pos
        if vt == STRING:
            string(label)
        elif vt == ARRAY:
            it = take(4, f"item type {label}")
            n = take(8, f"count {label}")
            for i in range(n):
                value(it, f"{label}[{i}]")
        else:
            pos += FIXED_SIZE[vt]

    pos = 8
    n_t = take(8, "tensor count")
    n_kv = take(8, "kv count")
    for i in range(n_kv):
        string(f"key {i}")
        value(take(4, f"vtype {i}"), f"value {i}")
    for i in range(n_t):
        string(f"tensor name {i}")
        nd = take(4, f"n_dims {i}")
        for d in range(nd):
            take(8, f"dim {d} tensor {i}")
        take(4, f"ggml type {i}")
        take(8, f"offset {i}")
    return out
