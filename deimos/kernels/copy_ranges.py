"""The reference of the batched byte-range copy (deimos.kernels.triton.copy_ranges): each
descriptor (source address, destination address, bytes) copied with ``ctypes.memmove``, in
order. Addresses are process addresses (host memory here; the kernel also takes device and
pinned host addresses, which the device reads over PCIe)."""

from __future__ import annotations

import ctypes

import numpy as np


def check_ranges(desc: np.ndarray) -> np.ndarray:
    """``desc`` as int64 [n, 3] (src, dst, nbytes), each count >= 0; a clear error otherwise."""
    d = np.asarray(desc)
    if d.ndim != 2 or d.shape[1] != 3 or d.dtype != np.int64:
        raise ValueError(f"copy ranges: want int64 [n, 3] (src, dst, nbytes), got {d.dtype} {d.shape}")
    if d.size and (d[:, 2] < 0).any():
        raise ValueError("copy ranges: a negative byte count")
    return d


def range_words(desc: np.ndarray) -> np.ndarray:
    """Each range's widest word (8, 4, 2 or 1): its addresses' and length's common alignment
    (the trailing zero bits of their bitwise or)."""
    d = check_ranges(desc)
    low = np.bitwise_or.reduce(d, axis=1) if d.size else np.zeros(0, np.int64)
    return np.select([low % 8 == 0, low % 4 == 0, low % 2 == 0], [8, 4, 2], 1)


def range_word(desc: np.ndarray) -> int:
    """The widest word (8, 4, 2 or 1 bytes) that every address and length of ``desc`` is a
    multiple of: one launch's load width (8 for no range)."""
    words = range_words(desc)
    return int(words.min()) if words.size else 8


def by_word(desc: np.ndarray) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """``desc`` reordered so that ranges of one word size are together, widest first, and the
    groups as (word, start, stop) rows of it: one launch each, so one odd range does not
    narrow every other range's loads."""
    words = range_words(desc)
    order = np.argsort(-words, kind="stable")
    d, w = check_ranges(desc)[order], words[order]
    groups = []
    for word in (8, 4, 2, 1):
        at = np.flatnonzero(w == word)
        if at.size:
            groups.append((word, int(at[0]), int(at[-1]) + 1))
    return d, groups


def copy_ranges_reference(desc: np.ndarray) -> None:
    for src, dst, n in check_ranges(desc).tolist():
        if n:
            ctypes.memmove(dst, src, n)
