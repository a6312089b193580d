"""GGUF: constants, and the validated memory-mapped reader (``GGUFFile``)."""

from __future__ import annotations

from .constants import GGML_BLOCK, GGMLType, GGUFValueType, tensor_nbytes
from .errors import GGUFError
from .reader import GGUFFile, TensorInfo

__all__ = [
    "GGML_BLOCK",
    "GGMLType",
    "GGUFError",
    "GGUFFile",
    "GGUFValueType",
    "TensorInfo",
    "tensor_nbytes",
]
