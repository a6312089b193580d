"""Input checks shared by the decode and prefill attention wrappers."""

from __future__ import annotations

import torch


def check_attention_io(
    op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
    out: torch.Tensor | None, device: torch.device, rows: str,
) -> torch.Tensor:
    """Checks q [rows, Hq, D] against k = v [S, Hkv, D] (GQA, same dtype, last dims contiguous,
    all on ``device``) and ``window`` >= 0; returns ``out``, allocated when None."""
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(
            f"{op}: need q [{rows}, Hq, D], k = v [S, Hkv, D]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape[2] != q.shape[2] or q.shape[1] % k.shape[1]:
        raise ValueError(f"{op}: q {tuple(q.shape)} does not fit k {tuple(k.shape)}")
    if k.dtype != v.dtype:
        raise ValueError(f"{op}: k is {k.dtype}, v is {v.dtype}")
    if window < 0:
        raise ValueError(f"{op}: window must be >= 0, got {window}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(2) != 1:
            raise ValueError(f"{op}: {name}'s last dimension must be contiguous")
        if t.device != device:
            raise ValueError(f"{op}: {name} on {t.device}, expected {device}")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.shape != q.shape or out.stride(2) != 1:
        raise ValueError(f"{op}: out must be {tuple(q.shape)}, last dim contiguous")
    return out
