"""Sampling of B rows on the device, each with its own settings, inside a decode step's CUDA
graph: no host synchronisation, no data-dependent shape, every buffer in ``SampleScratch``.
Oracle: deimos.kernels.sample_batch.sample_rows_reference (the sampler's own code, per row);
which rows the window decides, and why, is in that module's docstring.

The launches, in order (five at V = 151,936):
1. ``_penalize_kernel``, grid (B,): llama.cpp's penalties applied in place at each row's
   pen_ids (the float32 ops of ``apply_penalties``, no FMA contraction), the raw values saved.
2. ``_window_block_kernel``, grid (blocks of 4096, B): a masked row's forbidden tokens read as
   NEG (its allowed-token words, a grammar's: the logits are not written), then the top-k
   stage 1 of deimos.kernels.triton.sampling (the 256 best order keys of each block; here by
   a 32-step search over the value bits, ties at the cut taken by position, which is id order
   in a block: ``_store_top_block_keys``) fused with the block's float64 logsumexp partial
   (max, sum of exp) and a NaN flag: the one pass over [B, V]. A greedy row (temperature 0)
   keeps only its block's first maximum (slot 0; no counting passes).
3. ``_window_merge_kernel``, one launch per merge pass (sampling.py's merge; a greedy row
   keeps only the maximum): 256 keys per row left.
4. ``_row_kernel``, grid (B,): restores the penalized logits; a greedy row's token is the
   window's maximum; a sampled row's 256 keys are ordered (each key's
   rank by counting, then a scatter: no sort network), and applies the row's top_k, top_p
   (softmax of the k candidates, or over the whole vocabulary's logsumexp when top_k is off),
   min_p (``logit >= max + log(min_p)`` in float32), the temperature, float64 probabilities,
   their cumulative sum and the first index whose sum exceeds ``u`` times the total, clipped;
   in ascending id order when min_p alone filters (as ``filter_candidates`` returns that set).

Cost at B = 64, V = 151,936 (Qwen's vocabulary; 38 blocks of 4096): one read of the logits
(64 x 151,936 x 4 B = 38.9 MB), the stage-1 keys written and read once (64 x 38 x 256 x 8 B
= 5.0 MB each way), the merge passes 38 -> 3 -> 1 (0.4 MB), the row kernel's 0.13 MB of keys
and under 0.5 MB of scratch, and 2 x 64 x L gathers/scatters of the penalties: about 50 MB
in all, ~13 us at 4 TB/s. Stage 1's 32 counting passes over each block's 4096 values (2,432
programs of 256 threads at 87 registers on Triton 3.9, 103 on 3.6: 2 resident per SM) and
the merges' 64 passes over 4096 keys (192 + 64 programs) are compute and latency, not bytes,
and likely dominate; not yet timed on the H200.

Exactness: every comparison is the sampler's, in its precision (float32 penalties and min_p
threshold, float64 probabilities, top_p, u); the ids equal the oracle's except where a float64
cumulative sum lands within an ulp of a cut (device and host exp/log/sum round differently at
the last bit), or log(min_p) rounds to another float32 (libdevice's log is within 1 ulp of
the host's, so only at a float32 rounding tie): measure-zero events. The logits are
bitwise unchanged when ``sample_rows`` returns, but hold the penalized values between launches
1 and 4: nothing else may read them meanwhile (same stream, as a graph runs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deimos.kernels.sample_batch import (  # noqa: F401  (re-exported)
    EXACT,
    HOST,
    NAN_ROW,
    WINDOW,
    SamplingRows,
    sample_rows_reference,
)
from deimos.kernels.token_mask import NEG as MASKED_LOGIT
from deimos.kernels.token_mask import n_words
from deimos.kernels.triton.sampling import (
    INT64_MIN,
    TOPK_BLOCK,
    TOPK_MERGE,
    _order_bits,
    _order_keys,
    _store_top_block_keys,
    _store_top_keys,
    merge_inputs,
    topk_passes,
)

NEG = tl.constexpr(MASKED_LOGIT)
PEN_BLOCK = 128  # penalized ids per step of _penalize_kernel / the restore
RANK_CHUNK = 32  # keys ranked per step of the row kernel: [32, 256] compares
NO_FUSION = {"enable_fp_fusion": False}  # a*b + c rounded twice, as torch does on the host
_BIG = tl.constexpr(1 << 30)


@triton.jit
def _penalty_entries(p_ids, p_cnt, i_b, L, l0, V, BLOCK_L: tl.constexpr):
    """Entries l0 .. l0 + BLOCK_L of row i_b's penalty window: (offsets, ids, counts, the mask
    of the entries in use)."""
    o_l = l0 + tl.arange(0, BLOCK_L)
    m_l = o_l < L
    b_id = tl.load(p_ids + i_b * L + o_l, mask=m_l, other=0)
    b_c = tl.load(p_cnt + i_b * L + o_l, mask=m_l, other=0)
    return o_l, b_id, b_c, m_l & (b_c > 0) & (b_id >= 0) & (b_id < V)


@triton.jit
def _penalize_kernel(p_x, stride_x, V, p_ids, p_cnt, p_saved, L, p_rep, p_freq, p_pres,
                     BLOCK_L: tl.constexpr):  # fmt: skip
    i_b = tl.program_id(0).to(tl.int64)
    rep = tl.load(p_rep + i_b)
    freq = tl.load(p_freq + i_b)
    pres = tl.load(p_pres + i_b)
    for l0 in range(0, L, BLOCK_L):
        o_l, b_id, b_c, m_p = _penalty_entries(p_ids, p_cnt, i_b, L, l0, V, BLOCK_L)
        p_row = p_x + i_b * stride_x + b_id
        b_x = tl.load(p_row, mask=m_p, other=0.0)
        tl.store(p_saved + i_b * L + o_l, b_x, mask=m_p)
        b_s = tl.where(b_x <= 0, b_x * rep, tl.math.div_rn(b_x, rep))
        b_pen = b_c.to(tl.float32) * freq + tl.where(b_c > 0, 1.0, 0.0) * pres
        tl.store(p_row, b_s - b_pen, mask=m_p)


@triton.jit
def _restore(p_x, stride_x, V, p_ids, p_cnt, p_saved, L, i_b, BLOCK_L: tl.constexpr):
    for l0 in range(0, L, BLOCK_L):
        o_l, b_id, _, m_p = _penalty_entries(p_ids, p_cnt, i_b, L, l0, V, BLOCK_L)
        b_x = tl.load(p_saved + i_b * L + o_l, mask=m_p, other=0.0)
        tl.store(p_x + i_b * stride_x + b_id, b_x, mask=m_p)


@triton.jit
def _store_greedy_key(key, p_out, K_PAD: tl.constexpr):
    """A greedy row's window: only its largest key matters (slot 0; the rest padding)."""
    o_k = tl.arange(0, K_PAD)
    top = tl.max(key, axis=0)
    tl.store(p_out + o_k, tl.where(o_k == 0, top, INT64_MIN))


@triton.jit
def _window_block_kernel(p_x, p_keys, p_bmax, p_bsum, p_bnan, V, stride_b, N_BLOCKS, p_temp,
                         p_words, stride_w, p_masked, BLOCK: tl.constexpr, K_PAD: tl.constexpr,
                         MASKED: tl.constexpr):  # fmt: skip
    i_blk = tl.program_id(0)
    i_b = tl.program_id(1).to(tl.int64)
    o_v = i_blk * BLOCK + tl.arange(0, BLOCK)
    m_v = o_v < V
    b_x = tl.load(p_x + i_b * stride_b + o_v, mask=m_v, other=float("-inf"))
    if MASKED:  # the row's allowed-token mask (a grammar's): the tokens it forbids are NEG
        if tl.load(p_masked + i_b) != 0:
            word = tl.load(p_words + i_b * stride_w + (o_v >> 5), mask=m_v, other=-1)
            b_x = tl.where(((word >> (o_v & 31)) & 1) != 0, b_x, NEG)
    mx = tl.max(b_x, axis=0)
    nan = tl.max((b_x != b_x).to(tl.int32), axis=0)
    # float64 as torch.logsumexp(logits.double()); a block of -inf has no mass (sum 0)
    shift = tl.where(mx > float("-inf"), mx, 0.0).to(tl.float64)
    s = tl.sum(tl.exp(b_x.to(tl.float64) - shift), axis=0)
    o_p = i_b * N_BLOCKS + i_blk
    tl.store(p_bmax + o_p, mx)
    tl.store(p_bsum + o_p, s)
    tl.store(p_bnan + o_p, nan)
    key = _order_keys(b_x, o_v, m_v)
    if tl.load(p_temp + i_b) == 0.0:  # greedy: the block's first maximum, no counting passes
        _store_greedy_key(key, p_keys + o_p * K_PAD, K_PAD)
    else:
        _store_top_block_keys(_order_bits(b_x, m_v), key, p_keys + o_p * K_PAD, K_PAD)


@triton.jit
def _window_merge_kernel(p_in, p_out, N_IN, N_OUT, p_temp,
                         MERGE: tl.constexpr, K_PAD: tl.constexpr):  # fmt: skip
    """deimos.kernels.triton.sampling's merge pass, a greedy row's keeping only its maximum."""
    key, p_o = merge_inputs(p_in, p_out, N_IN, N_OUT, MERGE, K_PAD)
    if tl.load(p_temp + tl.program_id(1).to(tl.int64)) == 0.0:
        _store_greedy_key(key, p_o, K_PAD)
    else:
        _store_top_keys(key, p_o, K_PAD)


@triton.jit
def _row_kernel(p_keys, p_bmax, p_bsum, p_bnan, N_BLOCKS, V,
                p_temp, p_topk, p_topp, p_minp, p_u,
                p_x, stride_x, p_ids, p_cnt, p_saved, L,
                p_sorted, p_prob, p_by_id, p_by_p, p_out_id, p_out_flag,
                K: tl.constexpr, CH: tl.constexpr, NB_PAD: tl.constexpr,
                BLOCK_L: tl.constexpr):  # fmt: skip
    i_b = tl.program_id(0).to(tl.int64)
    _restore(p_x, stride_x, V, p_ids, p_cnt, p_saved, L, i_b, BLOCK_L)

    # the row's logsumexp over the vocabulary, and whether it holds a NaN
    o_n = tl.arange(0, NB_PAD)
    m_n = o_n < N_BLOCKS
    b_bm = tl.load(p_bmax + i_b * N_BLOCKS + o_n, mask=m_n, other=float("-inf")).to(tl.float64)
    b_bs = tl.load(p_bsum + i_b * N_BLOCKS + o_n, mask=m_n, other=0.0)
    nan = tl.max(tl.load(p_bnan + i_b * N_BLOCKS + o_n, mask=m_n, other=0), axis=0)
    gmax = tl.max(b_bm, axis=0)
    lse = gmax + tl.log(tl.sum(b_bs * tl.exp(b_bm - gmax), axis=0))

    temp = tl.load(p_temp + i_b)
    o_k = tl.arange(0, K)
    if temp == 0.0:  # greedy: the window holds the row's first maximum in slot 0, nothing to order
        top = tl.max(tl.load(p_keys + i_b * K + o_k), axis=0)
        tl.store(p_out_id + i_b, tl.where(nan > 0, -1, 0xFFFFFFFF - (top & 0xFFFFFFFF)))
        tl.store(p_out_flag + i_b, tl.where(nan > 0, 2, 0))
    else:
        # order the K candidates: a key's rank is the number of bigger keys (keys are distinct)
        p_in = p_keys + i_b * K
        p_srt = p_sorted + i_b * K
        b_key = tl.load(p_in + o_k)
        for c in range(0, K, CH):
            o_c = c + tl.arange(0, CH)
            b_c = tl.load(p_in + o_c)
            rank = tl.sum((b_key[None, :] > b_c[:, None]).to(tl.int32), axis=1)
            tl.store(p_srt + rank, b_c)
        tl.debug_barrier()
        b_key = tl.load(p_srt + o_k, cache_modifier=".cg")
        hi = (b_key >> 32).to(tl.int32)
        b_val = tl.where(hi < 0, hi ^ 0x7FFFFFFF, hi).to(tl.float32, bitcast=True)
        b_id = 0xFFFFFFFF - (b_key & 0xFFFFFFFF)
        vmax = tl.max(b_val, axis=0)  # the first candidate's
        x64 = b_val.to(tl.float64)

        top_k = tl.load(p_topk + i_b)
        top_p = tl.load(p_topp + i_b)
        min_p = tl.load(p_minp + i_b)
        u = tl.load(p_u + i_b)
        k = tl.where((top_k > 0) & (top_k < V), top_k, 0)
        k_in = (k > 0) & (k <= K)
        # each filter's kept-prefix length when the window shows its end (found), else a lower
        # bound of it (lower); _BIG: no bound
        found = tl.where(k_in, k, _BIG)
        lower = tl.full([], _BIG, tl.int32)
        if top_p < 1.0:
            # over the k candidates (softmax at temperature 1), or the vocabulary's logsumexp
            m_k = o_k < k
            e_k = tl.where(m_k, tl.exp(x64 - vmax.to(tl.float64)), 0.0)
            # (a sum of k_in's e_k is >= 1, its first term being exp(0): the maximum only keeps
            # the k == 0 rows' unused lanes finite)
            q = tl.where(k_in, e_k / tl.maximum(tl.sum(e_k, axis=0), 1.0), tl.exp(x64 - lse))
            hit = (tl.cumsum(q, axis=0) >= top_p) & (m_k | (k == 0))
            n_p = tl.min(tl.where(hit, o_k, K), axis=0) + 1  # K + 1: not within the window
            found = tl.where(k_in | ((k == 0) & (n_p <= K)), tl.minimum(found, n_p), found)
            # unseen over the vocabulary: more than K, never below a found size; unseen after a
            # top_k above K: any size
            lower = tl.where(k > K, 1, lower)
        if min_p > 0.0:
            thr = vmax + tl.log(min_p).to(tl.float32)  # float32 sum, as filter_candidates
            n_g = tl.sum((b_val >= thr).to(tl.int32), axis=0)
            found = tl.where(n_g < K, tl.minimum(found, n_g), found)
            lower = tl.where(n_g < K, lower, tl.minimum(lower, K))
        greedy = temp == 0.0
        decided = greedy | ((found <= K) & (found <= lower))
        n = tl.where(greedy, 1, tl.minimum(found, K))

        # the draw over the first n candidates, at the temperature, in float64
        m_s = o_k < n
        z = x64 / tl.where(greedy, 1.0, temp)
        e = tl.where(m_s, tl.exp(z - tl.max(z, axis=0)), 0.0)
        q = e / tl.sum(e, axis=0)
        q_id = b_id
        if (k == 0) & (top_p >= 1.0) & decided & (temp > 0.0):
            # min_p alone: filter_candidates lists the set in ascending id order
            p_pr = p_prob + i_b * K
            p_bi = p_by_id + i_b * K
            p_bp = p_by_p + i_b * K
            tl.store(p_pr + o_k, q)
            tl.debug_barrier()
            for c in range(0, K, CH):
                o_c = c + tl.arange(0, CH)
                hc = (tl.load(p_srt + o_c, cache_modifier=".cg") & 0xFFFFFFFF)
                id_c = 0xFFFFFFFF - hc
                q_c = tl.load(p_pr + o_c, cache_modifier=".cg")
                before = (b_id[None, :] < id_c[:, None]) & m_s[None, :]
                rank = tl.sum(before.to(tl.int32), axis=1)
                tl.store(p_bi + rank, id_c, mask=o_c < n)
                tl.store(p_bp + rank, q_c, mask=o_c < n)
            tl.debug_barrier()
            q = tl.load(p_bp + o_k, mask=m_s, other=0.0, cache_modifier=".cg")
            q_id = tl.load(p_bi + o_k, mask=m_s, other=0, cache_modifier=".cg")
        cum = tl.cumsum(q, axis=0)
        target = u * tl.sum(tl.where(o_k == n - 1, cum, 0.0), axis=0)
        i = tl.minimum(tl.sum(((cum <= target) & m_s).to(tl.int32), axis=0), n - 1)
        tok = tl.sum(tl.where(o_k == i, q_id, 0), axis=0)
        flag = tl.where(nan > 0, 2, tl.where(decided, 0, 1))
        tl.store(p_out_id + i_b, tl.where(flag == 0, tok, -1))
        tl.store(p_out_flag + i_b, flag)


class SampleScratch:
    """Every intermediate of ``sample_rows`` for up to ``n_rows`` rows of ``n_vocab`` logits
    and ``width`` penalized ids per row, made once (outside any graph). Graphs of smaller
    batches may share it (they never run at once)."""

    def __init__(self, n_rows: int, n_vocab: int, width: int, device: torch.device | str):
        if n_vocab <= WINDOW:
            raise ValueError(f"SampleScratch: the vocabulary ({n_vocab}) must exceed the "
                             f"window of {WINDOW}")
        if n_rows < 1 or width < 1:
            raise ValueError(f"SampleScratch: need n_rows >= 1 and width >= 1, got {n_rows}, {width}")
        if n_vocab >= 2**31:
            raise ValueError(f"SampleScratch: vocabulary of {n_vocab} does not fit int32 ids")
        self.n_rows, self.n_vocab, self.width = n_rows, n_vocab, width
        self.passes = topk_passes(n_vocab, WINDOW)  # lists after stage 1 and each merge
        i64, f64 = torch.int64, torch.float64
        self.keys = [torch.empty((n_rows, n, WINDOW), dtype=i64, device=device) for n in self.passes]
        n_blk = self.passes[0]
        self.block_max = torch.empty((n_rows, n_blk), dtype=torch.float32, device=device)
        self.block_sum = torch.empty((n_rows, n_blk), dtype=f64, device=device)
        self.block_nan = torch.empty((n_rows, n_blk), dtype=torch.int32, device=device)
        self.saved = torch.empty((n_rows, width), dtype=torch.float32, device=device)
        self.sorted = torch.empty((n_rows, WINDOW), dtype=i64, device=device)
        self.prob = torch.empty((n_rows, WINDOW), dtype=f64, device=device)
        self.by_id = torch.empty((n_rows, WINDOW), dtype=i64, device=device)
        self.by_id_prob = torch.empty((n_rows, WINDOW), dtype=f64, device=device)


def _check(logits: torch.Tensor, rows: SamplingRows, out_ids: torch.Tensor,
           out_flags: torch.Tensor, scratch: SampleScratch) -> None:
    v, w = scratch.n_vocab, scratch.width
    b = logits.shape[0] if logits.dim() == 2 else -1
    if (logits.dim() != 2 or not 1 <= b <= scratch.n_rows or logits.shape[1] != v
            or logits.dtype != torch.float32 or logits.stride(1) != 1):
        raise ValueError(f"sample_rows: logits must be float32 [B <= {scratch.n_rows}, {v}] with "
                         f"contiguous rows (the scratch's sizes), got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    want = dict(temperature=(torch.float64, (b,)), top_k=(torch.int32, (b,)),
                top_p=(torch.float64, (b,)), min_p=(torch.float64, (b,)),
                repeat=(torch.float32, (b,)), frequency=(torch.float32, (b,)),
                presence=(torch.float32, (b,)), u=(torch.float64, (b,)),
                pen_ids=(torch.int64, (b, w)), pen_counts=(torch.int32, (b, w)),
                out_ids=(torch.int64, (b,)), out_flags=(torch.int32, (b,)))  # fmt: skip
    named = {**rows._asdict(), "out_ids": out_ids, "out_flags": out_flags}
    for name, (dt, shape) in want.items():
        t = named[name]
        if t.dtype != dt or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"sample_rows: {name} must be contiguous {dt} {list(shape)}, "
                             f"got {t.dtype} {list(t.shape)}")
        if t.device != logits.device:
            raise ValueError(f"sample_rows: {name} is on {t.device}, the logits on {logits.device}")


def _check_mask(logits: torch.Tensor, words: torch.Tensor, masked: torch.Tensor) -> None:
    n_b, v = logits.shape
    if (words.dtype != torch.int32 or words.dim() != 2 or words.shape[0] < n_b
            or words.shape[1] < n_words(v) or words.stride(1) != 1
            or masked.dtype != torch.int32 or masked.dim() != 1 or masked.numel() < n_b
            or words.device != logits.device or masked.device != logits.device):  # fmt: skip
        raise ValueError(f"sample_rows: words must be int32 [>= {n_b}, >= {n_words(v)}] with "
                         f"unit column stride and masked int32 [>= {n_b}], on the logits' "
                         f"device, got {words.dtype} {tuple(words.shape)} on {words.device} "
                         f"and {masked.dtype} {tuple(masked.shape)} on {masked.device}")


def sample_rows(logits: torch.Tensor, rows: SamplingRows, out_ids: torch.Tensor,
                out_flags: torch.Tensor, scratch: SampleScratch,
                words: torch.Tensor | None = None, masked: torch.Tensor | None = None) -> None:
    """Sample one token per row of ``logits`` (float32 [B, V], V > 256, rows contiguous) with
    each row's settings ``rows`` (``SamplingRows``: float64/int32/float32 [B], pen_ids int64
    and pen_counts int32 [B, L]; B <= ``scratch.n_rows``, L = ``scratch.width``; a row's used
    pen_ids distinct, or the restore can leave a penalized value behind).

    Writes ``out_ids`` (int64 [B]: the token, -1 on a flagged row) and ``out_flags`` (int32
    [B]: 0 EXACT, the id equals ``Sampler.sample`` of the row with the row's u; 1 HOST, the
    256-candidate window cannot decide the row, the host samples it from the same logits and
    u; 2 NAN_ROW, the row holds a NaN). ``words`` and ``masked`` (both or neither): allowed-
    token masks (int32 [>= B, >= n_words(V)], bit j of word w allows token 32 w + j) and
    which rows have one (int32 [>= B], nonzero: masked); a masked row is sampled as if every
    token its mask forbids had the logit NEG after the penalties (a NaN there does not count).
    ``logits`` are unchanged on return. Makes no host synchronisation and allocates nothing:
    capturable in a CUDA graph."""
    _check(logits, rows, out_ids, out_flags, scratch)
    if (words is None) != (masked is None):
        raise ValueError("sample_rows: words and masked go together")
    if words is not None:
        _check_mask(logits, words, masked)
    n_b, v = logits.shape
    w = scratch.width
    _penalize_kernel[(n_b,)](
        logits, logits.stride(0), v, rows.pen_ids, rows.pen_counts, scratch.saved, w,
        rows.repeat, rows.frequency, rows.presence, BLOCK_L=PEN_BLOCK, num_warps=4, **NO_FUSION,
    )  # fmt: skip
    n_blk = scratch.passes[0]
    _window_block_kernel[(n_blk, n_b)](
        logits, scratch.keys[0], scratch.block_max, scratch.block_sum, scratch.block_nan, v,
        logits.stride(0), n_blk, rows.temperature,
        logits if words is None else words, 0 if words is None else words.stride(0),
        out_flags if masked is None else masked,
        BLOCK=TOPK_BLOCK, K_PAD=WINDOW, MASKED=words is not None, num_warps=8, **NO_FUSION,
    )  # fmt: skip
    for i, (n_in, n_out) in enumerate(zip(scratch.passes, scratch.passes[1:])):
        _window_merge_kernel[(n_out, n_b)](
            scratch.keys[i], scratch.keys[i + 1], n_in, n_out, rows.temperature, MERGE=TOPK_MERGE,
            K_PAD=WINDOW, num_warps=8,
        )  # fmt: skip
    _row_kernel[(n_b,)](
        scratch.keys[-1], scratch.block_max, scratch.block_sum, scratch.block_nan, n_blk, v,
        rows.temperature, rows.top_k, rows.top_p, rows.min_p, rows.u,
        logits, logits.stride(0), rows.pen_ids, rows.pen_counts, scratch.saved, w,
        scratch.sorted, scratch.prob, scratch.by_id, scratch.by_id_prob, out_ids, out_flags,
        K=WINDOW, CH=RANK_CHUNK, NB_PAD=max(2, triton.next_power_of_2(n_blk)),
        BLOCK_L=PEN_BLOCK, num_warps=4, **NO_FUSION,
    )  # fmt: skip
