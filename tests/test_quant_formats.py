"""Every format's decoder, bit for bit against ggml's C library, gguf-py and scalar references."""

from __future__ import annotations

import numpy as np
import pytest
from quant_support import (
    c_grid,
    ggml_to_float,
    gguf_dequantize,
    ref_iq1_m,
    ref_q4_K,
    ref_q8_K,
)

from deimos.gguf.constants import GGML_BLOCK, GGMLType
from deimos.quant import formats, get_format

ALL = sorted(formats(), key=lambda t: t.name)
PLAIN_NUMPY = {  # no ggml/gguf decoder: numpy's own conversion is the oracle
    GGMLType.F32: "<f4",
    GGMLType.F64: "<f8",
    GGMLType.I8: "i1",
    GGMLType.I16: "<i2",
    GGMLType.I32: "<i4",
    GGMLType.I64: "<i8",
}

# Byte offsets of the f16 scale fields, from the block structs in ggml-common.h (written out here
# independently of deimos.quant, so a wrong offset there shows up as a mismatch).
F16_FIELDS: dict[GGMLType, tuple[int, ...]] = {
    GGMLType.F16: (0,),
    GGMLType.Q4_0: (0,),
    GGMLType.Q4_1: (0, 2),
    GGMLType.Q5_0: (0,),
    GGMLType.Q5_1: (0, 2),
    GGMLType.Q8_0: (0,),
    GGMLType.Q2_K: (80, 82),
    GGMLType.Q3_K: (108,),
    GGMLType.Q4_K: (0, 2),
    GGMLType.Q5_K: (0, 2),
    GGMLType.Q6_K: (208,),
    GGMLType.IQ2_XXS: (0,),
    GGMLType.IQ2_XS: (0,),
    GGMLType.IQ2_S: (0,),
    GGMLType.IQ3_XXS: (0,),
    GGMLType.IQ3_S: (0,),
    GGMLType.IQ1_S: (0,),
    GGMLType.IQ4_NL: (0,),
    GGMLType.IQ4_XS: (0,),
    GGMLType.TQ1_0: (52,),
    GGMLType.TQ2_0: (64,),
}


def assert_bits_equal(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert got.dtype == np.float32
    g, w = got.view(np.uint32), want.astype(np.float32).view(np.uint32)
    bad = np.argwhere(g != w)
    if bad.size:
        i = tuple(bad[0])
        raise AssertionError(
            f"{what}: {len(bad)} of {g.size} values differ; first at {i}: "
            f"got {got[i]!r}, want {want[i]!r}"
        )


def raw_random_blocks(t: GGMLType, n: int, rng: np.random.Generator) -> np.ndarray:
    """Uniform random bytes, with only the float scale fields made finite (any sign, subnormals)."""
    size = GGML_BLOCK[t][1]
    b = rng.integers(0, 256, (n, size), dtype=np.uint8)

    def finite16(off: int, exp_mask: int, top_bit: int) -> None:
        v = np.ascontiguousarray(b[:, off : off + 2]).view("<u2")
        v = np.where(v & exp_mask == exp_mask, v & ~np.uint16(top_bit), v).astype("<u2")
        b[:, off : off + 2] = v.view(np.uint8)

    for off in F16_FIELDS.get(t, ()):
        finite16(off, 0x7C00, 0x4000)
    if t == GGMLType.BF16:
        finite16(0, 0x7F80, 0x4000)
    if t in (GGMLType.F32, GGMLType.Q8_K):  # f32 at byte 0
        v = np.ascontiguousarray(b[:, 0:4]).view("<u4")
        v = np.where(v & 0x7F800000 == 0x7F800000, v & ~np.uint32(0x40000000), v).astype("<u4")
        b[:, 0:4] = v.view(np.uint8)
    if t == GGMLType.F64:
        b[:, 7] &= 0xBF  # exponent's top bit: never all ones
    if t == GGMLType.IQ1_M:
        # d is assembled from the top nibbles of four u16 fields; its exponent's top bit is
        # bit 14 of the last one (byte 55, bit 6)
        b[:, 55] &= 0xBF
    return b


def oracles(t: GGMLType, blocks: np.ndarray) -> dict[str, np.ndarray]:
    out = {}
    if t in PLAIN_NUMPY:
        out["numpy"] = np.ascontiguousarray(blocks).view(PLAIN_NUMPY[t]).astype(np.float32)
    r = ggml_to_float(t, blocks)
    if r is not None:
        out["ggml C"] = r
    r = gguf_dequantize(t, blocks)
    if r is not None:
        out["gguf-py"] = r
    if t == GGMLType.Q8_K:
        out["scalar ref"] = ref_q8_K(blocks[:48])
    return out


def test_every_block_type_has_a_format() -> None:
    missing = {t.name for t in GGML_BLOCK} - {t.name for t in formats()} - {"Q8_1"}
    assert not missing, f"no decoder for {sorted(missing)}"
    for t, f in formats().items():
        assert (f.block_size, f.type_size) == GGML_BLOCK[t], t.name
        assert get_format(int(t)) is f


@pytest.mark.filterwarnings("ignore:overflow encountered")  # raw f16/f32 scales up to 65504/3e38
@pytest.mark.parametrize("t", ALL, ids=lambda t: t.name)
@pytest.mark.parametrize("source", ["random_blocks", "raw_bytes"])
def test_decode_bit_exact(t: GGMLType, source: str) -> None:
    f = get_format(t)
    rng = np.random.default_rng(int(t) * 7 + len(source))
    n = 1024 if f.block_size > 1 else 8192
    blocks = f.random_blocks(n, rng) if source == "random_blocks" else raw_random_blocks(t, n, rng)
    assert blocks.shape == (n, f.type_size) and blocks.dtype == np.uint8
    got = f.decode_blocks(blocks)
    refs = oracles(t, blocks)
    assert refs, f"no oracle for {t.name}"
    for who, want in refs.items():
        assert_bits_equal(got[: len(want)], want, f"{t.name} {source} vs {who}")


@pytest.mark.parametrize("t", [t for t in ALL if t not in PLAIN_NUMPY or t == GGMLType.F32],
                         ids=lambda t: t.name)
def test_random_blocks_are_sane(t: GGMLType) -> None:
    """Finite, bounded, not degenerate: what a random-weight model needs."""
    f = get_format(t)
    y = f.decode_blocks(f.random_blocks(4096 // f.block_size * 16, np.random.default_rng(3)))
    assert np.isfinite(y).all()
    assert np.abs(y).max() < 0.5, f"{t.name}: max |w| {np.abs(y).max()}"
    assert 0.005 < y.std() < 0.2, f"{t.name}: std {y.std()}"
    assert abs(y.mean()) < 0.03, f"{t.name}: mean {y.mean()}"


def test_random_blocks_deterministic() -> None:
    f = get_format(GGMLType.Q4_K)
    a = f.random_blocks(10, np.random.default_rng(5))
    b = f.random_blocks(10, np.random.default_rng(5))
    assert np.array_equal(a, b)


def test_q8_K_bsums_are_group_sums() -> None:
    b = get_format(GGMLType.Q8_K).random_blocks(16, np.random.default_rng(0))
    qs = b[:, 4:260].view(np.int8).reshape(16, 16, 16).sum(axis=2)
    assert np.array_equal(np.ascontiguousarray(b[:, 260:292]).view("<i2"), qs)


def test_scalar_references_q4_K_iq1_m() -> None:
    """Element-at-a-time transcriptions of ggml's loops, for two of the trickier layouts."""
    rng = np.random.default_rng(11)
    b = raw_random_blocks(GGMLType.Q4_K, 24, rng)
    assert_bits_equal(get_format(GGMLType.Q4_K).decode_blocks(b), ref_q4_K(b), "Q4_K vs scalar")
    b = raw_random_blocks(GGMLType.IQ1_M, 24, rng)
    want = ref_iq1_m(b, c_grid("iq1s_grid").view(np.int8))
    assert_bits_equal(get_format(GGMLType.IQ1_M).decode_blocks(b), want, "IQ1_M vs scalar")
