"""RMSNorm. Reference implementation in torch (float32); GPU kernels live beside it."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., D], weight: [D] -> [..., D]; y = x / sqrt(mean(x^2) + eps) * weight."""
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"rms_norm: x has width {x.shape[-1]}, weight has {weight.shape[-1]}")
    # float32 at least; float64 stays float64 (deimos.eval.float64, the exactness yardstick)
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(acc)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.to(acc)).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused residual step: residual' = x + residual (or x); returns (rms_norm(residual'), residual')."""
    summed = x if residual is None else x + residual
    return rms_norm(summed, weight, eps), summed


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Gated DeltaNet block's output norm: ``rms_norm(x) * silu(z)`` over the last dim (x,
    z: [..., D] of one shape; weight: [D])."""
    return rms_norm(x, weight, eps) * F.silu(z)
