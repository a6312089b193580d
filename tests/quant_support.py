"""Oracles for the quant tests (support module, no tests of its own).

* ``ggml_to_float``: ggml's own C ``dequantize_row_*``, called through ctypes from llama.cpp's
  libggml-base.so (testdata.llama_cpu_lib).
* ``gguf_dequantize``: the ``gguf`` package's numpy decoders (tested bit for bit against ggml by
  its authors); ``None`` for types it does not implement.
* Scalar references transcribed line by line from ggml-quants.c for the types gguf lacks.
* ``c_table``: a table parsed straight out of ggml-common.h.
"""

from __future__ import annotations

import ctypes
import re
from functools import cache

import numpy as np
from testdata import llama_cpp_path, llama_cpu_lib

from deimos.gguf.constants import GGMLType

# ---- ggml C library ------------------------------------------------------------------------------


class _TypeTraits(ctypes.Structure):
    # struct ggml_type_traits in ggml.h
    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
    ]


_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


@cache
def _libggml() -> ctypes.CDLL:
    path = llama_cpu_lib("libggml-base.so")
    lib = ctypes.CDLL(str(path))
    lib.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    return lib


def ggml_traits(t: GGMLType) -> _TypeTraits:
    return _libggml().ggml_get_type_traits(int(t)).contents


def ggml_to_float(t: GGMLType, blocks: np.ndarray) -> np.ndarray | None:
    """ggml's to_float on ``[n, type_size]`` blocks -> float32 ``[n, block_size]``.

    None if ggml has no to_float for the type."""
    tr = ggml_traits(t)
    if not tr.to_float:
        return None
    blocks = np.ascontiguousarray(blocks, dtype=np.uint8)
    n = blocks.shape[0]
    out = np.full((n, tr.blck_size), np.nan, dtype=np.float32)  # poison: unwritten shows
    _TO_FLOAT(tr.to_float)(blocks.ctypes.data, out.ctypes.data, n * tr.blck_size)
    return out


def gguf_dequantize(t: GGMLType, blocks: np.ndarray) -> np.ndarray | None:
    import gguf

    try:
        qt = gguf.GGMLQuantizationType(int(t))
        r = gguf.quants.dequantize(np.ascontiguousarray(blocks).reshape(-1), qt)
    except NotImplementedError:
        return None
    return np.asarray(r, dtype=np.float32).reshape(blocks.shape[0], -1)


# ---- scalar references, transcribed from ggml-quants.c ------------------------------------------


def ref_q8_K(blocks: np.ndarray) -> np.ndarray:
    """dequantize_row_q8_K: y = x.d * x.qs[j] (float * int8 in float32)."""
    out = np.empty((blocks.shape[0], 256), dtype=np.float32)
    for i, blk in enumerate(blocks):
        d = np.frombuffer(blk[0:4].tobytes(), dtype="<f4")[0]
        qs = np.frombuffer(blk[4:260].tobytes(), dtype=np.int8)
        for j in range(256):
            out[i, j] = d * np.float32(qs[j])
    return out


def ref_q4_K(blocks: np.ndarray) -> np.ndarray:
    """dequantize_row_q4_K with get_scale_min_k4, one element at a time."""

    def scale_min(j: int, q: np.ndarray) -> tuple[int, int]:
        if j < 4:
            return int(q[j]) & 63, int(q[j + 4]) & 63
        return (int(q[j + 4]) & 0xF) | ((int(q[j - 4]) >> 6) << 4), (int(q[j + 4]) >> 4) | (
            (int(q[j]) >> 6) << 4
        )

    out = np.empty((blocks.shape[0], 256), dtype=np.float32)
    for i, blk in enumerate(blocks):
        d = np.float32(np.frombuffer(blk[0:2].tobytes(), dtype="<f2")[0])
        dmin = np.float32(np.frombuffer(blk[2:4].tobytes(), dtype="<f2")[0])
        scales, q = blk[4:16], blk[16:144]
        y, is_, qo = 0, 0, 0
        for _ in range(0, 256, 64):
            sc, m = scale_min(is_ + 0, scales)
            d1, m1 = d * np.float32(sc), dmin * np.float32(m)
            sc, m = scale_min(is_ + 1, scales)
            d2, m2 = d * np.float32(sc), dmin * np.float32(m)
            for l in range(32):
                out[i, y] = d1 * np.float32(int(q[qo + l]) & 0xF) - m1
                y += 1
            for l in range(32):
                out[i, y] = d2 * np.float32(int(q[qo + l]) >> 4) - m2
                y += 1
            qo += 32
            is_ += 2
    return out


def ref_iq1_m(blocks: np.ndarray, iq1s_grid: np.ndarray) -> np.ndarray:
    """dequantize_row_iq1_m (the one format whose f16 scale is split across four fields)."""
    out = np.empty((blocks.shape[0], 256), dtype=np.float32)
    delta_c = np.float32(0.125)
    for i, blk in enumerate(blocks):
        sc = np.frombuffer(blk[48:56].tobytes(), dtype="<u2").astype(int)
        u16 = (sc[0] >> 12) | ((sc[1] >> 8) & 0x00F0) | ((sc[2] >> 4) & 0x0F00) | (sc[3] & 0xF000)
        d = np.float32(np.array([u16], dtype="<u2").view("<f2")[0])
        qs, qh = blk[0:32].astype(int), blk[32:48].astype(int)
        y = 0
        for ib in range(8):
            dl1 = d * np.float32(2 * ((sc[ib // 2] >> (6 * (ib % 2) + 0)) & 0x7) + 1)
            dl2 = d * np.float32(2 * ((sc[ib // 2] >> (6 * (ib % 2) + 3)) & 0x7) + 1)
            q, h = qs[4 * ib : 4 * ib + 4], qh[2 * ib : 2 * ib + 2]
            idx = [
                q[0] | ((h[0] << 8) & 0x700),
                q[1] | ((h[0] << 4) & 0x700),
                q[2] | ((h[1] << 8) & 0x700),
                q[3] | ((h[1] << 4) & 0x700),
            ]
            delta = [
                -delta_c if h[0] & 0x08 else delta_c,
                -delta_c if h[0] & 0x80 else delta_c,
                -delta_c if h[1] & 0x08 else delta_c,
                -delta_c if h[1] & 0x80 else delta_c,
            ]
            for l in range(4):
                dl = dl1 if l < 2 else dl2
                for j in range(8):
                    out[i, y] = dl * (np.float32(iq1s_grid[idx[l], j]) + delta[l])
                    y += 1
    return out


# ---- ggml-common.h tables -----------------------------------------------------------------------


@cache
def _common_h() -> str:
    return llama_cpp_path("ggml/src/ggml-common.h").read_text()


def c_table(name: str) -> tuple[str, list[int]]:
    """(C element type, values) of ``GGML_TABLE_BEGIN(type, name, size) ... GGML_TABLE_END()``."""
    m = re.search(
        r"GGML_TABLE_BEGIN\((\w+), %s, (\w+)\)(.*?)GGML_TABLE_END\(\)" % re.escape(name),
        _common_h(),
        re.S,
    )
    assert m, f"table {name} not found in ggml-common.h"
    return m.group(1), [int(x, 0) for x in re.findall(r"0x[0-9a-fA-F]+|-?\d+", m.group(3))]


def c_grid(name: str) -> np.ndarray:
    """A lattice grid as its coordinate bytes ``[rows, 8 or 4]`` (little-endian words)."""
    ctype, vals = c_table(name)
    dt, cols = ("<u8", 8) if ctype == "uint64_t" else ("<u4", 4)
    return np.array(vals, dtype=dt).view(np.uint8).reshape(len(vals), cols)
