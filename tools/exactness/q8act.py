"""llama.cpp's activation quantization, emulated on Deimos's float32 reference: the
explanation of the study's llama-cpu numbers.

ggml's CPU matmul of a quantized weight first rounds the activation row to the weight type's
``vec_dot_type`` (ggml-cpu.c type_traits_cpu): Q4_0/Q5_0/Q8_0 -> Q8_0 and Q4_1/Q5_1 -> Q8_1
(blocks of 32, scale amax / 127 stored as fp16, codes round(x / scale)), the K-quants ->
Q8_K (blocks of 256, scale -max / 127 with max the element of largest magnitude, float32,
codes clamped to 127; ggml-quants.c quantize_row_q8_K_ref, which the x86 backend calls). The dot product then runs on the codes. ``quantize_activations``
makes every quantized linear of a model round its input by its rounded value (scale * code), which is what
the integer dot product computes up to float32 summation order; with it Deimos's float32
reference reproduces llama.cpp's logits on the quantized file (docs/exactness.md).
"""

from __future__ import annotations

import torch

from deimos.gguf.constants import GGMLType
from deimos.models.weights import Linear

Q8_32 = {GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0}
Q8_K = {GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K}


def round_q8_32(x: torch.Tensor) -> torch.Tensor:
    """Q8_0 / Q8_1 rounding of x [..., K] (K a multiple of 32)."""
    b = x.float().reshape(*x.shape[:-1], -1, 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(b / torch.where(d > 0, d, 1)), 0)
    return (d.half().float() * q).reshape(x.shape)


def round_q8_k(x: torch.Tensor) -> torch.Tensor:
    """Q8_K rounding of x [..., K] (K a multiple of 256)."""
    b = x.float().reshape(*x.shape[:-1], -1, 256)
    at = b.abs().argmax(-1, keepdim=True)
    mx = torch.gather(b, -1, at)
    safe = torch.where(mx != 0, mx, 1)
    # a true division (torch's ``-127 / t`` multiplies by a reciprocal: another float)
    iscale = torch.where(mx != 0, torch.full_like(safe, -127.0) / safe, 0)
    q = torch.clamp(torch.round(iscale * b), max=127)
    d = torch.where(iscale != 0, 1 / torch.where(iscale != 0, iscale, 1), 0)  # ggml: d = 1 / iscale
    return (d * q).reshape(x.shape)


class Q8InputLinear(Linear):
    """A reference ``Linear`` that first rounds its input as ggml's CPU backend does."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.ggml_type in Q8_32:
            x = round_q8_32(x)
        elif self.ggml_type in Q8_K:
            x = round_q8_k(x)
        return super().__call__(x)


def linears(model) -> list[Linear]:
    """Every distinct ``Linear`` reachable from a CPU reference model's attributes."""
    seen: set[int] = set()
    out: list[Linear] = []

    def walk(v) -> None:
        if isinstance(v, Linear):
            if id(v) not in seen:
                seen.add(id(v))
                out.append(v)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        elif hasattr(v, "__dict__") and not isinstance(v, torch.Tensor) and id(v) not in seen:
            seen.add(id(v))
            for x in vars(v).values():
                walk(x)

    walk(model)
    return out


def quantize_activations(model) -> int:
    """Makes every ``Linear`` of a CPU reference model round its input (in place: the model
    is the llama.cpp emulation from then on); returns how many linears that is."""
    found = linears(model)
    for v in found:
        v.__class__ = Q8InputLinear
    return len(found)
