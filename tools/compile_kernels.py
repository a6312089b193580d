"""Compile every Triton kernel of deimos.quant.triton for the H200 (sm_90), with no GPU here.

For each launch configuration the wrappers use, the kernel goes through Triton's normal JIT
(``kernel.warmup``, same argument specialization as a real launch) behind a stub driver that
reports a ``GPUTarget("cuda", 90, 32)``. Prints kernel, config, registers, spills, shared memory
and compile time; exits 1 if any kernel fails to compile or needs more shared memory than an
H200 block may have (232,448 bytes). Registers and spills come from the cuobjdump that ships
with Triton.

    python tools/compile_kernels.py [--verbose]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

H200_SHARED_PER_BLOCK = 232_448
TARGET_ARCH = 90


class Job(NamedTuple):
    name: str  # kernel
    config: str  # what varies, for the table
    run: object  # () -> CompiledKernel


class Row(NamedTuple):
    name: str
    config: str
    ok: bool
    regs: str
    spills: str
    shared: int
    seconds: float
    error: str


class _StubDriver:
    """Just enough of a Triton driver for the JIT to compile (never to launch)."""

    def __init__(self, target: object) -> None:
        self._target = target

    def get_current_target(self) -> object:
        return self._target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> object:
        import torch

        return torch.device("cpu")


def _jobs() -> list[Job]:
    """Every (kernel, constexpr config) the wrappers launch on a GPU."""
    from deimos.quant.triton import dequant_gemv as g

    jobs = []
    # real shapes: K = 4096 gives the full step; K = 256 (a single super-block) the smallest
    for t in g.FMT_ID:
        # launch_config is one config per format (its rule ignores the shape)
        cfg = g.launch_config(t, 4096, 4096, 1)
        jobs.append(Job("gemv_" + t.name, _describe(cfg), _gemv_warmup(g, t, 4096, cfg)))
    return jobs


def _describe(cfg: object) -> str:
    return f"N={cfg.block_n} S={cfg.block_s} warps={cfg.num_warps}"


def _gemv_warmup(g: object, t: object, k: int, cfg: object):
    import torch
    from triton.runtime.jit import MockTensor

    from deimos.quant import get_format
    from deimos.quant.triton.layout import pack
    import numpy as np

    # dtypes of the arrays exactly as pack() makes them (pointer types are specialized on dtype)
    fmt = get_format(t)
    blocks = fmt.random_blocks(k // fmt.block_size, np.random.default_rng(0)).reshape(1, -1)
    w = pack(blocks, t)
    xp = g.PreparedX(torch.zeros(1, k), torch.zeros(1, k // 32))
    y = torch.zeros(1, 1)
    args = [MockTensor(a.dtype) for a in g._kernel_args(w, xp, y)]

    def run():
        return g._gemv_kernel.warmup(
            *args, 4096, k,
            FMT=g.FMT_ID[t], BLOCK_N=cfg.block_n, BLOCK_S=cfg.block_s,
            num_warps=cfg.num_warps, grid=(1,),
        )  # fmt: skip

    return run


def _resources(cubin: bytes) -> tuple[str, str]:
    """(registers, spill bytes) read from the cubin with Triton's cuobjdump."""
    import triton.backends.nvidia as nv

    tool = Path(nv.__file__).parent / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True
        ).stdout
    reg = re.search(r"REG:(\d+)", out)
    local = re.search(r"LOCAL:(\d+)", out)
    return (reg.group(1) if reg else "?", local.group(1) if local else "?")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile_kernels: unset TRITON_INTERPRET (the interpreter compiles nothing)")
        return 2

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    driver.set_active(_StubDriver(GPUTarget("cuda", TARGET_ARCH, 32)))
    rows = []
    for job in _jobs():
        t0 = time.perf_counter()
        try:
            kernel = job.run()
            seconds = time.perf_counter() - t0
            shared = int(kernel.metadata.shared)
            regs, spills = _resources(kernel.asm["cubin"])
            ok = shared <= H200_SHARED_PER_BLOCK
            err = "" if ok else f"needs {shared} bytes of shared memory > {H200_SHARED_PER_BLOCK}"
            rows.append(Row(job.name, job.config, ok, regs, spills, shared, seconds, err))
        except Exception as e:  # noqa: BLE001 - every failure is reported in the table
            if args.verbose:
                traceback.print_exc()
            msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            seconds = time.perf_counter() - t0
            rows.append(Row(job.name, job.config, False, "-", "-", 0, seconds, msg))

    print(f"triton {triton.__version__}, target sm_{TARGET_ARCH}")
    head = f"{'kernel':<12} {'config':<26} {'regs':>5} {'spill':>6} {'shared':>7} {'time s':>7}"
    print(head + "  status")
    for r in rows:
        status = "ok" if r.ok else "FAIL " + r.error
        print(
            f"{r.name:<12} {r.config:<26} {r.regs:>5} {r.spills:>6} {r.shared:>7} "
            f"{r.seconds:>7.2f}  {status}"
        )
    failed = [r for r in rows if not r.ok]
    print(f"{len(rows) - len(failed)}/{len(rows)} compiled within limits")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
