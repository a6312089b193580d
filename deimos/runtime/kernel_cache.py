"""Where compiled kernels live: Triton's on-disk cache, put under Deimos' cache directory
(``<cache>/triton``, deimos.registry.cache_dir) unless the user set ``TRITON_CACHE_DIR``.

Triton keys each entry by the kernel's source, its constexprs and signature, the Triton
version and the GPU target, so a changed kernel or compiler never loads a stale binary.
Called once at an entry point (CLI, ``LLM``), before any kernel compiles; Triton reads the
variable when it compiles, not per launch.
"""

from __future__ import annotations

import os
from pathlib import Path

from deimos.registry import cache_dir


def kernel_cache_dir() -> Path:
    configured = os.environ.get("TRITON_CACHE_DIR")
    return Path(configured) if configured else cache_dir() / "triton"


def use_kernel_cache() -> Path:
    """Points Triton at the kernel cache directory (created); returns it."""
    path = kernel_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TRITON_CACHE_DIR", str(path))
    return path
