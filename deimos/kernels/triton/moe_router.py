"""The router of a decode step in one launch (Triton): float32 logits = x W_r^T, then the
softmax, top-k and renormalization of ``moe_route``.

Why: the unfused router is a torch float32 product (a cuBLAS launch outside the decode's
programmatic-dependent-launch chain) then ``moe_route``'s launch, for a 1 MB weight at
qwen3moe's 128 x 2048. Here program (t, s) computes the logits of experts s BLOCK_E .. for
token t (BLOCK_E rows of W_r, float32 products summed in float32), stores them in a scratch
row and counts itself done on the token's counter (an atomic at GPU scope, acquire-release,
after a barrier of the program's threads: the logits it stored are visible to whoever sees the
count). The program that brings the count to the number of splits reads the token's whole row
back and routes it (``_topk_store``, the same code as moe_route's), then resets the counter to
0 for the next launch (so a CUDA graph replays it as it is).

The logits' summation order differs from cuBLAS's, so logits within float32 rounding of a tie
may route differently from the unfused path; exactly representable products route the same.
Oracle: deimos.kernels.moe.moe_route_reference on x W_r^T in float64.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from deimos.kernels.triton.moe_route import MAX_EXPERTS, MAX_TOP_K, _topk_store
from deimos.quant.triton.pdl import ahead_on, launch_options, pdl_on, pdl_start

MAX_TOKENS = 8  # the decode steps this launch serves (more tokens: torch.mm then moe_route)


class RouterTile(NamedTuple):
    """A program's experts (``block_e`` rows of W_r), the columns a loop step (``block_d``),
    its warps. The default: bench/sweep_router.py's best on the H200 (session 31) at both
    qwen35moe's 256 x 2048 (4.70 us a call against 5.97 at (8, 512, 4)) and qwen3moe's
    128 x 2048 (4.54 against 5.82)."""

    block_e: int = 2
    block_d: int = 2048
    num_warps: int = 2


class RouterScratch:
    """A device's scratch for ``moe_router``: logits float32 ``[MAX_TOKENS, E]`` and the
    tokens' counters int32 ``[MAX_TOKENS]``, zero between launches. One a model's ops, shared
    by its layers (their launches never overlap); made on first use for each expert count."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, n_expert: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (n_expert, device)
        b = self._bufs.get(key)
        if b is None:
            b = self._bufs[key] = (torch.empty((MAX_TOKENS, n_expert), dtype=torch.float32, device=device),
                                   torch.zeros(MAX_TOKENS, dtype=torch.int32, device=device))  # fmt: skip
        return b


@triton.jit
def _router_kernel(p_x, p_r, p_logits, p_count, p_w, p_ids, E, D, N_SPLIT,
                   TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_E: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_ALL: tl.constexpr, RENORM: tl.constexpr,
                   PDL: tl.constexpr = False, AHEAD: tl.constexpr = False):
    """AHEAD (with PDL): the router's first BLOCK_D columns (a weight: no kernel of the step
    writes it) loaded before the wait, streaming while the kernel before still runs."""
    if not AHEAD:
        pdl_start(PDL)
    i_t = tl.program_id(0).to(tl.int64)
    i_s = tl.program_id(1)
    o_e = i_s * BLOCK_E + tl.arange(0, BLOCK_E)
    m_e = o_e < E
    acc = tl.zeros([BLOCK_E, BLOCK_D], dtype=tl.float32)
    first = 0
    if AHEAD:
        o_d = tl.arange(0, BLOCK_D)
        m_d = o_d < D
        b_r = tl.load(p_r + o_e[:, None].to(tl.int64) * D + o_d[None, :], mask=m_e[:, None] & m_d[None, :],
                      other=0.0)  # fmt: skip
        pdl_start(True)
        b_x = tl.load(p_x + i_t * D + o_d, mask=m_d, other=0.0).to(tl.float32)
        acc += b_r * b_x[None, :]
        first = BLOCK_D
    for d0 in range(first, D, BLOCK_D):
        o_d = d0 + tl.arange(0, BLOCK_D)
        m_d = o_d < D
        b_x = tl.load(p_x + i_t * D + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_r = tl.load(p_r + o_e[:, None].to(tl.int64) * D + o_d[None, :], mask=m_e[:, None] & m_d[None, :],
                      other=0.0)  # fmt: skip
        acc += b_r * b_x[None, :]
    tl.store(p_logits + i_t * E + o_e, tl.sum(acc, axis=1), mask=m_e)
    tl.debug_barrier()  # every thread's logits stored before the count
    done = tl.atomic_add(p_count + i_t, 1, sem="acq_rel", scope="gpu")
    if done == N_SPLIT - 1:  # the token's last split: every logit is in
        o_a = tl.arange(0, BLOCK_ALL)
        m_a = o_a < E
        b_l = tl.load(p_logits + i_t * E + o_a, mask=m_a, other=float("-inf"), volatile=True)
        _topk_store(b_l, o_a, m_a, p_w, p_ids, i_t, TOP_K, K_PAD, RENORM)
        tl.atomic_xchg(p_count + i_t, 0, sem="relaxed", scope="gpu")


def moe_router(x: torch.Tensor, router: torch.Tensor, k: int, renorm: bool,
               scratch: tuple[torch.Tensor, torch.Tensor],
               tile: RouterTile | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[T, D]`` (float, contiguous, T <= MAX_TOKENS), router float32 ``[E, D]`` (contiguous)
    -> (weights float32 ``[T, k]``, ids int32 ``[T, k]``) as ``moe_route(x W_r^T, k, renorm)``.
    ``scratch``: a ``RouterScratch``'s (logits, counters) for E on x's device. ``tile``: the
    launch (default ``RouterTile()``)."""
    if x.dim() != 2 or not x.is_contiguous() or not x.dtype.is_floating_point:
        raise ValueError(f"moe_router: x must be contiguous float [T, D], got {x.dtype} {tuple(x.shape)}")
    t, d = x.shape
    if router.dim() != 2 or router.shape[1] != d or router.dtype != torch.float32 or not router.is_contiguous():
        raise ValueError(f"moe_router: router must be contiguous float32 [E, {d}], got {router.dtype} "
                         f"{tuple(router.shape)}")  # fmt: skip
    e = router.shape[0]
    if not 1 <= e <= MAX_EXPERTS:
        raise ValueError(f"moe_router: E = {e} experts not in 1..{MAX_EXPERTS}")
    if not (isinstance(k, int) and 1 <= k <= min(e, MAX_TOP_K)):
        raise ValueError(f"moe_router: k = {k} not in 1..min(E = {e}, {MAX_TOP_K})")
    if t > MAX_TOKENS:
        raise ValueError(f"moe_router: {t} tokens, at most {MAX_TOKENS}")
    logits, count = scratch
    if logits.shape != (MAX_TOKENS, e) or count.shape != (MAX_TOKENS,) or logits.device != x.device:
        raise ValueError(f"moe_router: scratch for E = {logits.shape[1]} on {logits.device}, want "
                         f"E = {e} on {x.device}")  # fmt: skip
    if router.device != x.device:
        raise ValueError(f"moe_router: router on {router.device}, x on {x.device}")
    weights = torch.empty((t, k), dtype=torch.float32, device=x.device)
    ids = torch.empty((t, k), dtype=torch.int32, device=x.device)
    tile = tile or RouterTile()
    if t:
        n_split = triton.cdiv(e, tile.block_e)
        _router_kernel[(t, n_split)](
            x, router, logits, count, weights, ids, e, d, n_split, TOP_K=k,
            K_PAD=triton.next_power_of_2(k), BLOCK_E=tile.block_e,
            BLOCK_D=min(tile.block_d, triton.next_power_of_2(d)),
            BLOCK_ALL=max(16, triton.next_power_of_2(e)), RENORM=bool(renorm), num_warps=tile.num_warps,
            AHEAD=ahead_on(x.device), **launch_options(pdl_on(x.device)),
        )  # fmt: skip
    return weights, ids
