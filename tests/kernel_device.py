"""Where the kernel tests run: the GPU when there is one, else Triton's interpreter on CPU
tensors. Import it before any deimos kernel module (Triton reads TRITON_INTERPRET when a
kernel is defined)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cpu" if INTERPRETED else "cuda"
