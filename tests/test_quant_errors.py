"""Bad input to ``dequantize`` gets a QuantError naming the tensor, the type and the problem."""

from __future__ import annotations

import numpy as np
import pytest

from deimos.gguf.constants import GGMLType
from deimos.quant import QuantError, dequantize, get_format


def test_unknown_type_number() -> None:
    with pytest.raises(QuantError, match=r"'blk.0.w'.*unknown GGML type 99"):
        dequantize(np.zeros(18, np.uint8), 99, (32,), "blk.0.w")


def test_type_without_decoder() -> None:
    with pytest.raises(QuantError, match=r"'emb'.*Q8_1"):
        dequantize(np.zeros(40, np.uint8), GGMLType.Q8_1, (32,), "emb")
    with pytest.raises(QuantError, match="Q8_1"):
        get_format(GGMLType.Q8_1)


def test_quant_error_is_value_error() -> None:
    assert issubclass(QuantError, ValueError)


def test_last_dim_not_multiple_of_block() -> None:
    with pytest.raises(QuantError, match=r"'w'.*Q4_K.*last dim 100 .*block size 256"):
        dequantize(np.zeros(144, np.uint8), GGMLType.Q4_K, (2, 100), "w")


@pytest.mark.parametrize("nbytes", [17, 19, 0, 36])
def test_wrong_byte_count(nbytes: int) -> None:
    with pytest.raises(QuantError, match=rf"'x'.*Q4_0.*{nbytes} bytes, expected 18"):
        dequantize(np.zeros(nbytes, np.uint8), GGMLType.Q4_0, (1, 32), "x")


def test_wrong_dtype() -> None:
    with pytest.raises(QuantError, match=r"'x'.*uint8.*float32"):
        dequantize(np.zeros(8, np.float32), GGMLType.F32, (8,), "x")


def test_negative_dim() -> None:
    with pytest.raises(QuantError, match="negative"):
        dequantize(np.zeros(0, np.uint8), GGMLType.F32, (-1, 0), "x")


def test_accepts_bytes_and_2d_raw_and_keeps_shape() -> None:
    f = get_format(GGMLType.Q8_0)
    blocks = f.random_blocks(6, np.random.default_rng(0))
    want = f.decode_blocks(blocks).reshape(3, 2, 32)
    assert np.array_equal(dequantize(blocks, GGMLType.Q8_0, (3, 2, 32)), want)
    got = dequantize(blocks.tobytes(), int(GGMLType.Q8_0), (3, 64))
    assert np.array_equal(got, want.reshape(3, 64))
    assert dequantize(b"", GGMLType.Q4_K, (0, 256)).shape == (0, 256)


def test_chunked_decode_matches_single_call() -> None:
    """dequantize decodes in chunks; the seams must not show."""
    f = get_format(GGMLType.Q4_0)
    n = (1 << 20) // 32 * 2 + 5  # a bit over two chunks
    blocks = f.random_blocks(n, np.random.default_rng(1))
    got = dequantize(blocks, GGMLType.Q4_0, (n, 32))
    assert np.array_equal(got, f.decode_blocks(blocks))
