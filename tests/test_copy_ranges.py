"""The batched byte-range copy (deimos.kernels.triton.copy_ranges) against its reference
(deimos.kernels.copy_ranges): ranges of every word size, empty and multi-block ones, from
host memory (pinned on the GPU, read over PCIe) into device memory; and, on the GPU, the
expert cache's batched promotions (ExpertCache.promote_batch) leaving each slot with the
bytes ``promote_many``'s copy-engine calls leave."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernel_device import DEVICE  # noqa: I001  (first: sets TRITON_INTERPRET)

from deimos.kernels.copy_ranges import (  # noqa: E402
    by_word,
    check_ranges,
    copy_ranges_reference,
    range_word,
    range_words,
)
from deimos.kernels.triton.copy_ranges import BLOCK_BYTES, copy_ranges  # noqa: E402


def test_ranges_are_grouped_by_their_own_word():
    desc = np.array([[16, 32, 6], [16, 32, 64], [4, 8, 12], [1, 2, 3], [8, 8, 8]], np.int64)
    assert range_words(desc).tolist() == [2, 8, 4, 1, 8]
    d, groups = by_word(desc)
    assert groups == [(8, 0, 2), (4, 2, 3), (2, 3, 4), (1, 4, 5)]
    assert d.tolist() == [[16, 32, 64], [8, 8, 8], [4, 8, 12], [16, 32, 6], [1, 2, 3]]
    assert by_word(np.zeros((0, 3), np.int64))[1] == []


def test_grouped_launches_copy_what_the_reference_copies():
    """A batch mixing word sizes, one launch a group (the expert cache's promote_batch)."""
    rng = np.random.default_rng(5)
    src = torch.from_numpy(rng.integers(0, 256, 4096, dtype=np.uint8))
    if DEVICE == "cuda":
        src = src.pin_memory()
    dst = torch.zeros(4096, dtype=torch.uint8, device=DEVICE)
    ref = np.zeros(4096, dtype=np.uint8)
    rows = [(0, 0, 1024), (3, 1100, 7), (64, 1200, 512), (6, 1800, 6), (16, 2000, 100)]
    desc, groups = by_word(np.array([(src.data_ptr() + s, dst.data_ptr() + d, k) for s, d, k in rows], np.int64))
    assert [w for w, _, _ in groups] == [8, 4, 2, 1]
    dev = torch.from_numpy(desc).to(DEVICE)
    for w, a, b in groups:
        copy_ranges(dev[a:b], w, int(desc[a:b, 2].max()))
    copy_ranges_reference(np.array([(src.data_ptr() + s, ref.ctypes.data + d, k) for s, d, k in rows], np.int64))
    assert np.array_equal(dst.cpu().numpy(), ref)


def test_range_word_is_the_widest_common_alignment():
    assert range_word(np.array([[16, 32, 64], [8, 24, 8]], np.int64)) == 8
    assert range_word(np.array([[16, 32, 64], [4, 24, 8]], np.int64)) == 4
    assert range_word(np.array([[16, 34, 64]], np.int64)) == 2
    assert range_word(np.array([[16, 32, 63]], np.int64)) == 1
    assert range_word(np.zeros((0, 3), np.int64)) == 8


@pytest.mark.parametrize("bad", [np.zeros((2, 2), np.int64), np.zeros((2, 3), np.int32),
                                 np.array([[0, 0, -1]], np.int64)])
def test_bad_descriptors_are_named(bad):
    with pytest.raises(ValueError, match="copy ranges"):
        check_ranges(bad)


@pytest.mark.parametrize("align", [8, 4, 2, 1])
def test_copy_ranges_matches_the_reference(align):
    rng = np.random.default_rng(align)
    n = 3 * BLOCK_BYTES + 1000
    src = torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8))
    if DEVICE == "cuda":
        src = src.pin_memory()
    dst = torch.zeros(n, dtype=torch.uint8, device=DEVICE)
    ref = np.zeros(n, dtype=np.uint8)
    lengths = [5 * align, (2 * BLOCK_BYTES + 333) // align * align, 0, 3 * align]
    rows, off = [], align
    for j, length in enumerate(lengths):  # sources overlap, destinations do not
        rows.append((align * (7 + j), off, length))
        off += length + 3 * align
    desc = np.array([(src.data_ptr() + s, dst.data_ptr() + d, k) for s, d, k in rows], np.int64)
    assert range_word(desc) >= align  # base addresses are aligned further
    copy_ranges(torch.from_numpy(desc).to(DEVICE), align, int(desc[:, 2].max()))
    copy_ranges_reference(np.array([(src.data_ptr() + s, ref.ctypes.data + d, k) for s, d, k in rows], np.int64))
    assert np.array_equal(dst.cpu().numpy(), ref)
    assert ref.any()


def test_copy_ranges_refuses_bad_arguments():
    d = torch.zeros((1, 3), dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="word"):
        copy_ranges(d, 3, 8)
    with pytest.raises(ValueError, match="int64"):
        copy_ranges(d.int(), 8, 8)
    copy_ranges(d[:0], 8, 8)  # nothing to copy: no launch


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="the batched promotion runs on CUDA only")
def test_promote_batch_leaves_the_bytes_promote_many_does():
    from deimos.runtime.expert_cache import ExpertCache, HostExperts
    from deimos.quant.triton.layout import PackedWeight

    e, r = 16, 8
    g = torch.Generator().manual_seed(0)

    def host(seed):
        qw = torch.randint(-2**31, 2**31 - 1, (e * r, 12), dtype=torch.int32, generator=g)
        d = torch.randn(e * r, 3, generator=g).half()  # 6-byte rows: a 2-byte word
        return HostExperts({"gate": PackedWeight(12, e * r, 256, {"qw": qw, "d": d}),
                            "down": PackedWeight(12, e * r, 256, {"qw": qw.flip(0).contiguous()})}, e)

    hosts = [host(i) for i in range(3)]
    a = ExpertCache(hosts, 6, "cuda")
    b = ExpertCache(hosts, 6, "cuda")
    stream = torch.cuda.Stream()
    wanted = [(0, 3), (2, 5), (0, 9), (1, 1), (2, 5)]
    for step in range(3):  # free slots, then evictions
        want = [(i, (x + 5 * step) % e) for i, x in wanted]
        got = a.promote_batch(want, stream)
        torch.cuda.synchronize()
        assert got, "a batch after a finished one claims"
        for i, x in got:
            b.promote_many(i, [x])
        a.poll(wait=True)
        b.poll(wait=True)
        for la, lb in zip(a.layers, b.layers):
            assert np.array_equal(la.slot_of_host, lb.slot_of_host)
            assert torch.equal(la.slot_of.cpu(), torch.from_numpy(la.slot_of_host))
            for s in range(la.n_slots):
                if la.expert_in[s] >= 0:
                    for p, arrays in la.slot_arrays(s).items():
                        for n, t in arrays.items():
                            assert torch.equal(t, lb.slot_arrays(s)[p][n]), (p, n, s)
