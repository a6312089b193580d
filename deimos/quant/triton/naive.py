"""Plain torch references for the GPU layouts and the GEMV: the oracles of the Triton kernels.

``gemv_ref`` never looks at the packed layout: it decodes the GGUF bytes with deimos.quant (bit
exact vs ggml) and multiplies in float64. ``dequantize_packed`` decodes the packed layout with
ggml's float32 operations, so it must equal deimos.quant bit for bit; it pins down the layout
independently of any kernel.
"""

from __future__ import annotations

import numpy as np
import torch

from deimos.gguf.constants import GGMLType
from deimos.quant import dequantize
from deimos.quant.triton.layout import Q6_HIGH_SHIFT, PackedWeight


def gemv_ref(blocks: np.ndarray, ggml_type: GGMLType, x: torch.Tensor) -> torch.Tensor:
    """GGUF bytes uint8 ``[n, row_bytes]``, x ``[k]``/``[b, k]`` -> float64 ``[n]``/``[b, n]``."""
    n = blocks.shape[0]
    k = x.shape[-1]
    w = torch.from_numpy(dequantize(np.ascontiguousarray(blocks), ggml_type, (n, k)))
    return x.double().cpu() @ w.double().T


def _codes_nibble(qw: torch.Tensor) -> torch.Tensor:
    """int32 ``[n, k/8]`` -> low 4 bits ``[n, k]`` in element order (word w nibble k <-> 4k+w)."""
    n = qw.shape[0]
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    q = (qw.reshape(n, -1, 1, 4) >> shifts.reshape(1, 1, 8, 1)) & 0xF  # [n, u, k, w]
    return q.reshape(n, -1)


def _bits(qh: torch.Tensor, width: int) -> torch.Tensor:
    n = qh.shape[0]
    shifts = torch.arange(0, 8 * width, width, dtype=torch.int32)
    b = (qh.to(torch.int32).reshape(n, -1, 1, 4) >> shifts.reshape(1, 1, 8, 1)) & ((1 << width) - 1)
    return b.reshape(n, -1)


def _q6_high_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q6_K's high 2 bits ``[n, k]`` from its int16 entries (layout.Q6_HIGH_SHIFT)."""
    n = qh.shape[0]
    shifts = torch.tensor(Q6_HIGH_SHIFT, dtype=torch.int32)
    b = (qh.to(torch.int32).reshape(n, -1, 1, 4) >> shifts.reshape(1, 1, 8, 1)) & 3
    return b.reshape(n, -1)


def _per_group(v: torch.Tensor, size: int) -> torch.Tensor:
    """``[n, k/size]`` per-group values -> ``[n, k]`` (each repeated ``size`` times)."""
    return v.repeat_interleave(size, dim=1)


def _k4_scales(meta: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """meta int32 ``[n, k/64]`` -> d, dmin ``[n, k/256]``; sc, mn ``[n, k/32]`` (float32)."""
    n = meta.shape[0]
    meta = meta.reshape(n, -1, 4)
    raw = meta.contiguous().view(torch.uint8).reshape(n, -1, 16).to(torch.int32)
    d = meta[:, :, 0].contiguous().view(torch.float16)[:, 0::2].float()
    dmin = meta[:, :, 0].contiguous().view(torch.float16)[:, 1::2].float()
    byte = raw[..., 4:12]  # group j: scale | (min & 3) << 6 (layout._k4_meta)
    high = (meta[:, :, 3:4] >> (4 * torch.arange(8, dtype=torch.int32))) & 0xF  # min >> 2
    sc = (byte & 63).reshape(n, -1).float()
    mn = ((byte >> 6) | (high << 2)).reshape(n, -1).float()
    return d, dmin, sc, mn


def packed_terms(p: PackedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The packed layout as float32 ``[n, k]`` terms (CPU): (codes less the format's zero
    point, each element's scale, its min term or None), the weight being codes * scale + min
    in ggml's float32 operations (``dequantize_packed``)."""
    t = {name: v.cpu() for name, v in p.tensors.items()}
    n, k = p.n, p.k
    if p.ggml_type == GGMLType.Q8_0:
        q = t["qw"].view(torch.int8).reshape(n, -1, 8, 4).transpose(2, 3).reshape(n, k)
        return q.float(), _per_group(t["d"].float(), k // t["d"].shape[1]), None  # per 32 or 16
    if p.ggml_type == GGMLType.Q2_K:
        shifts = (2 * torch.arange(16, dtype=torch.int32)).reshape(1, 1, 16, 1)
        q = ((t["qw"].reshape(n, -1, 1, 2) >> shifts) & 3).reshape(n, k)  # [n, u, k, w]: 2k + w
        sc = t["sc"].contiguous().view(torch.uint8).reshape(n, -1).to(torch.int32)  # per 16
        dl = _per_group(t["d"].float(), 16) * (sc & 15).float()
        ml = _per_group(t["m"].float(), 16) * (sc >> 4).float()
        return q.float(), _per_group(dl, 16), -_per_group(ml, 16)
    q = _codes_nibble(t["qw"])
    if p.ggml_type in (GGMLType.Q4_K, GGMLType.Q5_K):
        if p.ggml_type == GGMLType.Q5_K:
            q = q | (_bits(t["qh"], 1) << 4)
        d, dmin, sc, mn = _k4_scales(t["meta"])
        d1 = _per_group(d, 8) * sc
        m1 = _per_group(dmin, 8) * mn
        return q.float(), _per_group(d1, 32), -_per_group(m1, 32)
    if p.ggml_type == GGMLType.Q6_K:
        q = (q | (_q6_high_bits(t["qh"]) << 4)) - 32
        return q.float(), _per_group(_per_group(t["d"].float(), 16) * t["sc"].float(), 16), None
    d = _per_group(t["d"].float(), 32)
    if p.ggml_type == GGMLType.Q4_0:
        return (q - 8).float(), d, None
    if p.ggml_type == GGMLType.Q4_1:
        return q.float(), d, _per_group(t["m"].float(), 32)
    if p.ggml_type == GGMLType.Q5_0:
        return ((q | (_bits(t["qh"], 1) << 4)) - 16).float(), d, None
    if p.ggml_type == GGMLType.Q5_1:
        return (q | (_bits(t["qh"], 1) << 4)).float(), d, _per_group(t["m"].float(), 32)
    raise ValueError(f"dequantize_packed: no layout for {p.ggml_type.name}")


def dequantize_packed(p: PackedWeight) -> torch.Tensor:
    """The packed layout decoded to float32 ``[n, k]`` (CPU), equal to deimos.quant bit for bit."""
    q, s, m = packed_terms(p)
    return q * s if m is None else q * s + m


def dequantize_packed_half(p: PackedWeight) -> torch.Tensor:
    """The packed layout decoded as the batched GEMM's float16 decode does it (gemm_q's
    ``decode_tile``): each element's float32 scale and min rounded to float16, then
    codes * scale + min rounded once to float16 (a fused multiply-add; the product of a code
    and a float16 is exact in float32, where the sum is taken). float16 ``[n, k]`` (CPU)."""
    q, s, m = packed_terms(p)
    s16 = s.half().float()
    if m is None:
        return (q * s16).half()
    return (q * s16 + m.half().float()).half()
