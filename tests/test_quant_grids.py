"""The i-quant lookup tables in deimos.quant.iq_grids equal those of ggml-common.h.

Run as a script to print the compact encoding of the grids (to regenerate iq_grids.py):
``python tests/test_quant_grids.py``.
"""

from __future__ import annotations

import base64
import textwrap

import numpy as np
import pytest
from quant_support import c_grid, c_table

from deimos.quant import iq_grids
from deimos.quant.mxfp4 import KVALUES_MXFP4

GRIDS = {
    "iq2xxs_grid": ("IQ2XXS_GRID", (0x08, 0x19, 0x2B), 2),
    "iq2xs_grid": ("IQ2XS_GRID", (0x08, 0x19, 0x2B), 2),
    "iq2s_grid": ("IQ2S_GRID", (0x08, 0x19, 0x2B), 2),
    "iq3xxs_grid": ("IQ3XXS_GRID", (0x04, 0x0C, 0x14, 0x1C, 0x24, 0x2C, 0x34, 0x3E), 4),
    "iq3s_grid": ("IQ3S_GRID", (1, 3, 5, 7, 9, 11, 13, 15), 4),
    "iq1s_grid": ("IQ1S_GRID", (-1, 0, 1), 2),
}


@pytest.mark.parametrize("c_name", list(GRIDS))
def test_grid_matches_ggml_common_h(c_name: str) -> None:
    ours = getattr(iq_grids, GRIDS[c_name][0])
    want = c_grid(c_name)
    if ours.dtype == np.int8:
        want = want.view(np.int8)
    assert ours.shape == want.shape
    assert np.array_equal(ours, want)
    assert not ours.flags.writeable


@pytest.mark.parametrize(
    ("c_name", "ours"),
    [
        ("ksigns_iq2xs", iq_grids.KSIGNS_IQ2XS),
        ("kmask_iq2xs", iq_grids.KMASK_IQ2XS),
        ("kvalues_iq4nl", iq_grids.KVALUES_IQ4NL),
        ("kvalues_fp4", KVALUES_MXFP4),
    ],
)
def test_small_tables_match_ggml_common_h(c_name: str, ours: np.ndarray) -> None:
    _, vals = c_table(c_name)
    assert ours.tolist() == vals


def encode_grid(c_name: str) -> str:
    """The ``_Grid(...)`` source for one grid of ggml-common.h (see iq_grids.py)."""
    _, values, bits = GRIDS[c_name]
    raw = c_grid(c_name)
    elems = raw.view(np.int8) if min(values) < 0 else raw
    lut = np.zeros(256, dtype=np.uint8)
    lut[np.array(values, dtype=elems.dtype).view(np.uint8)] = np.arange(len(values))
    idx = lut[elems.view(np.uint8).reshape(-1)].reshape(-1, 8 // bits)
    packed = np.zeros(idx.shape[0], dtype=np.uint8)
    for k in range(idx.shape[1]):
        packed |= idx[:, k] << (bits * k)
    lines = textwrap.wrap(base64.b64encode(packed.tobytes()).decode(), 88)
    body = "\n".join(f'        "{line}"' for line in lines)
    rows, cols = raw.shape
    head = f"_{c_name.upper()} = _Grid(\n    {rows}, {cols}, {values!r}, {bits},\n"
    return head + f"    (\n{body}\n    ),\n)\n"


def test_encoding_round_trips() -> None:
    """The encoder reproduces the stored data exactly (so regenerating is a no-op)."""
    src = open(iq_grids.__file__).read()
    for c_name in GRIDS:
        assert encode_grid(c_name) in src, c_name


if __name__ == "__main__":
    print("\n".join(encode_grid(c) for c in GRIDS))
