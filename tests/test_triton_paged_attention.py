"""Attention through a paged KV cache (block tables) for batches of sequences.

Oracles: deimos.kernels.attention.paged_attention_reference (gather a sequence's keys through
its table row, then causal_attention in float32), the reference RoPE (float64 angles) and
RMSNorm for the fused new token, quantize_x of the stored output for the fused QuantizedX,
and the kernel itself one sequence at a time for "a packed varlen call equals a loop". The
prefill runs in one launch (n_split 1) and key-split (partials merged by decode attention's
combine), at its rule's counts and at forced ones over longer prefixes.
Pools are built with SHUFFLED block ids, the sequences' blocks interleaved; every pool row
that no sequence's keys occupy is NaN (the unused table entries point at a NaN block too),
and outputs are poisoned with NaN, so a read outside a sequence's keys or an unwritten
output shows. Relative RMS error, max difference printed.

Without CUDA the kernels run in Triton's interpreter: small shapes, the kernels' own tiles.
"""

from __future__ import annotations

import pytest
import torch

from kernel_device import DEVICE  # noqa: I001  (first: sets TRITON_INTERPRET)
import triton  # noqa: E402
from kernel_checks import close as _close  # noqa: E402
from kernel_checks import rand as _rand  # noqa: E402

from deimos.kernels import norm as ref_norm  # noqa: E402
from deimos.kernels import rope as ref_rope  # noqa: E402
from deimos.kernels.attention import paged_attention_reference, slots_of  # noqa: E402
from deimos.kernels.triton import (  # noqa: E402
    NewToken,
    apply_rope,
    decode_attention,
    paged_prefill_attention,
    prefill_tile_map,
    rope_inv_freq,
)
from deimos.kernels.triton.decode_attention import decode_config, variant_rows  # noqa: E402
from deimos.kernels.triton.prefill_attention import PrefillConfig, paged_prefill_split  # noqa: E402
from deimos.quant.triton.gemv_q8 import empty_quantized, quantize_x  # noqa: E402

NAN = float("nan")
F16 = torch.float16




def _poison(like: torch.Tensor) -> torch.Tensor:
    return torch.full(like.shape, NAN, dtype=like.dtype, device=like.device)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.int16)


class Paged:
    """Pools ``[n_blocks * bs, Hkv, D]`` fp16 and tables int32 ``[B, MAXB]``: sequence b owns
    cdiv(alloc[b], bs) blocks, handed out from a shuffled permutation round-robin over the
    sequences (interleaved); its keys 0..filled[b]-1 are random, every other row NaN. Unused
    table entries point at the NaN block ``spare``; ``scratch`` is a block of finite garbage
    that no sequence owns (a graph's padding rows point there)."""

    def __init__(self, alloc: list[int], filled: list[int], bs: int, hkv: int, d: int, seed: int,
                 extra_width: int = 1):  # fmt: skip
        need = [-(-n // bs) for n in alloc]
        n_blocks = sum(need) + 2
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(n_blocks, generator=g).tolist()
        self.spare, self.scratch = perm.pop(), perm.pop()
        width = max(need) + extra_width
        table = torch.full((len(alloc), width), self.spare, dtype=torch.int32)
        for j in range(max(need)):
            for b in range(len(alloc)):
                if j < need[b]:
                    table[b, j] = perm.pop()
        self.bs, self.width = bs, width
        self.k = torch.full((n_blocks * bs, hkv, d), NAN, dtype=F16)
        self.v = torch.full((n_blocks * bs, hkv, d), NAN, dtype=F16)
        for b, n in enumerate(filled):
            rows = slots_of(table[b], n, bs)
            self.k[rows] = _rand(n, hkv, d, seed=seed + 10 * b + 1, dtype=F16).cpu()
            self.v[rows] = _rand(n, hkv, d, seed=seed + 10 * b + 2, dtype=F16).cpu()
        rows = torch.arange(self.scratch * bs, (self.scratch + 1) * bs)
        self.k[rows] = _rand(bs, hkv, d, seed=seed + 7, dtype=F16).cpu()
        self.v[rows] = _rand(bs, hkv, d, seed=seed + 8, dtype=F16).cpu()
        self.table = table
        self.k, self.v = self.k.to(DEVICE), self.v.to(DEVICE)

    def tables(self) -> torch.Tensor:
        return self.table.to(DEVICE)

    def reference(self, q, positions, b: int, scale: float, window: int,
                  table_row: torch.Tensor | None = None, k=None, v=None):  # fmt: skip
        row = self.table[b] if table_row is None else table_row
        return paged_attention_reference(
            q.float().cpu(), (self.k if k is None else k).float().cpu(),
            (self.v if v is None else v).float().cpu(), torch.as_tensor(positions).long(), row,
            self.bs, scale, window)  # fmt: skip


def _case_id(c: tuple) -> str:
    lens, bs, hq, hkv, d, w = c
    return f"len{'-'.join(map(str, lens))}_bs{bs}_h{hq}x{hkv}_d{d}_w{w}"


def test_references() -> None:
    """slots_of on a hand-made table; paged_attention_reference over blocks scattered in a pool
    equals causal_attention over the same keys kept contiguous."""
    from deimos.kernels.attention import causal_attention

    row = torch.tensor([5, 2, 7], dtype=torch.int32)
    assert slots_of(row, 6, 2).tolist() == [10, 11, 4, 5, 14, 15]
    with pytest.raises(ValueError, match="more than the table's 3 blocks"):
        slots_of(row, 7, 2)
    n, bs, hq, hkv, d = 21, 4, 6, 2, 16
    k, v = torch.randn(n, hkv, d), torch.randn(n, hkv, d)
    table = torch.tensor([3, 0, 6, 1, 4, 2], dtype=torch.int32)
    k_pool = torch.full((8 * bs, hkv, d), NAN)
    v_pool = torch.full((8 * bs, hkv, d), NAN)
    k_pool[slots_of(table, n, bs)], v_pool[slots_of(table, n, bs)] = k, v
    q, pos = torch.randn(3, hq, d), torch.tensor([5, 19, 20])
    got = paged_attention_reference(q, k_pool, v_pool, pos, table, bs, 0.25, window=7)
    assert torch.equal(got, causal_attention(q, k, v, pos, torch.arange(n), 0.25, 7))


# ---- decode: B sequences, one query row each -----------------------------------------------------

DECODE_CASES = [
    # (sequence lengths = q_pos + 1, block size, Hq, Hkv, D, window)
    ((1,), 16, 4, 4, 64, 0),  # B = 1, G = 1, the first token
    ((17, 70, 1), 16, 8, 2, 64, 0),  # blocks of 16 < the key tile of 64
    ((70, 17, 1, 33, 129), 64, 8, 1, 128, 0),  # B = 5, G = 8
    ((70, 17, 5), 64, 4, 1, 64, 20),  # window
    ((40, 9, 100), 32, 16, 1, 64, 30),  # G = 16, window
    ((40, 9, 3), 16, 4, 2, 256, 0),  # D = 256 (key tile 32)
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=_case_id)
def test_paged_decode(case: tuple) -> None:
    lens, bs, hq, hkv, d, window = case
    pool = Paged(list(lens), list(lens), bs, hkv, d, seed=sum(lens) + d)
    q = _rand(len(lens), hq, d, seed=d, dtype=F16)
    pos = torch.tensor([n - 1 for n in lens], dtype=torch.int32, device=DEVICE)
    scale = d**-0.5
    out = decode_attention(q, pool.k, pool.v, pos, scale, window, out=_poison(q),
                           block_tables=pool.tables(), block_size=bs)  # fmt: skip
    for b, n in enumerate(lens):
        ref = pool.reference(q[b : b + 1], [n - 1], b, scale, window)
        _close(f"paged decode {case} row {b}", out[b : b + 1], ref, 3e-3)


def test_paged_decode_config_override() -> None:
    """A sweep's ``cfg`` (other key tiles, splits, warps and stages than the rule's) gives the
    reference's attention; a key tile that is not a power of two >= 16, or no split, is
    refused by name."""
    from deimos.kernels.triton.decode_attention import DecodeConfig

    lens, bs, hq, hkv, d = [70, 17], 16, 8, 2, 64
    pool = Paged(lens, lens, bs, hkv, d, seed=11)
    q = _rand(2, hq, d, seed=12, dtype=F16)
    pos = torch.tensor([69, 16], dtype=torch.int32, device=DEVICE)
    for cfg in (DecodeConfig(16, 1, 4, 2), DecodeConfig(32, 5, 2, 4), DecodeConfig(128, 2, 8, 3)):
        out = decode_attention(q, pool.k, pool.v, pos, d**-0.5, out=_poison(q),
                               block_tables=pool.tables(), block_size=bs, cfg=cfg)  # fmt: skip
        for b, n in enumerate(lens):
            _close(f"decode {cfg} row {b}", out[b : b + 1],
                   pool.reference(q[b : b + 1], [n - 1], b, d**-0.5, 0), 3e-3)
    for bad in (DecodeConfig(24, 2, 4), DecodeConfig(8, 2, 4), DecodeConfig(32, 0, 4)):
        with pytest.raises(ValueError, match="bad config"):
            decode_attention(q, pool.k, pool.v, pos, d**-0.5, block_tables=pool.tables(),
                             block_size=bs, cfg=bad)


def test_paged_decode_merged_in_the_split_launch() -> None:
    """``counters``: the last split of each (row, kv head) merges its heads' partials (over the
    splits that hold keys, 16 at a time: 38 of 64 splits for 600 keys in tiles of 16) in the
    split launch; the output, and its QuantizedX, match the two-launch path's, and every
    counter is zero again. Too few counters or another dtype are refused by name."""
    from deimos.kernels.triton.decode_attention import DecodeConfig

    lens, bs, hq, hkv, d = [600, 17, 1], 16, 8, 2, 64
    pool = Paged(lens, lens, bs, hkv, d, seed=21)
    q = _rand(3, hq, d, seed=22, dtype=F16)
    pos = torch.tensor([599, 16, 0], dtype=torch.int32, device=DEVICE)
    counters = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    for cfg in (DecodeConfig(16, 64, 4, 2), DecodeConfig(32, 5, 4, 2), DecodeConfig(64, 1, 4, 2)):
        kw = dict(block_tables=pool.tables(), block_size=bs, cfg=cfg)
        qx1, qx2 = empty_quantized(3, hq * d, DEVICE), empty_quantized(3, hq * d, DEVICE)
        two = decode_attention(q, pool.k, pool.v, pos, d**-0.5, out=_poison(q), quantized=qx1, **kw)
        one = decode_attention(q, pool.k, pool.v, pos, d**-0.5, out=_poison(q), quantized=qx2,
                               counters=counters, **kw)  # fmt: skip
        assert not counters.any()
        _close(f"merged {cfg}", one, two, 1e-5)  # float16 outputs: an ulp here and there
        for b, n in enumerate(lens):
            _close(f"merged {cfg} row {b}", one[b : b + 1], pool.reference(q[b : b + 1], [n - 1], b, d**-0.5, 0),
                   3e-3)  # fmt: skip
        want = quantize_x(one.reshape(3, -1))
        assert torch.equal(qx2.xq, want.xq) and torch.equal(qx2.xd, want.xd)
    for bad in (torch.zeros(5, dtype=torch.int32, device=DEVICE), torch.zeros(8, dtype=torch.int64, device=DEVICE)):
        with pytest.raises(ValueError, match="counters must be int32"):
            decode_attention(q, pool.k, pool.v, pos, d**-0.5, block_tables=pool.tables(), block_size=bs,
                             counters=bad)  # fmt: skip


def test_paged_decode_padding_row_and_quantized() -> None:
    """Row 1 is a CUDA graph's padding (q_pos 0, every table entry the scratch block): it runs
    like any sequence of one key; the others are untouched by it. The combine kernel's
    QuantizedX of the B rows equals quantize_x of the output it stored."""
    lens, bs, hq, hkv, d = [30, 1, 65], 16, 8, 2, 64
    pool = Paged(lens, lens, bs, hkv, d, seed=3)
    tables = pool.table.clone()
    tables[1] = pool.scratch
    q = _rand(3, hq, d, seed=4, dtype=F16)
    pos = torch.tensor([29, 0, 64], dtype=torch.int32, device=DEVICE)
    qx = empty_quantized(3, hq * d, DEVICE)
    out = decode_attention(q, pool.k, pool.v, pos, d**-0.5, out=_poison(q), quantized=qx,
                           block_tables=tables.to(DEVICE), block_size=bs)  # fmt: skip
    for b in range(3):
        ref = pool.reference(q[b : b + 1], [int(pos[b])], b, d**-0.5, 0, table_row=tables[b])
        _close(f"padded batch row {b}", out[b : b + 1], ref, 3e-3)
    want = quantize_x(out.reshape(3, -1))
    for name in ("xq", "xd", "xs"):
        assert torch.equal(getattr(qx, name), getattr(want, name)), f"QuantizedX {name} differs"


def test_paged_decode_many_rows() -> None:
    """B = 70 (past the 64 the engine plans for): one program per (row, kv head), no splits."""
    n_b, bs, hq, hkv, d = 70, 16, 2, 1, 32
    lens = [1 + (7 * b) % 40 for b in range(n_b)]
    pool = Paged(lens, lens, bs, hkv, d, seed=9)
    q = _rand(n_b, hq, d, seed=10, dtype=F16)
    pos = torch.tensor([n - 1 for n in lens], dtype=torch.int32, device=DEVICE)
    out = decode_attention(q, pool.k, pool.v, pos, d**-0.5, out=_poison(q),
                           block_tables=pool.tables(), block_size=bs)  # fmt: skip
    ref = torch.cat([pool.reference(q[b : b + 1], [n - 1], b, d**-0.5, 0)
                     for b, n in enumerate(lens)])  # fmt: skip
    _close("paged decode B=70", out, ref, 3e-3)


# ---- decode with the fused new token (RoPE, qk-norm, k/v stored at the slot) ------------------

FUSED_CASES = [
    # (q_pos per row, block size, Hq, Hkv, D, rope dims, rope type, qk-norm, window)
    ((0, 16, 70), 16, 8, 2, 64, 64, "norm", False, 0),
    ((5, 63, 64), 64, 4, 1, 128, 128, "neox", True, 0),
    ((33, 1, 90), 32, 16, 1, 64, 32, "norm", True, 40),
    ((20, 47, 2), 16, 4, 4, 64, 64, "neox", False, 0),
]


def _rope_ref(x: torch.Tensor, pos, r: int, kind: str, norm_w: torch.Tensor | None):
    """The reference new token: head RMSNorm (qk-norm) if given, then RoPE (float64 angles)."""
    x = x.float().cpu()
    if norm_w is not None:
        x = ref_norm.rms_norm(x.reshape(-1, x.shape[-1]), norm_w.cpu(), 1e-6).view(x.shape)
    cos, sin = ref_rope.rope_cos_sin(torch.as_tensor(pos).long(), r, 10000.0)
    return ref_rope.apply_rope(x, cos, sin, kind)


@pytest.mark.parametrize("case", FUSED_CASES,
                         ids=lambda c: "p{}_bs{}_h{}x{}_d{}_r{}_{}_n{:d}_w{}".format(
                             "-".join(map(str, c[0])), *c[1:]))  # fmt: skip
@pytest.mark.parametrize("padded", [False, True], ids=["", "padded"])
@pytest.mark.parametrize("merge", [False, True], ids=["", "merged"])
def test_paged_decode_fused_new_token(case: tuple, padded: bool, merge: bool) -> None:
    """B rows, each its own sequence: q and the new k/v as views of one projection output
    (un-rotated); the launch rotates (and head-norms) them at q_pos[b], stores k/v at the
    slot of q_pos[b] of row b's table (which held NaN) and attends. ``padded``: a fourth row
    is graph padding (q_pos 0 in the scratch block): its output is its own value. ``merge``:
    the splits merged in the same launch (``counters``), which are zero again after it."""
    q_pos, bs, hq, hkv, d, r, kind, norms, window = case
    q_pos = list(q_pos) + ([0] if padded else [])
    n_b = len(q_pos)
    alloc = [p + 1 for p in q_pos]
    pool = Paged(alloc, q_pos, bs, hkv, d, seed=sum(q_pos) + d)
    tables = pool.table.clone()
    if padded:
        tables[-1] = pool.scratch
    qkv = _rand(n_b, hq + 2 * hkv, d, seed=d + 1)  # one projection output, fp32
    q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
    inv = rope_inv_freq(r, 10000.0, device=DEVICE)
    qn, kn = (_rand(d, seed=3) + 1.0, _rand(d, seed=4) + 1.0) if norms else (None, None)
    hn = (qn, kn, 1e-6) if norms else None
    pos = torch.tensor(q_pos, dtype=torch.int32, device=DEVICE)
    k_pool, v_pool = pool.k.clone(), pool.v.clone()
    qx = empty_quantized(n_b, hq * d, DEVICE)
    counters = torch.zeros(n_b * hkv + 3, dtype=torch.int32, device=DEVICE) if merge else None
    out = decode_attention(q, k_pool, v_pool, pos, d**-0.5, window, out=_poison(q), quantized=qx,
                           new=NewToken(k, v, inv, kind, hn), block_tables=tables.to(DEVICE),
                           block_size=bs, counters=counters)  # fmt: skip
    assert counters is None or not counters.any()

    q_ref = _rope_ref(q, q_pos, r, kind, qn)
    k_ref = _rope_ref(k, q_pos, r, kind, kn)
    want_k, want_v = pool.k.clone().cpu(), pool.v.clone().cpu()
    slots = [int(slots_of(tables[b], p + 1, bs)[p]) for b, p in enumerate(q_pos)]
    for b, s in enumerate(slots):
        want_k[s] = k_ref[b].to(F16)
        want_v[s] = v[b].cpu().to(F16)
    _close(f"fused {case} stored k", k_pool.cpu()[slots], want_k[slots], 2e-3)
    assert torch.equal(v_pool.cpu()[slots], want_v[slots]), "stored v differs"
    others = torch.ones(k_pool.shape[0], dtype=torch.bool)
    others[slots] = False
    assert torch.equal(_bits(k_pool)[others], _bits(pool.k)[others]), "other k rows changed"
    assert torch.equal(_bits(v_pool)[others], _bits(pool.v)[others]), "other v rows changed"
    for b, p in enumerate(q_pos):
        ref = pool.reference(q_ref[b : b + 1], [p], b, d**-0.5, window, table_row=tables[b],
                             k=want_k, v=want_v)  # fmt: skip
        _close(f"fused {case} row {b}", out[b : b + 1], ref, 3e-3)
    want = quantize_x(out.reshape(n_b, -1))
    assert torch.equal(qx.xq, want.xq) and torch.equal(qx.xd, want.xd)


# ---- packed varlen prefill -----------------------------------------------------------------------

PREFILL_CASES = [
    # (sequences (start, chunk length), block size, Hq, Hkv, D, window)
    (((0, 7), (37, 20), (5, 1)), 16, 4, 2, 64, 0),  # a chunk continuing a cached prefix
    (((0, 33), (100, 17), (3, 9)), 64, 8, 1, 64, 24),  # G = 8, window
    (((0, 5), (20, 30)), 32, 16, 1, 64, 0),  # G = 16, blocks of 32 < the key tile of 64
    (((10, 20),), 16, 2, 2, 128, 0),  # B = 1, G = 1
    (((40, 9), (0, 12), (7, 3)), 16, 4, 2, 256, 0),  # D = 256 (key tile 32)
    (((60, 70), (0, 3)), 64, 4, 1, 64, 50),  # window across tiles
]


def _prefill_setup(case: tuple, seed: int):
    seqs, bs, hq, hkv, d, window = case
    ends = [s + n for s, n in seqs]
    pool = Paged(ends, ends, bs, hkv, d, seed=seed)
    lens = [n for _, n in seqs]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    q = _rand(int(cu[-1]), hq, d, seed=seed + 5, dtype=F16)
    start = torch.tensor([s for s, _ in seqs], dtype=torch.int32)
    return pool, lens, cu, start, q


def _prefill_id(c: tuple) -> str:
    seqs = "-".join(f"{s}+{n}" for s, n in c[0])
    return f"{seqs}_bs{c[1]}_h{c[2]}x{c[3]}_d{c[4]}_w{c[5]}"


def _check_prefill(case: tuple, n_split: int | None, seed: int) -> None:
    """The kernel at ``n_split`` (None: its rule) against the reference, sequence by sequence."""
    seqs, bs, hq, hkv, d, window = case
    pool, lens, cu, start, q = _prefill_setup(case, seed=seed)
    tiles = prefill_tile_map(lens, hq, hkv, d, DEVICE)
    out = paged_prefill_attention(q, pool.k, pool.v, pool.tables(), cu.to(DEVICE),
                                  start.to(DEVICE), tiles, bs, d**-0.5, window,
                                  out=_poison(q), n_split=n_split)  # fmt: skip
    for b, (s, n) in enumerate(seqs):
        ref = pool.reference(q[cu[b] : cu[b + 1]], torch.arange(s, s + n), b, d**-0.5, window)
        _close(f"paged prefill {case} split {n_split} seq {b}", out[cu[b] : cu[b + 1]], ref, 3e-3)


def _rule_split(case: tuple) -> int:
    """The split count the rule gives a PREFILL_CASES case (its tiles, Paged's table width)."""
    seqs, bs, hq, hkv, d, _ = case
    width = -(-max(s + n for s, n in seqs) // bs) + 1
    n_tiles = len(prefill_tile_map([n for _, n in seqs], hq, hkv, d, "cpu"))
    return paged_prefill_split(n_tiles, hkv, width * bs, d)


@pytest.mark.parametrize("n_split", [1, None], ids=["one", "rule"])
@pytest.mark.parametrize("case", PREFILL_CASES, ids=_prefill_id)
def test_paged_prefill(case: tuple, n_split: int | None) -> None:
    """One launch (n_split 1), and the rule's split count (2 to 4 at these small tables, 1
    where the table is a single key tile)."""
    _check_prefill(case, n_split, seed=sum(map(sum, case[0])) + case[4])


SPLIT_CASES = [
    # (sequences (start, chunk length), block size, Hq, Hkv, D, window, n_split)
    # a long prefix, a chunk with nothing cached (3 of its 4 splits empty), one in between
    (((300, 9), (0, 5), (130, 21)), 16, 4, 2, 64, 0, 4),
    (((250, 13), (7, 40)), 32, 8, 1, 64, 100, 3),  # G = 8, a window of a few key tiles
    (((200, 17),), 64, 2, 2, 128, 0, 5),  # 4 key tiles over 5 splits: the last one empty
    (((150, 6), (3, 2)), 16, 4, 2, 256, 0, 7),  # D = 256 (key tile 32)
    (((400, 11), (90, 70)), 16, 4, 1, 64, 37, 6),  # a window shorter than the splits
]


def _split_id(c: tuple) -> str:
    return _prefill_id(c[:6]) + f"_split{c[6]}"


@pytest.mark.parametrize("case", SPLIT_CASES, ids=_split_id)
def test_paged_prefill_split(case: tuple) -> None:
    """Key splits over long-ish prefixes: each (tile, kv head) program's visible keys cut into
    n_split runs, partials merged by the combine; splits with nothing visible for a row (short
    prefixes, windows) add nothing and leave no NaN."""
    _check_prefill(case[:6], case[6], seed=sum(map(sum, case[0])) + case[4] + 1)


@pytest.mark.parametrize("n_split", [1, 3], ids=["one", "split3"])
def test_paged_prefill_packed_equals_loop_and_over_cover(n_split: int) -> None:
    """A packed call of three sequences equals, bit for bit, three calls of one sequence each
    (the same n_split: a program's keys depend on its own tile only). A tile map made for
    longer chunks (a graph's upper bounds: whole tiles past a sequence's device length, the
    rows of q past cu_q[B]) gives the same rows and leaves the rows past cu_q[B] unwritten
    (split: the combine bounds its rows by cu_q[B] on the device)."""
    case = (((0, 40), (70, 25), (9, 3)), 16, 8, 2, 64, 30)
    seqs, bs, hq, hkv, d, window = case
    pool, lens, cu, start, q = _prefill_setup(case, seed=77)
    tab = pool.tables()
    kw = dict(n_split=n_split)
    packed = paged_prefill_attention(q, pool.k, pool.v, tab, cu.to(DEVICE), start.to(DEVICE),
                                     prefill_tile_map(lens, hq, hkv, d, DEVICE), bs, d**-0.5,
                                     window, out=_poison(q), **kw)  # fmt: skip
    for b, n in enumerate(lens):
        one = paged_prefill_attention(
            q[cu[b] : cu[b + 1]], pool.k, pool.v, tab[b : b + 1],
            torch.tensor([0, n], dtype=torch.int32, device=DEVICE), start[b : b + 1].to(DEVICE),
            prefill_tile_map([n], hq, hkv, d, DEVICE), bs, d**-0.5, window, **kw,
        )  # fmt: skip
        assert torch.equal(one, packed[cu[b] : cu[b + 1]]), f"sequence {b} differs from the loop"
    q_pad = torch.cat([q, _rand(5, hq, d, seed=78, dtype=F16)])
    over = paged_prefill_attention(q_pad, pool.k, pool.v, tab, cu.to(DEVICE), start.to(DEVICE),
                                   prefill_tile_map([n + 40 for n in lens], hq, hkv, d, DEVICE),
                                   bs, d**-0.5, window, out=_poison(q_pad), **kw)  # fmt: skip
    assert torch.equal(over[: q.shape[0]], packed)
    assert torch.isnan(over[q.shape[0] :]).all(), "rows past cu_q[B] were written"
    for b, (s, n) in enumerate(seqs):
        ref = pool.reference(q[cu[b] : cu[b + 1]], torch.arange(s, s + n), b, d**-0.5, window)
        _close(f"packed split {n_split} seq {b}", packed[cu[b] : cu[b + 1]], ref, 3e-3)


def test_split_rules() -> None:
    """The prefill's split count is decode attention's rule on its tile count: ~528 programs
    (4 per SM of an H200), at most a key tile each of the table, at most 16K // D; decode's
    own counts unchanged by sharing it."""
    s = 32768  # llama 8B, Hkv 8, D 128, blocks of keys of 64
    assert paged_prefill_split(5, 8, s, 128) == 13  # 150 tokens after a cached prefix
    assert paged_prefill_split(8, 8, s, 128) == 8  # the 256-token graph
    assert paged_prefill_split(33, 8, s, 128) == 2
    assert paged_prefill_split(34, 8, s, 128) == 1  # 1,057+ tokens: the grid is enough
    assert paged_prefill_split(1, 1, 100, 64) == 2  # two key tiles of a 100-key table
    assert paged_prefill_split(1, 1, 1 << 20, 256) == 64  # the combine's registers at D 256
    assert paged_prefill_split(1, 1, 1 << 20, 128) == 128
    # decode: (S, B, Hkv, D) -> (block_s, n_split, warps, stages), the values before sharing
    assert decode_config(4096, 1, 8, 128) == (64, 64, 4, 3)
    assert decode_config(4096, 16, 8, 128) == (64, 4, 4, 3)
    assert decode_config(32768, 1, 8, 128) == (64, 66, 4, 3)
    assert decode_config(1 << 20, 1, 1, 256) == (32, 64, 4, 3)
    assert decode_config(4096, 64, 8, 64) == (64, 1, 4, 3)
    # test_paged_prefill's "rule" runs split where the table has more than one key tile
    assert [_rule_split(c) for c in PREFILL_CASES] == [2, 3, 2, 1, 3, 4]


@pytest.mark.parametrize("s,hkv,d", [(1024, 8, 128), (40960, 8, 128), (40960, 2, 256), (64, 1, 64)])
def test_variant_rows_cover_every_row_count(s: int, hkv: int, d: int) -> None:
    """variant_rows: one row count per distinct combine tile (the split count's next power of
    two) among 1..63 rows, each the least of its class, so a warm-up of those rows builds what
    any row count asks for."""
    rows = variant_rows(s, 63, hkv, d)
    tile = {b: triton.next_power_of_2(decode_config(s, b, hkv, d).n_split) for b in range(1, 64)}
    assert rows == sorted(rows) and rows[0] == 1
    assert sorted(tile[b] for b in rows) == sorted(set(tile.values()))  # every class, once each
    assert all(min(b for b in tile if tile[b] == tile[r]) == r for r in rows)
    assert variant_rows(1024, 63, 8, 128) == [1, 8, 14, 23, 34]


def test_step_shaped_arguments_build_no_variants() -> None:
    """Arguments that follow a step's row counts are not specialized on (Triton builds a
    variant for each integer's class and each pointer's 16-byte alignment): the split counts,
    and the pointers a step slices at its decode-row count (the prefill's query starts and
    table, the combine's row bound cu_q[B:]); else a step of new row counts compiles inside a
    request, after the warm-up."""
    from deimos.kernels.triton.decode_attention import _decode_combine_kernel, _decode_split_kernel
    from deimos.kernels.triton.prefill_attention import _paged_prefill_kernel

    def flags(kernel, name):  # the interpreter keeps the decorator's lists, the JIT its params
        if not hasattr(kernel, "params"):
            return tuple(name in (kernel.kwargs[k] or ()) for k in ("do_not_specialize", "do_not_specialize_on_alignment"))
        p = next(p for p in kernel.params if p.name == name)
        return p.do_not_specialize, p.do_not_specialize_on_alignment

    assert flags(_decode_split_kernel, "N_SPLIT")[0] and flags(_decode_combine_kernel, "N_SPLIT")[0]
    assert flags(_paged_prefill_kernel, "n_split")[0]
    assert all(flags(_paged_prefill_kernel, n)[1] for n in ("p_start", "p_tab"))
    assert flags(_decode_combine_kernel, "p_rows")[1]


def test_prefill_tile_map() -> None:
    """cdiv(len * G, BLOCK_M) tiles per sequence (BLOCK_M 128 at D 64, 64 at D 256), highest
    tile index first."""
    tiles = prefill_tile_map([100, 0, 10], 8, 2, 64, DEVICE).cpu().tolist()
    assert sorted(tiles) == [[0, 0], [0, 1], [0, 2], [0, 3], [2, 0]]
    assert [j for _, j in tiles] == sorted((j for _, j in tiles), reverse=True)
    assert prefill_tile_map([65], 4, 4, 256, DEVICE).cpu().tolist() == [[0, 1], [0, 0]]
    assert prefill_tile_map([], 4, 4, 64, DEVICE).shape == (0, 2)
    with pytest.raises(ValueError, match="do not group"):
        prefill_tile_map([3], 6, 4, 64, DEVICE)


@pytest.mark.gpu
@pytest.mark.parametrize("prefix", [2048, 8192, 30000])
def test_gpu_paged_prefill_after_a_long_prefix(prefix: int) -> None:
    """An agent turn on llama 8B's attention (Hq 32, Hkv 8, D 128, blocks of 64, a 32k table):
    150 new tokens after a cached prefix. The rule's split (13 splits of 5 tiles), one launch,
    and the 256-token prefill graph's launch (a tile map of 256 tokens, cu_q ending at 150:
    8 splits) all equal the reference; prints each one's time for 32 layers and its TFLOP/s.
    The split must beat one launch by 1.5x once the prefix is long (predicted ~3x at 30k)."""
    assert DEVICE == "cuda" and torch.cuda.is_available(), "gpu tests need CUDA"
    n, bs, hq, hkv, d = 150, 64, 32, 8, 128
    ends = prefix + n
    pool = Paged([ends], [ends], bs, hkv, d, seed=5, extra_width=512 - -(-ends // bs))
    tab = pool.tables()
    q = _rand(256, hq, d, seed=6, dtype=F16)
    cu = torch.tensor([0, n], dtype=torch.int32, device=DEVICE)
    start = torch.tensor([prefix], dtype=torch.int32, device=DEVICE)
    ref = pool.reference(q[:n], torch.arange(prefix, ends), 0, d**-0.5, 0)
    flops = 4 * hq * d * n * (prefix + (n + 1) / 2)
    runs = {"rule": (prefill_tile_map([n], hq, hkv, d, DEVICE), None),
            "one launch": (prefill_tile_map([n], hq, hkv, d, DEVICE), 1),
            "graph 256": (prefill_tile_map([256], hq, hkv, d, DEVICE), None)}
    ms = {}
    for name, (tiles, n_split) in runs.items():
        out = _poison(q)

        def call(tiles=tiles, out=out, n_split=n_split):
            paged_prefill_attention(q, pool.k, pool.v, tab, cu, start, tiles, bs, d**-0.5,
                                    out=out, n_split=n_split)  # fmt: skip

        call()
        _close(f"gpu prefill {n} after {prefix} ({name})", out[:n], ref, 3e-3)
        assert torch.isnan(out[n:]).all(), f"{name}: rows past cu_q[B] were written"
        call()
        torch.cuda.synchronize()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(32):  # the 32 layers of a step
            call()
        t1.record()
        torch.cuda.synchronize()
        ms[name] = t0.elapsed_time(t1)
        splits = n_split or paged_prefill_split(len(tiles), hkv, tab.shape[1] * bs, d)
        print(f"prefill {n} after {prefix} ({name}, {len(tiles)} tiles x {splits} splits): "
              f"{ms[name]:.2f} ms for 32 layers, {32 * flops / ms[name] / 1e9:.0f} TFLOP/s")
    if prefix >= 8192:
        assert ms["rule"] * 1.5 < ms["one launch"], f"the split gains too little: {ms}"


# ---- apply_rope storing at slots -----------------------------------------------------------------


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=str)
def test_rope_to_slots(slot_dtype: torch.dtype) -> None:
    """k' and v land in the pool rows ``slots`` (positions give the angles); the rest of the
    pool is untouched; q rotated as without slots."""
    t, hq, hk, d = 5, 4, 2, 64
    qkv = _rand(t, hq + 2 * hk, d, seed=11)
    q, k, v = qkv[:, :hq], qkv[:, hq : hq + hk], qkv[:, hq + hk :]
    pos = torch.tensor([3, 17, 64, 65, 0], device=DEVICE)
    slots = torch.tensor([40, 3, 77, 12, 0], dtype=slot_dtype, device=DEVICE)
    k_pool = torch.full((80, hk, d), NAN, device=DEVICE)
    v_pool = torch.full((80, hk, d), NAN, device=DEVICE)
    inv = rope_inv_freq(d, 10000.0, device=DEVICE)
    qo, ko = apply_rope(q, k, pos, inv, "neox", cache=(v, k_pool, v_pool), slots=slots)
    assert ko is k_pool
    cos, sin = ref_rope.rope_cos_sin(pos.cpu(), d, 10000.0)
    _close("rope slots q", qo, ref_rope.apply_rope(q.cpu(), cos, sin, "neox"), 2e-4)
    rows = slots.long().cpu()
    _close("rope slots k", k_pool.cpu()[rows], ref_rope.apply_rope(k.cpu(), cos, sin, "neox"), 2e-4)
    assert torch.equal(v_pool.cpu()[rows], v.cpu())
    others = torch.ones(80, dtype=torch.bool)
    others[rows] = False
    assert torch.isnan(k_pool.cpu()[others]).all() and torch.isnan(v_pool.cpu()[others]).all()


# ---- bad input -----------------------------------------------------------------------------------


def test_paged_bad_input() -> None:
    lens, bs, hq, hkv, d = [5, 20], 16, 4, 2, 64
    pool = Paged(lens, lens, bs, hkv, d, seed=1)
    tab = pool.tables()
    q = _rand(2, hq, d, seed=2, dtype=F16)
    pos = torch.tensor([4, 19], dtype=torch.int32, device=DEVICE)

    def dec(**kw):
        args = dict(q=q, k=pool.k, v=pool.v, q_pos=pos, scale=0.125, block_tables=tab,
                    block_size=bs)  # fmt: skip
        args.update(kw)
        return decode_attention(**args)

    with pytest.raises(ValueError, match=r"block_tables must be \[2, MAXB\]"):
        dec(block_tables=tab[:1])
    with pytest.raises(ValueError, match="block_tables must be int32"):
        dec(block_tables=tab.long())
    with pytest.raises(ValueError, match="block_tables on meta"):
        dec(block_tables=tab.to("meta"))
    with pytest.raises(ValueError, match="power of two"):
        dec(block_size=24)
    with pytest.raises(ValueError, match="not whole blocks of 16"):
        dec(k=pool.k[:-8], v=pool.v[:-8])
    with pytest.raises(ValueError, match="block_size without block_tables"):
        dec(block_tables=None)
    with pytest.raises(ValueError, match="q_pos must be"):
        dec(q_pos=pos[:1])
    with pytest.raises(ValueError, match=r"quantized output \(2, 128\)"):
        dec(quantized=empty_quantized(2, 128, DEVICE))
    kv = _rand(2, hkv, d, seed=3)
    inv = rope_inv_freq(d, 1e4, device=DEVICE)
    with pytest.raises(ValueError, match=r"new token's k must be \[2, 2, 64\]"):
        dec(q=q.float(), new=NewToken(kv[:1], kv, inv, "norm"))
    # the table's width: S = MAXB * block_size positions must fit int32 (meta: no memory)
    m = torch.device("meta")
    with pytest.raises(ValueError, match=r"spans S = 2147483648"):
        decode_attention(q.to(m), torch.empty(2**31, hkv, d, dtype=F16, device=m),
                         torch.empty(2**31, hkv, d, dtype=F16, device=m), pos.to(m), 0.125,
                         block_tables=torch.zeros(2, 2**23, dtype=torch.int32, device=m),
                         block_size=256)  # fmt: skip

    cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    st = torch.tensor([4, 19], dtype=torch.int32, device=DEVICE)
    tiles = prefill_tile_map([1, 1], hq, hkv, d, DEVICE)

    def pre(**kw):
        args = dict(q=q, k=pool.k, v=pool.v, block_tables=tab, cu_q=cu, q_start=st,
                    tile_map=tiles, block_size=bs, scale=0.125)  # fmt: skip
        args.update(kw)
        return paged_prefill_attention(**args)

    assert torch.isfinite(pre()).all()
    assert torch.isfinite(pre(n_split=2)).all()
    with pytest.raises(ValueError, match="n_split must be an int >= 1"):
        pre(n_split=0)
    with pytest.raises(ValueError, match=r"cu_q must be int32 \[3\]"):
        pre(cu_q=cu[:2])
    with pytest.raises(ValueError, match="q_start must be int32"):
        pre(q_start=st.long())
    with pytest.raises(ValueError, match="tile_map must be int32"):
        pre(tile_map=tiles.float())
    with pytest.raises(ValueError, match=r"tile_map must be \[n_tiles, 2\]"):
        pre(tile_map=tiles[:, :1])
    with pytest.raises(ValueError, match=r"block_tables must be \[B, MAXB\]"):
        pre(block_tables=tab[0])
    with pytest.raises(ValueError, match="q_start must be int32 .* on meta"):
        pre(q_start=st.to("meta"))
    with pytest.raises(ValueError, match="does not fit"):
        pre(k=pool.k[:, :, :32], v=pool.v[:, :, :32])
    with pytest.raises(ValueError, match="window must be >= 0"):
        pre(window=-1)
    with pytest.raises(ValueError, match="needs block_m and block_n of at least 16"):
        pre(cfg=PrefillConfig(8, 32, 4, 2))
    qb = _rand(2, 4, 512, seed=4, dtype=F16)
    with pytest.raises(ValueError, match="head size 512"):
        pre(q=qb, k=qb[:, :2].repeat(16, 1, 1), v=qb[:, :2].repeat(16, 1, 1))

    k3 = _rand(2, hkv, d, seed=5)
    with pytest.raises(ValueError, match="slots need cache"):
        apply_rope(q.float(), k3, pos, inv, "norm", slots=pos)
    with pytest.raises(ValueError, match=r"slots must be int32/int64 \[2\]"):
        apply_rope(q.float(), k3, pos, inv, "norm", cache=(k3, pool.k, pool.v), slots=pos[:1])


def test_the_ops_pass_counters_only_when_asked(monkeypatch) -> None:
    """TritonOps gives decode_attention the split-K scratch's counters (the merge in the split
    launch) only with DEIMOS_ATTN_MERGE=1 (ops.MERGE), a scratch, and enough counters for the
    rows' kv heads (rows * Hkv <= the scratch's)."""
    from types import SimpleNamespace

    from deimos.kernels.triton.matmul import SplitScratch
    from deimos.models.gpu import ops as gpu_ops

    me = gpu_ops.TritonOps.__new__(gpu_ops.TritonOps)
    me.cfg = SimpleNamespace(n_head_kv=8)
    scratch = SplitScratch(DEVICE)
    me.inputs = SimpleNamespace(split=scratch)
    n = scratch.counters.numel() // 8
    monkeypatch.setattr(gpu_ops, "MERGE", False)
    assert me._counters(1) is None
    monkeypatch.setattr(gpu_ops, "MERGE", True)
    assert me._counters(1) is scratch.counters and me._counters(n) is scratch.counters
    assert me._counters(n + 1) is None
    me.inputs = SimpleNamespace(split=None)
    assert me._counters(1) is None
