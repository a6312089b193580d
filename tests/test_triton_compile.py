"""Every Triton kernel compiles for the H200 (sm_90) on this CPU-only machine, within its shared
memory (tools/compile_kernels.py --cover: each kernel config once, in one of its formats; a separate
process because TRITON_INTERPRET must be unset)."""

from __future__ import annotations

import os
import subprocess
import sys

from testdata import REPO


def test_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run(
        [sys.executable, str(REPO / "tools" / "compile_kernels.py"), "--cover"],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    print(r.stdout)
    assert r.returncode == 0, f"compile_kernels failed:\n{r.stdout}\n{r.stderr[-3000:]}"
    assert "compiled within limits" in r.stdout


def test_cover_keeps_every_config_and_every_format_once_each() -> None:
    sys.path.insert(0, str(REPO / "tools"))
    import compile_kernels as ck

    def job(name: str, config: str) -> ck.Job:
        return ck.Job(name, config, None)

    jobs = [job(f"gemv_{t}", c) for t in ("Q4_K", "Q6_K", "Q8_0") for c in ("a", "b")]
    jobs += [job("gemv_IQ2_XS", "c"), job("rope", "x"), job("rope", "y")]
    kept = ck.cover(jobs)
    assert {(ck._family(j.name)[0], j.config) for j in kept} == {
        ("gemv", "a"), ("gemv", "b"), ("gemv", "c"), ("rope", "x"), ("rope", "y")}
    assert {j.name for j in kept} == {j.name for j in jobs}  # every format at least once
    assert len(kept) == 6  # a, b in two formats; the third format added once; c; x; y
    assert [j for j in jobs if j in kept] == kept  # the list's order
    assert ck._family("moe_gate_up_IQ2_XS") == ("moe_gate_up", "IQ2_XS")
