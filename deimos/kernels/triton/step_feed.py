"""A decode graph's own inputs in one launch each (Triton): ``decode_slots`` (each row's key
slot from its block table and position: a gather, two divisions and three arithmetic launches
in torch) and ``feed`` (the sampled ids as the next tokens, the positions advanced: a clamp, a
copy and an add). Oracle: deimos.kernels.step_feed."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deimos.quant.triton.pdl import launch_options, pdl_on, pdl_start

MAX_ROWS = 4096  # one program holds every row


@triton.jit
def _decode_slots_kernel(p_tab, p_pos, p_slot, B, MAXB, BS, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    o = tl.arange(0, BLOCK)
    m = o < B
    pos = tl.load(p_pos + o, mask=m, other=0)
    # the block index clamped into the table: never a read outside it (the engine allocates a
    # row's block before its position reaches it)
    j = tl.minimum(tl.maximum(pos // BS, 0), MAXB - 1)
    blk = tl.load(p_tab + o.to(tl.int64) * MAXB + j, mask=m, other=0).to(tl.int64)
    tl.store(p_slot + o, blk * BS + pos % BS, mask=m)


@triton.jit
def _feed_kernel(p_ids, p_tok, p_pos, B, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    o = tl.arange(0, BLOCK)
    m = o < B
    ids = tl.load(p_ids + o, mask=m, other=0)
    tl.store(p_tok + o, tl.maximum(ids, 0), mask=m)
    pos = tl.load(p_pos + o, mask=m, other=0)
    tl.store(p_pos + o, pos + 1, mask=m)


def _rows(name: str, t: torch.Tensor, dtype: torch.dtype, b: int) -> None:
    if t.dtype != dtype or t.shape != (b,) or not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous {dtype} [{b}], got {t.dtype} {tuple(t.shape)}")


def decode_slots(tables: torch.Tensor, positions: torch.Tensor, block_size: int,
                 out: torch.Tensor) -> torch.Tensor:
    """``out`` (int64 ``[B]``) = decode_slots_reference(tables, positions, block_size): tables
    contiguous int32 ``[B, MAXB]``, positions int64 ``[B]``, all on one device."""
    if tables.dtype != torch.int32 or tables.dim() != 2 or not tables.is_contiguous():
        raise ValueError(f"decode_slots: tables must be contiguous int32 [B, MAXB], got {tables.dtype} "
                         f"{tuple(tables.shape)}")  # fmt: skip
    b, maxb = tables.shape
    _rows("decode_slots: positions", positions, torch.int64, b)
    _rows("decode_slots: out", out, torch.int64, b)
    if not 1 <= b <= MAX_ROWS or maxb < 1 or block_size < 1:
        raise ValueError(f"decode_slots: {b} rows (1..{MAX_ROWS}), {maxb} blocks, block size {block_size}")
    _decode_slots_kernel[(1,)](tables, positions, out, b, maxb, block_size,
                               BLOCK=triton.next_power_of_2(b), num_warps=4 if b > 128 else 1,
                               **launch_options(pdl_on(out.device)))  # fmt: skip
    return out


def feed(ids: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> None:
    """In place, as feed_reference: tokens = max(ids, 0), positions += 1 (each int64 ``[B]``)."""
    if tokens.dim() != 1:
        raise ValueError(f"feed: tokens must be contiguous torch.int64 [B], got {tuple(tokens.shape)}")
    b = tokens.shape[0]
    for name, t in (("ids", ids), ("tokens", tokens), ("positions", positions)):
        _rows(f"feed: {name}", t, torch.int64, b)
    if not 1 <= b <= MAX_ROWS:
        raise ValueError(f"feed: {b} rows, not in 1..{MAX_ROWS}")
    _feed_kernel[(1,)](ids, tokens, positions, b, BLOCK=triton.next_power_of_2(b),
                       num_warps=4 if b > 128 else 1, **launch_options(pdl_on(tokens.device)))
