"""GGML quant formats: block layouts and the vectorized CPU reference decoder.

``dequantize(raw, ggml_type, shape, name)`` decodes a tensor; ``get_format(t)`` gives the format
(``block_size``, ``type_size``, ``decode_blocks``, ``random_blocks``).
"""

from __future__ import annotations

# Importing the format modules registers their classes.
from deimos.quant import float as _float  # noqa: F401
from deimos.quant import iquants as _iquants  # noqa: F401
from deimos.quant import kquants as _kquants  # noqa: F401
from deimos.quant import legacy as _legacy  # noqa: F401
from deimos.quant import mxfp4 as _mxfp4  # noqa: F401
from deimos.quant import ternary as _ternary  # noqa: F401
from deimos.quant.base import QuantError, QuantFormat, dequantize, formats, get_format

__all__ = ["QuantError", "QuantFormat", "dequantize", "formats", "get_format"]
