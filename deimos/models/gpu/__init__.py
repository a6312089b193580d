"""The kernel-backed weights of the GPU path (Triton): packed quantized matrices and
embeddings on the device, chosen per tensor by its GGML type (see linear.py).

``WeightSource(file, "cuda")`` builds them (``kernels=True`` forces them on another device,
e.g. the CPU under TRITON_INTERPRET=1). Importing this package imports triton.
"""

from __future__ import annotations

from deimos.models.gpu.dequant import dequantize_fp16, gather_rows
from deimos.models.gpu.linear import (
    DenseEmbedding,
    DenseLinear,
    InputCache,
    LinearGroup,
    LinearPart,
    QuantEmbedding,
    QuantLinear,
)
from deimos.models.gpu.notices import Notices
from deimos.models.gpu.source import GpuWeights

__all__ = ["DenseEmbedding", "DenseLinear", "GpuWeights", "InputCache", "LinearGroup", "LinearPart", "Notices",
           "QuantEmbedding", "QuantLinear", "dequantize_fp16", "gather_rows"]
