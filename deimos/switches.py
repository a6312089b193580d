"""The engine's A/B switches: environment variables read once, at import, by the module whose
behaviour they choose (DEIMOS_PDL_AHEAD, DEIMOS_ATTN_MERGE, DEIMOS_MOE_DEFER,
DEIMOS_DECODE_F16, DEIMOS_MOE_MMQ, DEIMOS_MATMUL_TMA). For measurements, not for users: no
flag needs them."""

from __future__ import annotations

import os


def env_switch(name: str, default: bool) -> bool:
    """``name`` set to 1 (on) or 0 (off); unset or empty: ``default``; anything else a
    ValueError naming the variable and its value."""
    v = os.environ.get(name, "")
    if v not in ("", "0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {v!r}")
    return default if v == "" else v == "1"
