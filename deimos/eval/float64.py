"""The float64 yardstick: a loaded CPU reference model converted to float64 in place.

The weights are the same dequantized values the float32 reference holds (every GGML format
dequantizes exactly into float32, so widening to float64 loses nothing); only the arithmetic
becomes float64. The reference ops (deimos.kernels: norm, rope, attention, activation) compute
in ``promote_types(x.dtype, float32)``, so float64 inputs stay float64 end to end, and the rope
tables are made in float64 (``ReferenceOps.dtype``). The KV cache must be float64 too
(``KVCache(..., dtype=torch.float64)``, see ``kv_cache``).

This is Deimos's own math, not an independent implementation: it measures how far each path's
rounding is from the exact function of the quantized file as Deimos understands that function.
A bug in the math itself (a wrong epsilon, a wrong rope layout) would be in the yardstick too;
docs/exactness.md cross-checks it against llama.cpp where the two agree.
"""

from __future__ import annotations

import torch

from deimos.models import DecoderModel
from deimos.models.ops import ReferenceOps
from deimos.runtime.kv_cache import KVCache


def to_float64(model: DecoderModel) -> DecoderModel:
    """Widens every floating tensor the model holds (weights, norm vectors, rope frequency
    factors; a tied embedding stays one tensor) to float64, in place; returns the model.

    Only the CPU reference model (``load_model(file, device="cpu")``) can be converted: the
    GPU path's packed weights and Triton ops have no float64 form.
    """
    if not isinstance(model.ops, ReferenceOps):
        raise ValueError(
            f"to_float64: the model runs {type(model.ops).__name__}; only the CPU reference "
            "(ReferenceOps, load_model(file, device='cpu')) has a float64 form"
        )
    widened: dict[int, torch.Tensor] = {}  # id(float32 tensor) -> its float64 copy, keeps ties

    def widen(value):
        if isinstance(value, torch.Tensor):
            if not value.is_floating_point():
                return value
            if id(value) not in widened:
                widened[id(value)] = value.to(torch.float64)
            return widened[id(value)]
        if isinstance(value, list):
            value[:] = [widen(v) for v in value]
            return value
        if isinstance(value, tuple):  # e.g. the qk-norm weights; untouched ones stay as they are
            items = tuple(widen(v) for v in value)
            return value if all(a is b for a, b in zip(items, value)) else items
        if isinstance(value, dict):
            for k in value:
                value[k] = widen(value[k])
            return value
        if hasattr(value, "__dict__") and not isinstance(value, type) and id(value) not in seen:
            seen.add(id(value))
            for k, v in vars(value).items():
                new = widen(v)
                if new is not v:
                    setattr(value, k, new)
        return value

    seen: set[int] = set()
    widen(model)
    model.ops.dtype = torch.float64
    return model


def kv_cache(model: DecoderModel, capacity: int) -> KVCache:
    """A KV cache of the model's width in float64, for a model made by ``to_float64``."""
    return KVCache(model.config, capacity, dtype=torch.float64)
