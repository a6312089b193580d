"""Rotary position embedding (RoPE), as ggml_rope_ext computes it without YaRN.

Two layouts: "norm" rotates adjacent pairs (x[2i], x[2i+1]); "neox" rotates the
halves (x[i], x[i + rope_dim/2]). Only the first ``rope_dim`` dims of a head rotate.
theta_i = pos * scale * base^(-2i/rope_dim) / freq_factor_i.
"""

from __future__ import annotations

import torch


def rope_cos_sin(
    positions: torch.Tensor,
    rope_dim: int,
    base: float,
    scale: float = 1.0,
    freq_factors: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [T] int -> (cos, sin), each [T, rope_dim/2] of ``dtype`` (computed in float64)."""
    i = torch.arange(0, rope_dim, 2, dtype=torch.float64, device=positions.device)
    inv_freq = base ** (-i / rope_dim)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.to(torch.float64)
    theta = positions.to(torch.float64)[:, None] * scale * inv_freq[None, :]
    return theta.cos().to(dtype), theta.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_type: str) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [T, R/2] with R <= D -> rotated copy of x."""
    half = cos.shape[-1]
    rot = 2 * half
    if rot > x.shape[-1]:
        raise ValueError(f"apply_rope: rope dims {rot} exceed head size {x.shape[-1]}")
    c = cos[:, None, :]
    s = sin[:, None, :]
    acc = torch.promote_types(x.dtype, torch.float32)  # float64 stays float64 (the yardstick)
    xr, rest = x[..., :rot].to(acc), x[..., rot:]
    c, s = c.to(acc), s.to(acc)
    if rope_type == "neox":
        a, b = xr[..., :half], xr[..., half:]
        out = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    elif rope_type == "norm":
        a, b = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    else:
        raise ValueError(f"apply_rope: unknown rope type {rope_type!r}")
    return torch.cat((out.to(x.dtype), rest), dim=-1)
