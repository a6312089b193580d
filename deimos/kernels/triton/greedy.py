"""Greedy choice on the device, ending a decode step's CUDA graph: the argmax of the logits
(ties to the lowest id, as ``torch.argmax`` and the sampler's greedy path), written where the
next replay reads its token, and the position advanced by one. Replays then follow each other
with no host round trip between them (engine/generator.py reads each token a step behind).
Oracle: ``greedy_reference``.

One launch: ``N_PROG`` programs each reduce a slice of the vocabulary and store a partial
(max, its lowest id, whether the slice held a NaN); the last program to finish (an atomic
counter, reset by that program, so a graph can replay it) reduces the partials. A NaN
anywhere gives token -1 (the host raises, as the sampler does on NaN logits) and feeds token 0
to the next step, so a bad step never indexes past the embedding table.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048
MAX_PROGRAMS = 64


@triton.jit
def _greedy_kernel(p_x, V, CHUNK, p_val, p_idx, p_nan, p_count, p_token, p_next,
                   N_PROG: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    o = tl.arange(0, BLOCK)
    best_v = tl.full([], float("-inf"), tl.float32)
    best_i = tl.full([], 0, tl.int32)
    nan = tl.full([], 0, tl.int32)
    lo = pid * CHUNK
    for s0 in range(lo, lo + CHUNK, BLOCK):
        idx = s0 + o
        x = tl.load(p_x + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        nan = tl.maximum(nan, tl.max((x != x).to(tl.int32), axis=0))
        v = tl.max(x, axis=0)
        i = s0 + tl.argmax(x, axis=0, tie_break_left=True).to(tl.int32)
        best_i = tl.where(v > best_v, i, best_i)  # strictly greater: the earlier id on a tie
        best_v = tl.maximum(best_v, v)
    tl.store(p_val + pid, best_v)
    tl.store(p_idx + pid, best_i)
    tl.store(p_nan + pid, nan)
    done = tl.atomic_add(p_count, 1, sem="acq_rel")  # releases this partial, acquires the others
    if done == N_PROG - 1:
        o_p = tl.arange(0, N_PROG)
        vals = tl.load(p_val + o_p, volatile=True)
        ids = tl.load(p_idx + o_p, volatile=True)
        any_nan = tl.max(tl.load(p_nan + o_p, volatile=True), axis=0)
        top = tl.max(vals, axis=0)
        # a slice holds ids above every earlier slice's: the lowest id among the maxima
        tok = tl.min(tl.where(vals == top, ids, 2147483647), axis=0)
        tok = tl.where(any_nan > 0, -1, tok).to(tl.int64)
        tl.store(p_token, tok)
        tl.store(p_next, tl.maximum(tok, 0))
        tl.store(p_next + 1, tl.load(p_next + 1) + 1)
        tl.atomic_xchg(p_count, 0)


class GreedyState:
    """The buffers one chain of greedy steps uses (the partials and the counter), made once,
    outside any graph: the counter starts at zero and every launch leaves it at zero."""

    def __init__(self, n_vocab: int, device: torch.device | str):
        self.n_vocab = n_vocab
        self.chunk, self.n_prog = self.programs(n_vocab)
        self.val = torch.empty(self.n_prog, dtype=torch.float32, device=device)
        self.idx = torch.empty(self.n_prog, dtype=torch.int32, device=device)
        self.nan = torch.empty(self.n_prog, dtype=torch.int32, device=device)
        self.count = torch.zeros(1, dtype=torch.int32, device=device)


    @staticmethod
    def programs(n_vocab: int) -> tuple[int, int]:
        """(vocabulary entries a program, programs): at most MAX_PROGRAMS slices of whole
        BLOCKs, the count a power of two (slices past the vocabulary are empty)."""
        chunk = triton.cdiv(triton.cdiv(n_vocab, MAX_PROGRAMS), BLOCK) * BLOCK
        return chunk, triton.next_power_of_2(triton.cdiv(n_vocab, chunk))


def greedy_next(logits: torch.Tensor, state: GreedyState, token: torch.Tensor,
                feed: torch.Tensor) -> None:
    """``token`` (int64 [1]) = argmax of ``logits`` (float [V], -1 on NaN); ``feed`` (int64,
    at least 2: [next token, its position]) gets max(token, 0) and its position + 1."""
    if logits.dim() != 1 or logits.shape[0] != state.n_vocab:
        raise ValueError(f"greedy_next: logits must be [{state.n_vocab}], got {tuple(logits.shape)}")
    if token.dtype != torch.int64 or feed.dtype != torch.int64 or feed.numel() < 2:
        raise ValueError("greedy_next: token and feed must be int64 (feed: [token, position])")
    _greedy_kernel[(state.n_prog,)](
        logits, state.n_vocab, state.chunk, state.val, state.idx, state.nan, state.count,
        token, feed, N_PROG=state.n_prog, BLOCK=BLOCK, num_warps=4,
    )  # fmt: skip


def greedy_reference(logits: torch.Tensor) -> int:
    """What ``greedy_next`` writes to ``token``: the first maximum's id, -1 on NaN."""
    return -1 if bool(torch.isnan(logits).any()) else int(torch.argmax(logits))
