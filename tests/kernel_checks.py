"""Helpers the kernel tests share: seeded random tensors on the kernels' device and the
relative-RMS comparison with a reference (fla's assert_close). Import after kernel_device."""

from __future__ import annotations

import torch
from kernel_device import DEVICE


def rand(*shape: int, seed: int, dtype: torch.dtype = torch.float32, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def close(label: str, out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """Relative RMS error ||ref - out|| / ||ref|| < tol; every element finite (an unwritten
    output, or a read past a mask, shows as NaN)."""
    out = out.detach().double().cpu()
    ref = ref.detach().double().cpu()
    assert out.shape == ref.shape, f"{label}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    bad = int((~torch.isfinite(out)).sum())
    assert bad == 0, f"{label}: {bad} elements not finite (unwritten or read past a mask)"
    diff = out - ref
    rel = (diff.norm() / ref.norm().clamp_min(1e-30)).item()
    print(f"{label}: rel rms {rel:.2e}, max |diff| {diff.abs().max().item():.2e}")
    assert rel < tol, f"{label}: relative RMS error {rel:.2e} >= {tol}"
