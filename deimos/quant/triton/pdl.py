"""Programmatic dependent launch (PDL, sm_90 and later) for the kernels of a decode step.

A decode step is ~300 small dependent kernels; between two of them the GPU normally drains
the first grid, then launches and ramps up the second. Launched with PDL, the second grid is
set up while the first still runs and its programs wait on the device (``griddepcontrol.wait``)
for the first to finish and its writes to be visible; the first lets it launch as soon as all
of its programs have started (``griddepcontrol.launch_dependents``). CUDA graphs keep these
edges when the stream is captured.

Rules every kernel launched with ``launch_options`` follows: ``pdl_start`` is its first
statement, run by every program before any load or store and before any early exit. (A
program that left without waiting could let the kernel finish before the one two launches
back, whose output the next kernel reads.) A kernel without it is launched normally; torch's
kernels in the same stream keep full ordering.

The one exception, ``ahead`` (the weight GEMVs): loads of what no kernel of the step writes
(packed weights) may come before ``pdl_start``, so that they stream while the kernel before
still runs; nothing is stored, and nothing another kernel writes is loaded, before it. (Also
safe to read before the wait: what a kernel two launches back or earlier wrote. This kernel
starts only once every program of the one before has passed its own wait, so those are
finished and visible; the MoE down projection reads its expert ids that way.)
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from deimos.switches import env_switch

# read once: the interpreter has no grid dependency control; DEIMOS_PDL=0 turns PDL off (a
# profile's kernel times then exclude the waits of kernels launched early: bench/profile_step.py)
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_OFF = os.environ.get("DEIMOS_PDL", "1") == "0"
# read once: DEIMOS_PDL_AHEAD=0 keeps the weight GEMVs' loads after the wait (a profile's A/B)
_AHEAD_OFF = not env_switch("DEIMOS_PDL_AHEAD", True)


@triton.jit
def pdl_start(ON: tl.constexpr):
    """Wait for the kernel before this one in the stream (its writes visible), then allow the
    next one to launch. No-op when ``ON`` is false."""
    if ON:
        gdc_wait()
        gdc_launch_dependents()


@functools.cache
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_on(device: torch.device) -> bool:
    """Whether kernels on ``device`` run with PDL: a CUDA GPU of sm_90 or later, compiled (not
    interpreted), unless DEIMOS_PDL=0."""
    if _INTERPRETED or _OFF or device.type != "cuda":
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


def ahead_on(device: torch.device) -> bool:
    """Whether the weight GEMVs on ``device`` load their first weights before the wait
    (module docstring): with PDL, unless DEIMOS_PDL_AHEAD=0."""
    return pdl_on(device) and not _AHEAD_OFF


def launch_options(on: bool) -> dict:
    """The launch keyword arguments: the kernel's ``PDL`` constexpr and, when on, Triton's
    ``launch_pdl``."""
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
