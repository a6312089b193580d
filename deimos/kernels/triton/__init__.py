"""Triton kernels for a transformer layer, each file one op: the ``@triton.jit`` kernel, its
launch rule and a documented public wrapper. The torch references one level up
(deimos/kernels/<op>.py) are their oracles (tests/test_triton_kernels.py).

Importing this package imports triton: set TRITON_INTERPRET=1 before that to run the kernels
on CPU tensors.
"""

from __future__ import annotations

from deimos.kernels.triton.activation import gated_act
from deimos.kernels.triton.decode_attention import NewToken, decode_attention
from deimos.kernels.triton.norm import add_rms_norm, rms_norm
from deimos.kernels.triton.prefill_attention import (
    paged_prefill_attention,
    prefill_attention,
    prefill_tile_map,
)
from deimos.kernels.triton.rope import apply_rope, rope, rope_inv_freq
from deimos.kernels.triton.sample_batch import SampleScratch, SamplingRows, sample_rows
from deimos.kernels.triton.sampling import TopK, argmax, topk

__all__ = [
    "NewToken",
    "SampleScratch",
    "SamplingRows",
    "TopK",
    "add_rms_norm",
    "apply_rope",
    "argmax",
    "decode_attention",
    "gated_act",
    "paged_prefill_attention",
    "prefill_attention",
    "prefill_tile_map",
    "rms_norm",
    "rope",
    "rope_inv_freq",
    "sample_rows",
    "topk",
]
