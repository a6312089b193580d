"""Triton kernels over quantized weights kept in their GGUF bytes on the GPU.

``pack(blocks, type)`` repacks a matrix's GGUF bytes once at load (layout.py draws the layouts);
``gemv_q8(packed, quantize_x(x))`` is the decode GEMV on integer activations (gemv_q8.py);
``gemm_q(packed, x_permuted)`` the batched decode GEMM (2..64 fp16 rows, gemm_q.py); naive.py
holds the torch oracles. Importing this package imports triton: set TRITON_INTERPRET=1 before that
to run the kernels on CPU tensors.
"""

from __future__ import annotations

from deimos.quant.triton.dequant_gemv import MAX_BATCH
from deimos.quant.triton.gemm_q import GemmQConfig, gemm_q
from deimos.quant.triton.gemv_q8 import QuantizedX, gemv_q8, quantize_x
from deimos.quant.triton.layout import PACKED_TYPES, PackedWeight, pack

__all__ = [
    "MAX_BATCH",
    "PACKED_TYPES",
    "GemmQConfig",
    "PackedWeight",
    "QuantizedX",
    "gemm_q",
    "gemv_q8",
    "pack",
    "quantize_x",
]
