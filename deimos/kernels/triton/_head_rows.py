"""Helpers of the kernels that work on (token, head) rows of Dh elements, BLOCK_R rows a
program (kernels.triton.gated_norm, kernels.triton.output_gate): the program's rows, and its
output tile written as the GEMV's integer activation (a row's groups of 32 lie in one head)."""

from __future__ import annotations

import triton
import triton.language as tl

from deimos.quant.triton.gemv_q8 import quantize_groups


@triton.jit
def head_rows(n_rows, BLOCK_R: tl.constexpr, DH: tl.constexpr):
    """(this program's rows, their mask, the element offsets of a row)."""
    o_r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    return o_r, o_r < n_rows, tl.arange(0, DH)


@triton.jit
def quantize_head_rows(b_y, n_rows, p_xq, p_xd, p_xs, BLOCK_R: tl.constexpr, DH: tl.constexpr):
    """The program's output rows ``b_y [BLOCK_R, DH]`` float32 into the QuantizedX of
    ``[T, H Dh]``: row r's groups are groups r Dh / 32 .. of the flat [T, H Dh / 32] scales."""
    G: tl.constexpr = BLOCK_R * DH // 32
    o_g = tl.program_id(0).to(tl.int64) * G + tl.arange(0, G)
    quantize_groups(tl.reshape(b_y, (G, 4, 8)), o_g, o_g < n_rows * (DH // 32), p_xq, p_xd, p_xs)
