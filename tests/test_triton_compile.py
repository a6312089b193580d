"""Every Triton kernel compiles for the H200 (sm_90) on this CPU-only machine, within its shared
memory (tools/compile_kernels.py; a separate process because TRITON_INTERPRET must be unset)."""

from __future__ import annotations

import os
import subprocess
import sys

from testdata import REPO


def test_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run(
        [sys.executable, str(REPO / "tools" / "compile_kernels.py")],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    print(r.stdout)
    assert r.returncode == 0, f"compile_kernels failed:\n{r.stdout}\n{r.stderr[-3000:]}"
    assert "compiled within limits" in r.stdout
