"""A decode step's handshake with the host through pinned (page-locked) host memory, so that a
step whose routed-expert misses are computed on the CPU stays one CUDA graph (Triton).

The GPU reads and writes the host's buffers directly (unified addressing: a pinned buffer's
address is valid on the device), with plain loads and stores over PCIe, never through the
copy engine, and nobody waits on an event: each side spins on the other's flag.

- ``post_rows``: program t copies row t of a layer's routing (ids int32 [T, k], weights
  float32 [T, k]) and its activation (float32 [T, D]) into the host's mailbox, makes its stores
  visible system-wide (``fence.sc.sys``), then counts itself done on a device counter (an
  atomic at GPU scope, acquire-release). The last program to arrive publishes the step's
  number on the layer's "posted" flag (``st.release.sys``) and resets the counter. With
  ``bump``, that program first adds 1 to the device's step number (the step's first layer), so
  a graph replayed as it is posts a new number each time.
- ``wait_rows``: program t spins (``ld.acquire.sys``) until the layer's "done" flag, written by
  the host after it stored its result, carries the step's number, then copies row t of the
  host's result into a device tensor. After ``max_spin`` polls (~1 us each) without it, it
  writes the layer's number + 1 into the host's error word and copies whatever is there; once
  the error word is set, later waits do not spin: a step whose host side died ends instead of
  hanging the device (the host reports it at its next step; the result is discarded).

Under the interpreter (the CPU tests) the fences and ordered accesses are plain (volatile)
loads and stores: programs run one after another there, so the host cannot run between them;
the tests set the flags before the launch. Reference: deimos.kernels.host_link.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
MAX_SPIN = 1 << 21  # polls of a flag before wait_rows gives up (~1-2 s over PCIe)


@triton.jit
def _ld_acquire_sys(ptr, ASM: tl.constexpr):
    if ASM:
        v = tl.inline_asm_elementwise("ld.acquire.sys.global.b32 $0, [$1];", "=r,l", [ptr],
                                      dtype=tl.int32, is_pure=False, pack=1)
    else:
        v = tl.load(ptr, volatile=True)
    return v


@triton.jit
def _st_release_sys(ptr, val, ASM: tl.constexpr):
    if ASM:
        tl.inline_asm_elementwise("st.release.sys.global.b32 [$1], $2; mov.u32 $0, 0;", "=r,l,r",
                                  [ptr, val], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(ptr, val)


@triton.jit
def _fence_sys(dummy, ASM: tl.constexpr):
    if ASM:
        tl.inline_asm_elementwise("fence.sc.sys; mov.u32 $0, 0;", "=r,r", [dummy],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _post_kernel(p_ids, p_w, p_x, p_box_ids, p_box_w, p_box_x, p_flag, p_seq, p_count,
                 T, K, D, BUMP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                 N_THREADS: tl.constexpr, ASM: tl.constexpr):
    t = tl.program_id(0)
    ok = tl.arange(0, BLOCK_K)
    mk = ok < K
    tl.store(p_box_ids + t * K + ok, tl.load(p_ids + t * K + ok, mask=mk), mask=mk)
    tl.store(p_box_w + t * K + ok, tl.load(p_w + t * K + ok, mask=mk), mask=mk)
    for d0 in range(0, D, BLOCK_D):
        od = d0 + tl.arange(0, BLOCK_D)
        md = od < D
        tl.store(p_box_x + t * D + od, tl.load(p_x + t * D + od, mask=md), mask=md)
    _fence_sys(tl.arange(0, N_THREADS), ASM)  # each thread's stores to host memory, before the count
    tl.debug_barrier()
    done = tl.atomic_add(p_count, 1, sem="acq_rel", scope="gpu")
    if done == T - 1:  # the last row's program: every row is in the host's buffers
        s = tl.load(p_seq, volatile=True)
        if BUMP:
            s += 1
            tl.store(p_seq, s)
        tl.atomic_xchg(p_count, 0, sem="relaxed", scope="gpu")
        _st_release_sys(p_flag, s, ASM)


@triton.jit
def _wait_kernel(p_flag, p_seq, p_err, p_src, p_out, D, LAYER, max_spin, BLOCK_D: tl.constexpr,
                 ASM: tl.constexpr):
    t = tl.program_id(0)
    s = tl.load(p_seq, volatile=True)
    v = _ld_acquire_sys(p_flag, ASM)
    n = 0
    if tl.load(p_err, volatile=True) != 0:  # an earlier layer gave up: so does this one
        n = max_spin
    while (v - s < 0) & (n < max_spin):  # wrap-safe: the host's number is behind
        v = _ld_acquire_sys(p_flag, ASM)
        n += 1
    if v - s < 0:
        tl.store(p_err, LAYER + 1)
    for d0 in range(0, D, BLOCK_D):
        od = d0 + tl.arange(0, BLOCK_D)
        md = od < D
        tl.store(p_out + t * D + od, tl.load(p_src + t * D + od, mask=md, volatile=True), mask=md)


def _check_host(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
        raise ValueError(f"host link: {name} must be contiguous {dtype} {list(shape)}, got "
                         f"{t.dtype} {list(t.shape)}")


def post_rows(ids: torch.Tensor, weights: torch.Tensor, x: torch.Tensor, box_ids: torch.Tensor,
              box_w: torch.Tensor, box_x: torch.Tensor, flag: torch.Tensor, seq: torch.Tensor,
              count: torch.Tensor, bump: bool) -> None:
    """Copy ids int32 [T, k], weights float32 [T, k] and x float32 [T, D] (device) into the
    first T rows of the host buffers box_ids / box_w [R, k] and box_x [R, D], then store the
    step's number (``seq``, int32 [1] on the device, plus 1 first when ``bump``) in ``flag``
    (int32 [1], host). ``count``: int32 [1] on the device, 0 between launches."""
    t, k = ids.shape
    d = x.shape[1]
    _check_host("ids", ids, torch.int32, (t, k))
    _check_host("weights", weights, torch.float32, (t, k))
    _check_host("x", x, torch.float32, (t, d))
    r = box_x.shape[0]
    if t > r:
        raise ValueError(f"host link: {t} rows, the mailbox holds {r}")
    _check_host("box_ids", box_ids, torch.int32, (r, k))
    _check_host("box_w", box_w, torch.float32, (r, k))
    _check_host("box_x", box_x, torch.float32, (r, d))
    for name, f in (("flag", flag), ("seq", seq), ("count", count)):
        _check_host(name, f, torch.int32, (1,))
    if t == 0:
        return
    _post_kernel[(t,)](ids, weights, x, box_ids, box_w, box_x, flag, seq, count, t, k, d,
                       BUMP=bump, BLOCK_K=triton.next_power_of_2(k), BLOCK_D=1024,
                       N_THREADS=4 * 32, ASM=not _INTERPRETED, num_warps=4)


def wait_rows(flag: torch.Tensor, seq: torch.Tensor, err: torch.Tensor, src: torch.Tensor,
              out: torch.Tensor, layer: int, max_spin: int = MAX_SPIN) -> torch.Tensor:
    """Wait until ``flag`` (int32 [1], host) reaches the step's number ``seq`` (int32 [1],
    device), then copy the host's rows ``src`` float32 [R, D] into ``out`` float32 [T, D]
    (device; T <= R). Gives up after ``max_spin`` polls, writing ``layer + 1`` into ``err``
    (int32 [1], host)."""
    t, d = out.shape
    r = src.shape[0]
    if t > r:
        raise ValueError(f"host link: {t} rows, the mailbox holds {r}")
    _check_host("src", src, torch.float32, (r, d))
    _check_host("out", out, torch.float32, (t, d))
    for name, f in (("flag", flag), ("seq", seq), ("err", err)):
        _check_host(name, f, torch.int32, (1,))
    if t:
        _wait_kernel[(t,)](flag, seq, err, src, out, d, layer, max_spin, BLOCK_D=1024,
                           ASM=not _INTERPRETED, num_warps=4)
    return out
