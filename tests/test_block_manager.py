"""The block manager (deimos.engine.block_manager) and the scheduler (deimos.engine.scheduler)
on their own: no model. Oracles: the invariants (every block held, cached or free, exactly
once; ``BlockManager.check``), and counts worked out by hand."""

from __future__ import annotations

import random

import pytest

from deimos.engine.block_manager import BlockManager, OutOfBlocks, chain_key, pack_tokens
from deimos.engine.request import Request
from deimos.engine.scheduler import Scheduler, SchedulerConfig
from deimos.engine.sequence import SeqStatus, Sequence
from deimos.kernels.sampling import SamplingParams

BS = 4


def test_allocate_seal_free_and_match():
    bm = BlockManager(10, BS)  # 9 usable
    tokens = list(range(10))  # 2 full blocks + 2 tokens
    table, cached = bm.allocate(tokens, len(tokens))
    assert cached == 0 and len(table) == 3 and 0 not in table  # block 0 is scratch
    assert bm.n_used == 3 and bm.n_free == 6
    assert bm.seal(table, tokens, 10, 0) == 2  # two full blocks registered
    bm.check()
    bm.free(table)
    assert table == [] and bm.n_used == 0 and bm.n_cached == 2
    bm.check()
    # the same prefix again: both full blocks are hits, the partial one is not
    t2, cached2 = bm.allocate(tokens + [99], 11)
    assert cached2 == 8 and len(t2) == 3
    assert bm.n_cached == 0 and bm.hit_tokens == 8 and bm.query_tokens == 21
    bm.free(t2)
    bm.check()


def test_match_stops_before_the_last_token_and_at_a_difference():
    bm = BlockManager(10, BS)
    tokens = list(range(8))
    table, _ = bm.allocate(tokens, 8)
    bm.seal(table, tokens, 8, 0)
    bm.free(table)
    assert len(bm.match(tokens)) == 1  # all but the last token: the second block is not usable
    assert len(bm.match(tokens + [5])) == 2
    assert len(bm.match([0, 1, 2, 9, 4, 5, 6, 7, 8])) == 0  # differs inside the first block
    assert len(bm.match([0, 1, 2, 3, 9, 5, 6, 7, 8])) == 1  # inside the second


def test_chain_keys_depend_on_the_whole_prefix():
    a = chain_key(b"", (1, 2, 3, 4))
    assert chain_key(a, (5, 6, 7, 8)) != chain_key(chain_key(b"", (0, 2, 3, 4)), (5, 6, 7, 8))
    assert chain_key(a, (5, 6, 7, 8)) == chain_key(chain_key(b"", (1, 2, 3, 4)), (5, 6, 7, 8))


def test_lru_eviction_keeps_the_newest_and_never_a_held_block():
    bm = BlockManager(5, BS)  # 4 usable
    seqs = [[10 * i + j for j in range(BS)] + [0] for i in range(3)]  # 1 full block + 1
    tables = []
    for s in seqs:
        t, _ = bm.allocate(s, BS)
        bm.seal(t, s, BS, 0)
        tables.append(t)
    for t in tables:
        bm.free(t)  # freed in order: seqs[0]'s block is the oldest
    assert bm.n_cached == 3
    held, _ = bm.allocate(seqs[2], BS)  # a hit on the newest
    assert bm.n_cached == 2
    fresh = [bm._take() for _ in range(2)]  # one free block, then evicts the oldest cached one
    assert bm.match(seqs[0]) == [] and len(bm.match(seqs[1])) == 1
    bm.check()
    with pytest.raises(OutOfBlocks):
        bm._take(), bm._take()
    bm.free(held)
    bm.free(fresh)


def test_shared_block_stays_held_until_every_holder_frees_it():
    bm = BlockManager(8, BS)
    s = list(range(9))
    a, _ = bm.allocate(s, 9)
    bm.seal(a, s, 9, 0)
    b, cached = bm.allocate(s, 9)
    assert cached == 8 and b[:2] == a[:2]
    bm.free(a)
    assert bm.n_cached == 0  # still held by b
    bm.free(b)
    assert bm.n_cached == 2
    bm.check()


def _seq(i: int, n_prompt: int, max_tokens: int = 4) -> Sequence:
    req = Request(list(range(1, n_prompt + 1)), max_tokens, SamplingParams(temperature=0))
    return Sequence(i, req, list(req.prompt_ids))


def test_scheduler_budget_chunks_a_long_prompt_and_decodes_keep_running():
    bm = BlockManager(64, BS)
    sch = Scheduler(bm, SchedulerConfig(max_seqs=4, max_batch_tokens=8))
    short, long_ = _seq(0, 3), _seq(1, 30)
    sch.add(short)
    sch.add(long_)
    plan = sch.schedule()
    assert [(s.id, n) for s, n in plan.prefill] == [(0, 3), (1, 5)]
    short.n_computed, long_.n_computed = 3, 5
    short.tokens.append(7)  # its first output: now decoding
    for _ in range(3):
        plan = sch.schedule()
        assert [s.id for s in plan.decode] == [0]  # the decode is never starved
        assert [(s.id, n) for s, n in plan.prefill] == [(1, 7)]
        short.n_computed += 1
        short.tokens.append(7)
        long_.n_computed += 7
    bm.check()


def test_a_hybrid_chunk_crossing_a_block_boundary_snapshots_inside_its_step():
    """A hybrid model's chunk that crosses a block boundary runs whole, with a snapshot row at
    its last boundary (plan.snap_at), as many a step as ``step_snapshots``; past them (or with
    none) it ends on that boundary, the rest the next step's. A chunk ending on a boundary, or
    crossing none, needs no snapshot."""
    bm = BlockManager(64, BS, needs_state=True)
    sch = Scheduler(bm, SchedulerConfig(max_seqs=4, max_batch_tokens=64), step_snapshots=1)
    a, b, c, d = _seq(0, 10), _seq(1, 11), _seq(2, 8), _seq(3, 3)
    for s in (a, b, c, d):
        sch.add(s)
    plan = sch.schedule()
    # a: 10 tokens crossing 4 and 8, a snapshot after 8; b: no snapshot left, cut at 8;
    # c: ends on a boundary; d: crosses none
    assert [(s.id, n) for s, n in plan.prefill] == [(0, 10), (1, 8), (2, 8), (3, 3)]
    assert plan.snap_at == {a: 8}
    for s, n in plan.prefill:
        s.n_computed += n
    for s in (a, c, d):
        s.tokens.append(5)  # their first outputs: now decoding
    plan = sch.schedule()  # b's rest: 3 tokens from 8, crossing none
    assert [s.id for s in plan.decode] == [0, 2, 3]
    assert [(s.id, n) for s, n in plan.prefill] == [(1, 3)] and plan.snap_at == {}
    # with no capacity (an engine without snapshot rows): the old cut
    bm2 = BlockManager(64, BS, needs_state=True)
    sch2 = Scheduler(bm2, SchedulerConfig(max_seqs=4, max_batch_tokens=64))
    sch2.add(_seq(0, 10))
    plan = sch2.schedule()
    assert [n for _, n in plan.prefill] == [8] and plan.snap_at == {}
    # a model without recurrent state never cuts nor snapshots
    sch3 = Scheduler(BlockManager(64, BS), SchedulerConfig(max_seqs=4, max_batch_tokens=64),
                     step_snapshots=4)
    sch3.add(_seq(0, 10))
    plan = sch3.schedule()
    assert [n for _, n in plan.prefill] == [10] and plan.snap_at == {}
    bm.check()
    bm2.check()


def test_scheduler_preempts_the_newest_when_blocks_run_out():
    bm = BlockManager(4, BS)  # 3 usable blocks
    sch = Scheduler(bm, SchedulerConfig(max_seqs=4, max_batch_tokens=16))
    a, b = _seq(0, 4), _seq(1, 4)
    sch.add(a)
    sch.add(b)
    plan = sch.schedule()
    assert len(plan.prefill) == 2 and bm.n_free == 1
    for s in (a, b):
        s.n_computed = 4
        s.tokens.append(9)  # position 4 needs a second block each: only one is free
    plan = sch.schedule()
    assert [s.id for s in plan.decode] == [0] and plan.preempted == [b]
    assert b.status is SeqStatus.WAITING and b.n_computed == 0 and b.table == []
    assert sch.waiting[0] is b and sch.preemptions == 1
    bm.check()


def test_scheduler_config_checks():
    with pytest.raises(ValueError, match="max_batch_tokens"):
        SchedulerConfig(max_seqs=8, max_batch_tokens=4)
    with pytest.raises(ValueError, match="max_seqs"):
        SchedulerConfig(max_seqs=0)


def _slow_match(bm: BlockManager, tokens: list[int]) -> list[int]:
    """``match`` as it was: every block's chain key hashed from the tokens, nothing remembered."""
    return _walk(bm, tokens)[0]


def _keys(tokens: list[int], n: int) -> list[bytes]:
    out, parent = [], b""
    for i in range(n):
        parent = chain_key(parent, tuple(tokens[i * BS : (i + 1) * BS]))
        out.append(parent)
    return out


@pytest.mark.parametrize("hybrid", [False, True], ids=["plain", "hybrid"])
@pytest.mark.parametrize("seed", range(4))
def test_match_with_memos_and_chains_equals_hashing_every_block(hybrid, seed):
    """Sequences continuing, branching from and repeating earlier ones in a pool small enough to
    evict: ``match`` with a sequence's key memo (fresh, or kept from before the cache changed)
    and the packed prompt finds exactly what hashing every block finds, and its memo holds the
    chain keys of the tokens."""
    rng = random.Random(seed)
    bm = BlockManager(24, BS, needs_state=hybrid)
    live: list[tuple[list[int], list[int], list[bytes], int]] = []  # tokens, table, keys, sealed
    history: list[list[int]] = []
    memos: dict[tuple[int, ...], list[bytes]] = {}
    for _ in range(400):
        if live and rng.random() < 0.4:  # a sequence ends, or grows by a few tokens (decoding)
            i = rng.randrange(len(live))
            tokens, table, keys, n_sealed = live[i]
            if rng.random() < 0.5:
                bm.free(table)
                del live[i]
                history.append(tokens)
                continue
            tokens += [rng.randrange(3) for _ in range(rng.randrange(1, 6))]
            if bm.blocks_to_grow(table, len(tokens)) > bm.n_free:
                continue
            bm.grow(table, len(tokens))
            n_sealed = bm.seal(table, tokens, len(tokens) - 1, n_sealed, keys)
            if hybrid and n_sealed and rng.random() < 0.7:
                bm.attach_state(table[n_sealed - 1], object())
            live[i] = (tokens, table, keys, n_sealed)
            continue
        base = rng.choice(history) if history and rng.random() < 0.8 else []
        tokens = base[: rng.randrange(len(base) + 1)] if rng.random() < 0.3 else list(base)
        tokens = tokens + [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
        # a memo of the same tokens from before (the cache changed since), or none
        keys = list(memos.get(tuple(tokens), [])) if rng.random() < 0.5 else []
        hit = bm.match(tokens, keys, pack_tokens(tokens) if rng.random() < 0.5 else None)
        assert hit == _slow_match(bm, tokens)
        assert keys == _keys(tokens, len(keys)) and len(keys) <= (len(tokens) - 1) // BS
        memos[tuple(tokens)] = list(keys)
        if not bm.can_allocate(len(tokens), hit):
            continue
        table, cached = bm.allocate(tokens, len(tokens), hit)
        n_sealed = bm.seal(table, tokens, len(tokens) - 1, cached // BS, keys)
        if hybrid and n_sealed and rng.random() < 0.7:
            bm.attach_state(table[n_sealed - 1], object())
        live.append((tokens, table, keys, n_sealed))
        bm.check()
    for _, table, _, _ in live:
        bm.free(table)
    bm.check()


def test_a_continued_sequence_is_matched_without_hashing_its_blocks_again(monkeypatch):
    """The blocks a sequence sealed with its key memo are found from it: the next prompt that
    continues the sequence (an agent's next turn) hashes only the first block past them."""
    import deimos.engine.block_manager as bm_module

    bm = BlockManager(64, BS)
    tokens = list(range(100, 141))  # 10 full blocks and 1 token
    keys: list[bytes] = []
    table, _ = bm.allocate(tokens, len(tokens), bm.match(tokens, keys))
    bm.seal(table, tokens, len(tokens), 0, keys)
    bm.free(table)
    nxt = tokens + list(range(7, 20))
    want = _slow_match(bm, nxt)
    assert len(want) == 10
    calls = []
    real = bm_module._key
    monkeypatch.setattr(bm_module, "_key", lambda *a: calls.append(a) or real(*a))
    assert bm.match(nxt) == want
    assert len(calls) == 2  # the first block's key, and the one past the cached blocks (a miss)


def _walk(bm: BlockManager, tokens: list[int], n_memo: int = 0) -> tuple[list[int], int]:
    """What ``match`` must give, worked out by hashing every block: (the hit, the length of the
    key memo after it, given one holding the right keys of the first ``n_memo`` blocks). The
    memo grows to every block looked at past it, the first one not found included."""
    out, parent, usable, looked = [], b"", 0, 0
    for i in range((len(tokens) - 1) // bm.block_size):
        block = tuple(tokens[i * bm.block_size : (i + 1) * bm.block_size])
        parent = chain_key(parent, block)
        looked = i + 1
        b = bm._by_key.get(parent)
        if b is None or bm._sealed[b] is None or bm._sealed[b].tokens != pack_tokens(block):
            break
        out.append(b)
        if bm._sealed[b].state is not None:
            usable = len(out)
    return (out[:usable] if bm.needs_state else out), max(n_memo, looked)


def _check_match(bm: BlockManager, tokens: list[int], n_memo: int = 0, packed=None) -> list[int]:
    keys = _keys(tokens, n_memo)
    hit = bm.match(tokens, keys, packed)
    want, n_keys = _walk(bm, tokens, n_memo)
    assert hit == want
    assert keys == _keys(tokens, n_keys)  # the chain keys, as hashing finds them
    return hit


def _sealed_sequence(bm: BlockManager, tokens: list[int]) -> list[int]:
    """``tokens`` prefilled, sealed with a key memo (so their blocks carry it as their chain)
    and let go, as the engine does; returns the table it had."""
    keys: list[bytes] = []
    table, cached = bm.allocate(tokens, len(tokens), bm.match(tokens, keys))
    bm.seal(table, tokens, len(tokens), cached // BS, keys)
    held = list(table)
    bm.free(table)
    return held


def test_match_on_a_long_chain_stops_at_the_first_block_that_differs():
    """A prompt that follows a sealed sequence's chain for hundreds of blocks (spans checked at
    once) but differs inside block p: the match is exactly the p blocks before it, and the memo
    holds the chain keys up to block p, the first one not found."""
    bm = BlockManager(400, BS)
    rng = random.Random(1)
    tokens = [rng.randrange(1000) for _ in range(300 * BS)]
    table = _sealed_sequence(bm, tokens)
    assert _check_match(bm, tokens + [7]) == table  # every block, then one past the chain
    for m in (300, 100, 33):  # a prompt ending inside the chain: all but its last token
        assert _check_match(bm, tokens[: m * BS]) == table[: m - 1]
        assert _check_match(bm, tokens[: m * BS], packed=pack_tokens(tokens)) == table[: m - 1]
    for p in (0, 1, 2, 31, 32, 33, 95, 96, 97, 150, 223, 224, 298, 299):
        for pos in (0, BS - 1):
            other = list(tokens)
            other[p * BS + pos] += 1
            for tail in ([5], list(range(40))):  # the prompt ends right there, or goes on
                hit = _check_match(bm, other + tail)
                assert hit == table[:p]
                hit = _check_match(bm, other + tail, n_memo=p // 2, packed=pack_tokens(other))
                assert hit == table[:p]
    bm.check()


def test_match_on_a_chain_whose_block_was_evicted_and_reused():
    """A block in the middle of a cached chain evicted and sealed again with other tokens: the
    chain's key is gone from the cache, and the block's new tokens are not the prompt's."""
    bm = BlockManager(1 + 120 + 4, BS)
    rng = random.Random(2)
    tokens = [rng.randrange(1000) for _ in range(120 * BS)]
    table = _sealed_sequence(bm, tokens)
    victim = table[70]
    bm._lru.move_to_end(victim, last=False)  # the next block handed out after the free ones
    other = [rng.randrange(1000, 2000) for _ in range(5 * BS)]
    t2, _ = bm.allocate(other, len(other))
    assert victim in t2
    bm.seal(t2, other, len(other), 0, [])
    for prompt in (tokens + [1], tokens[: 71 * BS] + [1]):
        assert _check_match(bm, prompt) == table[:70]
        assert _check_match(bm, prompt, n_memo=80) == table[:70]  # the memo's key: not cached
    bm.free(t2)
    # sealed again by a sequence that continues the prompt: the chain after block 70 is found
    # from the new blocks' chains
    t3 = _sealed_sequence(bm, tokens + [1])
    assert t3[:70] == table[:70] and _check_match(bm, tokens + [1]) == t3[:120]
    bm.check()


def test_match_on_a_chain_keeps_only_up_to_the_last_state_snapshot():
    """A hybrid model's cache: a long chain is matched (and its keys memoized) to its end, but
    usable only up to the last block holding a recurrent state snapshot."""
    bm = BlockManager(200, BS, needs_state=True)
    rng = random.Random(3)
    tokens = [rng.randrange(1000) for _ in range(150 * BS)]
    table = _sealed_sequence(bm, tokens)
    assert _check_match(bm, tokens + [1]) == []  # no snapshot anywhere
    bm.attach_state(table[40], object())
    assert _check_match(bm, tokens + [1]) == table[:41]
    bm.attach_state(table[100], object())  # another sequence's: both kept
    assert _check_match(bm, tokens + [1]) == table[:101]
    other = list(tokens)
    other[90 * BS] += 1  # differs before the later snapshot
    assert _check_match(bm, other + [1]) == table[:41]
    assert _check_match(bm, other + [1], n_memo=60) == table[:41]
    bm.check()


@pytest.mark.parametrize("hybrid", [False, True], ids=["plain", "hybrid"])
@pytest.mark.parametrize("seed", range(3))
def test_match_on_long_prompts_equals_hashing_every_block(hybrid, seed):
    """Long conversations (hundreds of blocks) continued, cut, edited inside and re-sent in a
    pool that evicts, some sealed without a memo (no chain): ``match`` with no memo, a part of
    the right one, and with or without the packed prompt, against hashing every block."""
    rng = random.Random(seed)
    bm = BlockManager(700, BS, needs_state=hybrid)
    history: list[list[int]] = [[]]
    for _ in range(60):
        base = list(rng.choice(history))
        r = rng.random()
        if r < 0.25 and base:
            base = base[: rng.randrange(len(base) + 1)]
        elif r < 0.5 and base:
            base[rng.randrange(len(base))] = rng.randrange(3)
        tokens = base + [rng.randrange(3) for _ in range(rng.randrange(1, 200))]
        n = (len(tokens) - 1) // BS
        for n_memo in {0, rng.randrange(n + 1)}:
            packed = rng.choice([None, pack_tokens(tokens), pack_tokens(tokens[: rng.randrange(len(tokens))])])
            hit = _check_match(bm, tokens, n_memo, packed)
        if not bm.can_allocate(len(tokens), hit):
            continue
        keys = _keys(tokens, n_memo) if rng.random() < 0.8 else None  # None: blocks without chains
        table, cached = bm.allocate(tokens, len(tokens), bm.match(tokens, keys))
        n_sealed = bm.seal(table, tokens, len(tokens), cached // BS, keys)
        if hybrid and n_sealed:
            bm.attach_state(table[rng.randrange(n_sealed)], object())
        bm.free(table)
        history.append(tokens)
        bm.check()
