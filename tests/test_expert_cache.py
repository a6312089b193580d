"""The expert cache's bookkeeping (deimos.runtime.expert_cache) on CPU tensors: slot contents
against the host copy they came from, the published table against the host mirror, victims,
resize/compaction, and the policies' hit rates on synthetic routing traces. Its sizing
(deimos.runtime.gpu_memory) with a test-owned clock and free-memory value: no GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deimos.gguf.constants import GGMLType
from deimos.quant import get_format
from deimos.quant.triton.layout import pack
from deimos.runtime.expert_cache import (
    DEFAULT_POLICY,
    POLICIES,
    ExpertCache,
    HostExperts,
    LayerCache,
)
from deimos.runtime.gpu_memory import (
    BAND_MIN,
    FreeMemory,
    SlotSizer,
    headroom,
    nvml_reader,
    visible_device,
)

E = 7


def host_experts(n_expert: int = E, seed: int = 0, n_ff: int = 3, n_embd: int = 256) -> HostExperts:
    """gate/up Q4_K [E * n_ff, n_embd] and down Q6_K [E * n_embd, n_ff * ...] packed as the GPU
    layout stacks them (layout.pack of the 3-D tensor's bytes)."""
    rng = np.random.default_rng(seed)

    def stack(t: GGMLType, n_out: int, n_in: int):
        f = get_format(t)
        raw = f.random_blocks(n_expert * n_out * n_in // f.block_size, rng)
        return pack(raw.reshape(n_expert * n_out, -1), t)

    return HostExperts({"gate": stack(GGMLType.Q4_K, n_ff, n_embd), "up": stack(GGMLType.Q4_K, n_ff, n_embd),
                        "down": stack(GGMLType.Q6_K, 5, 256)}, n_expert)


def check_consistent(cache: LayerCache) -> None:
    """The device table equals the mirror; every resident's slot holds its host rows; slots are
    below n_slots and used once."""
    assert torch.equal(cache.slot_of, torch.from_numpy(cache.slot_of_host))
    slots = cache.slot_of_host[cache.slot_of_host >= 0]
    assert len(set(slots.tolist())) == slots.size and (slots < cache.n_slots).all()
    for e in cache.resident:
        got = cache.slot_arrays(int(cache.slot_of_host[e]))
        want = cache.host.expert(int(e))
        for p in want:
            for a in want[p]:
                assert torch.equal(got[p][a], want[p][a]), (int(e), p, a)


def test_promote_copies_then_publishes_on_poll():
    cache = LayerCache(host_experts(), 3, "cpu", policy="lru", slots_per_chunk=2)
    table = cache.slot_of.data_ptr()
    cache.record(np.array([4, 0]))
    assert cache.misses == 2 and cache.hits == 0
    assert cache.promote(4) and cache.promote(0)
    assert not cache.promote(4)  # on its way already
    assert (cache.slot_of == -1).all()  # nothing visible before poll
    assert cache.poll() == 2
    check_consistent(cache)
    assert cache.slot_of_host[4] >= 0 and cache.slot_of_host[0] >= 0
    cache.record(np.array([[4, 0], [4, 6]]))
    assert (cache.hits, cache.misses) == (3, 3)
    assert cache.slot_of.data_ptr() == table  # the table is updated in place


def test_best_missing_is_the_most_used_neither_resident_nor_coming():
    cache = LayerCache(host_experts(), 4, "cpu", policy="lfu", slots_per_chunk=2)
    for ids in ([5, 1], [5, 1], [5, 2], [5, 3], [6, 3]):  # uses: 5 x4, 1 x2, 3 x2, 2, 6
        cache.record(np.array(ids))
    assert cache.free_slots() == [0, 1, 2, 3]
    assert cache.best_missing(3) == [5, 3, 1]  # 3 used last of the two-use ties (recency)
    assert cache.promote(5)  # on its way: neither a free slot nor missing
    assert cache.free_slots() == [1, 2, 3] and cache.best_missing(2) == [3, 1]
    cache.poll(wait=True)
    assert cache.fill([3]) == [3]
    assert cache.free_slots() == [2, 3] and cache.best_missing(9) == [1, 6, 2, 0, 4]
    assert cache.best_missing(0) == []


def test_promote_many_evicts_in_order_and_publishes_the_evictions():
    cache = LayerCache(host_experts(), 2, "cpu", policy="lru")
    cache.record(np.array([0]))
    cache.record(np.array([1]))
    assert cache.promote_many([0, 1, 0]) == [0, 1]
    cache.poll()
    cache.record(np.array([5, 6]))
    assert cache.promote_many([5, 6]) == [5, 6]  # victims 0 then 1 (least recent first)
    assert (cache.slot_of == -1).all()  # the evictions are published, the copies not yet
    cache.poll()
    assert sorted(cache.resident.tolist()) == [5, 6]
    check_consistent(cache)


def test_slot_weight_is_the_experts_packed_rows():
    host = host_experts()
    cache = LayerCache(host, 2, "cpu")
    cache.promote(E - 1)
    cache.poll()
    w = cache.slot_weight(int(cache.slot_of_host[E - 1]), "down")
    assert (w.n, w.k, w.ggml_type) == (5, 256, GGMLType.Q6_K)
    for a, t in w.tensors.items():
        assert torch.equal(t, host.arrays["down"][a][E - 1])


def test_lru_victim_is_the_least_recently_used():
    cache = LayerCache(host_experts(), 2, "cpu", policy="lru")
    for e in (1, 2):
        cache.record(np.array([e]))
        cache.promote(e)
    cache.poll()
    cache.record(np.array([1]))  # 2 is now the least recently used
    cache.record(np.array([5]))
    assert cache.promote(5)
    cache.poll()
    assert cache.slot_of_host[2] == -1 and cache.slot_of_host[1] >= 0 and cache.slot_of_host[5] >= 0
    check_consistent(cache)


def test_lfu_victim_is_the_least_used_and_hybrid_keeps_the_last_steps_experts():
    for policy in ("lfu", "hybrid"):
        cache = LayerCache(host_experts(), 2, "cpu", policy=policy)
        cache.record(np.array([1, 1, 1, 2]))
        assert cache.promote(1) and cache.promote(2)
        cache.poll()
        cache.record(np.array([2, 3]))  # 2 used this step, but 1 used more
        assert cache.promote(3)
        cache.poll()
        if policy == "lfu":  # the least used (2) goes
            assert cache.slot_of_host[2] == -1 and cache.slot_of_host[1] >= 0
        else:  # 2 was used in the latest step: 1 goes
            assert cache.slot_of_host[1] == -1 and cache.slot_of_host[2] >= 0
        assert cache.slot_of_host[3] >= 0
        check_consistent(cache)


def test_resize_keeps_the_most_valuable_compacts_and_frees_chunks():
    cache = LayerCache(host_experts(), E, "cpu", policy="lfu", slots_per_chunk=2)
    assert len(cache._chunks) == 4 and cache.nbytes == 4 * cache.chunk_nbytes
    for e in range(E):  # expert e used e + 1 times: value grows with e
        cache.record(np.full(e + 1, e))
    for e in (0, 6, 2, 5, 1, 4, 3):
        assert cache.promote(e)
    cache.poll()
    check_consistent(cache)
    ptrs = cache.chunk_ptrs[("gate", "qw")]
    table_ptr = ptrs.data_ptr()
    cache.resize(3)
    assert cache.n_slots == 3 and len(cache._chunks) == 2 and cache.nbytes == 2 * cache.chunk_nbytes
    assert sorted(cache.resident.tolist()) == [4, 5, 6]
    check_consistent(cache)
    assert (ptrs[2:] == 0).all() and (ptrs[:2] != 0).all() and ptrs.data_ptr() == table_ptr
    assert ptrs[0].item() == cache._chunk_views[0][("gate", "qw")].data_ptr()
    cache.resize(0)
    assert cache.nbytes == 0 and cache.resident.size == 0 and not cache.promote(1)
    check_consistent(cache)
    cache.resize(5)  # grows back: new chunks, empty slots filled by promotions
    assert len(cache._chunks) == 3 and cache.n_slots == 5
    for e in (1, 2, 3, 4, 5):
        assert cache.promote(e)
    cache.poll()
    check_consistent(cache)
    assert ptrs[2].item() == cache._chunk_views[2][("gate", "qw")].data_ptr()


def test_resize_waits_for_pending_copies():
    cache = LayerCache(host_experts(), 4, "cpu")
    cache.promote(3)
    cache.resize(2)
    assert cache.slot_of_host[3] >= 0 and not cache.pending
    check_consistent(cache)


def test_every_layer_and_stats():
    hosts = [host_experts(seed=i) for i in range(3)]
    cache = ExpertCache(hosts, 2, "cpu", slots_per_chunk=2)
    assert cache.slot_nbytes * 2 == cache.nbytes
    cache.record(1, np.array([0, 1]))
    cache.promote(1, 0)
    cache.poll()
    cache.record(1, np.array([0, 1]))
    s = cache.stats()
    assert (s["slots"], s["hits"], s["misses"], s["promotions"]) == (2, 1, 3, 1)
    assert s["hit_rate"] == pytest.approx(0.25)
    cache.resize(0)
    assert cache.nbytes == 0


def test_bad_input():
    with pytest.raises(ValueError, match="policy"):
        LayerCache(host_experts(), 2, "cpu", policy="fifo")
    cache = LayerCache(host_experts(), 2, "cpu")
    with pytest.raises(ValueError, match="outside"):
        cache.record(np.array([E]))
    with pytest.raises(ValueError, match="outside"):
        cache.promote(-1)
    with pytest.raises(ValueError, match="rows"):
        HostExperts({"gate": pack(np.zeros((5, 34), np.uint8), GGMLType.Q8_0)}, 2)


# ---- hit rates on routing traces ----------------------------------------------------------------


def routing_trace(steps: int, batch: int, *, n_expert: int = 128, k: int = 8, zipf: float = 1.0,
                  reuse: float = 0.5, drift_every: int = 200, drift: float = 0.25, seed: int = 0) -> list[np.ndarray]:
    """Per step [batch, k] distinct expert ids per token: popularity Zipf(``zipf``) over a
    permutation of the experts; each of a sequence's previous experts kept with probability
    ``reuse`` (temporal locality), the rest drawn by popularity; every ``drift_every`` steps a
    ``drift`` share of the ranks swap places (the topic moves)."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(n_expert)
    p_rank = 1.0 / np.arange(1, n_expert + 1) ** zipf
    p_rank /= p_rank.sum()
    prev = [rng.choice(n_expert, k, replace=False, p=p_rank[np.argsort(perm)]) for _ in range(batch)]
    out = []
    for step in range(steps):
        if step and step % drift_every == 0:
            idx = rng.choice(n_expert, int(drift * n_expert), replace=False)
            perm[idx] = perm[rng.permutation(idx)]
        p = p_rank[np.argsort(perm)]  # p[e]: expert e's popularity
        rows = []
        for b in range(batch):
            kept = prev[b][rng.random(k) < reuse]
            q = p.copy()
            q[kept] = 0
            fresh = rng.choice(n_expert, k - kept.size, replace=False, p=q / q.sum())
            prev[b] = np.concatenate([kept, fresh])
            rows.append(prev[b])
        out.append(np.stack(rows))
    return out


def hits_misses(trace: list[np.ndarray], n_slots: int, policy: str, max_promote: int | None,
                warmup: int = 100) -> tuple[int, int]:
    """Run the real LayerCache over a trace: each step record(ids), then promote the step's
    misses (at most ``max_promote`` a step, the most used first: PCIe's budget), poll."""
    cache = LayerCache(_tiny_host(), n_slots, "cpu", policy=policy, slots_per_chunk=8)
    for i, ids in enumerate(trace):
        if i == warmup:
            cache.hits = cache.misses = 0
        cache.record(ids)
        missed = ids.reshape(-1)[cache.slot_of_host[ids.reshape(-1)] < 0]
        if missed.size:
            uniq, counts = np.unique(missed, return_counts=True)
            for e in uniq[np.argsort(-counts, kind="stable")][:max_promote]:
                cache.promote(int(e))
        cache.poll()
    return cache.hits, cache.misses


def hit_rate(trace: list[np.ndarray], n_slots: int, policy: str, max_promote: int | None) -> float:
    hits, misses = hits_misses(trace, n_slots, policy, max_promote)
    return hits / (hits + misses)


_TINY: list[HostExperts] = []


def _tiny_host() -> HostExperts:
    """128 experts of one Q8_0 row each: the bookkeeping runs for real, the copies are tiny."""
    if not _TINY:
        f = get_format(GGMLType.Q8_0)
        raw = f.random_blocks(128, np.random.default_rng(0))
        _TINY.append(HostExperts({"w": pack(raw.reshape(128, -1), GGMLType.Q8_0)}, 128, pin=False))
    return _TINY[0]


TRACES = {  # name: (batch, zipf, reuse)
    "b1 zipf0.8 reuse0.3": (1, 0.8, 0.3),
    "b1 zipf1.1 reuse0.5": (1, 1.1, 0.5),
    "b8 zipf0.8 reuse0.3": (8, 0.8, 0.3),
    "b8 zipf1.1 reuse0.5": (8, 1.1, 0.5),
}


def test_policy_hit_rates(capsys):
    """The default policy measures best (within 0.5 points) on every trace and cache size, with
    unlimited promotions and with 2 a step. Prints the table (docs: expert_cache.py)."""
    rows = []
    worst_gap = 0.0
    for name, (batch, zipf, reuse) in TRACES.items():
        trace = routing_trace(600, batch, zipf=zipf, reuse=reuse, seed=batch)
        for n_slots in (32, 64):
            for max_promote in (None, 2):
                rates = {p: hit_rate(trace, n_slots, p, max_promote) for p in POLICIES}
                rows.append((name, n_slots, max_promote, rates))
                worst_gap = max(worst_gap, max(rates.values()) - rates[DEFAULT_POLICY])
    with capsys.disabled():
        print(f"\n{'trace':22} {'slots':>5} {'promote':>7} " + " ".join(f"{p:>7}" for p in POLICIES))
        for name, n_slots, mp, rates in rows:
            print(f"{name:22} {n_slots:5d} {mp or 'all':>7} " + " ".join(f"{rates[p]:7.3f}" for p in POLICIES))
    assert worst_gap < 0.005, f"the default {DEFAULT_POLICY!r} trails another policy by {worst_gap:.3f}"


def test_hit_rate_sanity():
    trace = routing_trace(200, 1, seed=5)
    first_seen = sum(np.isin(ids, np.concatenate(trace[:i]), invert=True).sum()
                     for i, ids in enumerate(trace) if i >= 100)
    # every expert fits: after the warm-up a miss is an expert's first use
    assert hits_misses(trace, 128, "lru", None) == (100 * 8 - first_seen, first_seen)
    assert hit_rate(trace, 0, "lru", None) == 0.0
    small, large = (hit_rate(trace, n, DEFAULT_POLICY, None) for n in (16, 64))
    assert 0 < small < large < 1


# ---- free memory and the sizing rule (deimos.runtime.gpu_memory) --------------------------------

GiB, MiB = 1 << 30, 1 << 20


class Card:
    """A card of ``total`` bytes whose free bytes the test sets; ``read`` is the reader."""

    def __init__(self, total: int, free: int):
        self.total, self.free, self.now = total, free, 0.0

    def read(self) -> tuple[int, int]:
        return self.free, self.total

    def clock(self) -> float:
        return self.now


def test_free_memory_rereads_at_most_every_interval():
    card = Card(8 * GiB, 3 * GiB)
    mem = FreeMemory(card.read, card.clock, interval=0.1)
    assert (mem.free(), mem.total, mem.reads) == (3 * GiB, 8 * GiB, 1)
    card.free = 1 * GiB
    card.now = 0.05
    assert mem.free() == 3 * GiB and mem.reads == 1  # within 100 ms: the last value
    card.now = 0.1
    assert mem.free() == 1 * GiB and mem.reads == 2
    card.now = 0.15
    mem.free()
    assert mem.reads == 2


@pytest.mark.parametrize("total,step,want", [
    (8 * GiB, 0, 512 * MiB),  # 5% = 410 MiB: the floor
    (16 * GiB, 100 * MiB, 100 * MiB + int(0.05 * 16 * GiB)),
    (141 * 10**9, 0, 1 * GiB),  # H200 (and from 20 GiB): the cap
], ids=["8GiB", "16GiB", "H200"])
def test_headroom(total, step, want):
    assert headroom(total, step) == want


def test_headroom_is_the_engines_cards_not_the_devices():
    """80 GiB card with 8 GiB left to the engine: an 8 GiB card's headroom (512 MiB), not the
    big card's 1 GiB; a card_bytes above the device's total is the total."""
    card = Card(80 * GiB, 7 * GiB)
    mem = FreeMemory(card.read, card.clock)
    assert SlotSizer(mem, 100 * MiB, 128).headroom == 1 * GiB
    s = SlotSizer(mem, 100 * MiB, 128, step_bytes=64 * MiB, card_bytes=8 * GiB)
    assert s.headroom == 512 * MiB + 64 * MiB
    assert s.fit(7 * GiB, 0) == (7 * GiB - s.headroom - s.band) // (100 * MiB)
    assert SlotSizer(mem, 100 * MiB, 128, card_bytes=900 * GiB).card_bytes == 80 * GiB


def sizer(card: Card, slot_bytes: int = 100 * MiB, chunk_slots: int = 4, max_slots: int = 128):
    return SlotSizer(FreeMemory(card.read, card.clock), slot_bytes, max_slots, chunk_slots=chunk_slots)


def test_shrinks_at_once_below_the_headroom_to_leave_headroom_and_band():
    card = Card(8 * GiB, 2 * GiB)
    s = sizer(card)  # headroom 512 MiB, band 400 MiB (a chunk of 4 x 100 MiB)
    assert s.target(32) == 32  # 2 GiB free: above headroom + band, and growth waits
    card.free, card.now = 300 * MiB, 0.2  # someone took memory
    n = s.target(32)
    # free after the shrink = 300 MiB + (32 - n) * 100 MiB >= headroom + band, in whole chunks
    assert n % 4 == 0 and n < 32
    assert 300 * MiB + (32 - n) * 100 * MiB >= s.headroom + s.band
    assert 300 * MiB + (32 - n - 4) * 100 * MiB < s.headroom + s.band  # not a chunk more
    assert n == 24


def test_a_shrink_is_decided_again_only_on_a_reading_taken_after_it():
    """The squeeze on an H100: one reading of 0.34 GiB free (0.75 headroom) shrank 28 -> 16,
    and the calls within the reading's 0.1 s shrank again on it, to 0 slots, while 16 left
    the headroom free once the shrink's memory was back."""
    card = Card(8 * GiB, 2 * GiB)
    s = sizer(card)
    assert s.target(32) == 32
    card.free, card.now = 300 * MiB, 0.2
    assert s.target(32) == 24
    reads = s.memory.reads
    card.free += 8 * 100 * MiB  # the dropped chunks back to the driver; the clock has not moved
    assert s.target(24) == 24  # read again: the shrink's memory is free
    assert s.memory.reads == reads + 1
    card.now = 0.25
    assert s.target(24) == 24 and s.memory.reads == reads + 1  # no change: the reading holds


def test_grows_only_after_free_memory_stays_high():
    card = Card(8 * GiB, 4 * GiB)
    s = sizer(card)
    assert s.target(8) == 8  # could grow; the clock starts
    card.now = 0.5
    assert s.target(8) == 8
    card.now, card.free = 0.7, 600 * MiB  # a dip between headroom and headroom + band: hold, timer reset
    assert s.target(8) == 8
    card.now, card.free = 0.9, 4 * GiB
    assert s.target(8) == 8
    card.now = 1.85
    assert s.target(8) == 8  # 0.95 s above: not yet
    card.now = 1.95
    n = s.target(8)
    assert n == 8 + (4 * GiB - s.headroom - s.band) // (400 * MiB) * 4
    card.free -= (n - 8) * 100 * MiB  # the new slots took their memory
    card.now = 2.1
    assert s.target(n) == n  # nothing more fits: stays


def test_small_changes_do_not_resize():
    card = Card(8 * GiB, 1 * GiB)  # between headroom (512 MiB) and headroom + band + a chunk
    s = sizer(card)
    for i in range(30):
        card.now = 0.11 * i
        card.free = 1 * GiB + (i % 3 - 1) * 50 * MiB
        assert s.target(20) == 20


def test_caps_at_max_slots_and_zero():
    card = Card(80 * GiB, 70 * GiB)
    s = sizer(card, max_slots=30)
    s.target(0)
    card.now = 2.0
    assert s.target(0) == 30
    card.free, card.now = 0, 2.2
    # free 0: keep what leaves headroom (1 GiB cap) + band (400 MiB) free once the rest is given
    # back: 3000 - 1024 - 400 MiB = 15 slots, whole chunks of 4
    assert s.target(30) == 12
    assert s.target(0) == 0


def test_band_and_bad_input():
    assert sizer(Card(8 * GiB, 0), slot_bytes=MiB, chunk_slots=2).band == BAND_MIN
    with pytest.raises(ValueError, match="slot_bytes"):
        SlotSizer(FreeMemory(Card(GiB, GiB).read), 0, 8)


def test_visible_devices():
    assert visible_device(1, None) == 1
    assert visible_device(0, "3,1") == 3 and visible_device(1, "3, 1") == 1
    assert visible_device(0, "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6") == "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"
    with pytest.raises(ValueError, match="no device 2"):
        visible_device(2, "0,1")


def test_nvml_reader_on_this_machine():
    """No GPU here: None (the caller then uses torch_reader); on a GPU machine a real reader."""
    read = nvml_reader(0)
    if read is not None:
        free, total = read()
        assert 0 <= free <= total


def test_claimed_ranges_copy_each_expert_into_its_slot():
    """``claim_many`` + ``ranges``: the byte ranges the batched promotion's kernel copies
    (here with its reference, memmove) leave every slot as ``promote_many``'s copies do."""
    from deimos.kernels.copy_ranges import copy_ranges_reference

    cache = LayerCache(host_experts(), 4, "cpu", policy="lru", slots_per_chunk=3)
    for wanted in ([0, 5, 0, 2], [6, 1, 3, 4]):  # free slots (two chunks), then victims
        cache.record(np.array(wanted))
        claims = cache.claim_many(wanted)
        assert [e for e, _ in claims] == list(dict.fromkeys(wanted))[: len(claims)]
        desc = np.array([r for e, s in claims for r in cache.ranges(e, s)], np.int64)
        assert desc.shape[0] == len(claims) * len(cache.views)
        copy_ranges_reference(desc)
        for e, s in claims:
            cache.pending[s] = (e, None)
        cache.poll()
        check_consistent(cache)
        assert set(cache.resident.tolist()) >= {e for e, _ in claims}


def test_promote_batch_without_a_stream_is_each_layers_promote_many():
    hosts = [host_experts(seed=i) for i in range(3)]
    a, b = ExpertCache(hosts, 2, "cpu"), ExpertCache(hosts, 2, "cpu")
    wanted = [(0, 3), (2, 5), (0, 6), (1, 1), (0, 2), (2, 5)]
    got = a.promote_batch(wanted)
    assert got == [(0, 3), (0, 6), (2, 5), (1, 1)]  # by layer; at most 2 slots; no repeats
    for i, e in got:
        b.promote_many(i, [e])
    a.poll(), b.poll()
    for la, lb in zip(a.layers, b.layers):
        assert np.array_equal(la.slot_of_host, lb.slot_of_host)
        check_consistent(la)


def test_claims_layer_by_layer_then_one_start():
    """A decode step's way: each layer's promotion claimed after its answer, the copies
    started together after the last layer; without a stream the copies are made at the start;
    published by poll; a claim never started leaves its slot free."""
    hosts = [host_experts(seed=i) for i in range(3)]
    cache = ExpertCache(hosts, 2, "cpu")
    assert cache.batch_ready()
    claims = cache.claim(0, [4]) + cache.claim(2, [1, 1]) + cache.claim(1, [])
    assert [(i, e) for i, e, _ in claims] == [(0, 4), (2, 1)]
    cache.start_batch(claims, None)
    assert all(cache.layers[i].pending[s][0] == e for i, e, s in claims)
    cache.poll()
    for lay in cache.layers:
        check_consistent(lay)
    assert cache.layers[0].slot_of_host[4] >= 0 and cache.layers[2].slot_of_host[1] >= 0
    dropped = cache.claim(1, [3])  # a step that failed before its start: the slot stays free
    cache.poll()
    assert cache.layers[1].slot_of_host[3] < 0 and not cache.layers[1].pending
    assert cache.claim(1, [3]) == dropped  # the same free slot is claimed again
