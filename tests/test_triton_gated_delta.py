"""The gated delta rule's kernels (kernels.triton.gated_delta_decode / gated_delta_prefill)
against the float64 token-by-token recurrence (kernels.gated_delta.naive_reference), and the
chunked WY reference against that same oracle. Interpreter shapes: Dk = 16, Dv = 24 (a masked
state block), odd head counts; the real Dk = Dv = 128 is compiled for sm_90 by
tools/compile_kernels.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_device import DEVICE  # sets TRITON_INTERPRET without a GPU: before the kernels

from deimos.kernels.gated_delta import chunked_reference, key_head_index, naive_reference
from deimos.kernels.triton.gated_delta_decode import gated_delta_decode
from deimos.kernels.triton.gated_delta_prefill import gated_delta_prefill

DK, DV = 16, 24
SCALE = DK**-0.5


def _inputs(t: int, hk: int, hv: int, seed: int, dk: int = DK, dv: int = DV):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(t, hk, dk, generator=gen), dim=-1)
    k = F.normalize(torch.randn(t, hk, dk, generator=gen), dim=-1)
    v = torch.randn(t, hv, dv, generator=gen)
    g = F.logsigmoid(torch.randn(t, hv, generator=gen) + 2.0)  # decays around 0.9
    beta = torch.rand(t, hv, generator=gen) * 0.98 + 0.01
    return q, k, v, g, beta


def _state(hv: int, seed: int, dk: int = DK, dv: int = DV) -> torch.Tensor:
    return torch.randn(hv, dk, dv, generator=torch.Generator().manual_seed(seed)) * 0.5


def _rel(ref: torch.Tensor, out: torch.Tensor) -> float:
    out = out.to(torch.float64).cpu()
    assert torch.isfinite(out).all(), "non-finite elements (unwritten NaN poison?)"
    err = ((out - ref).norm() / ref.norm()).item()
    print(f"rel rms {err:.2e}, max diff {(out - ref).abs().max().item():.2e}")
    return err


def _dev(*xs):
    return [x.to(DEVICE).contiguous() for x in xs]


def _i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("chunk", [16, 64], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("head_map", ["grouped", "tiled"])
def test_chunked_reference_equals_naive_float64(chunk, head_map):
    q, k, v, g, beta = _inputs(150, 2, 6, seed=1)
    s0 = _state(6, seed=2)
    o1, s1 = naive_reference(q, k, v, g, beta, SCALE, s0, head_map, dtype=torch.float64)
    o2, s2 = chunked_reference(q, k, v, g, beta, SCALE, s0, head_map, chunk, dtype=torch.float64)
    assert _rel(o1, o2) < 1e-12 and _rel(s1, s2) < 1e-12


def test_head_maps_are_the_documented_ones():
    assert key_head_index(4, 2, "grouped").tolist() == [0, 0, 1, 1]
    assert key_head_index(4, 2, "tiled").tolist() == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="do not divide"):
        key_head_index(5, 2, "grouped")


@pytest.mark.parametrize("t", [1, 63, 64, 65, 130], ids=lambda t: f"T{t}")
def test_prefill_one_sequence_against_oracle(t):
    hk, hv = 1, 3
    q, k, v, g, beta = _inputs(t, hk, hv, seed=t)
    s0 = _state(hv, seed=100 + t)
    pool = torch.randn(4, hv, DK, DV)
    pool[2] = s0
    untouched = pool[[0, 1, 3]].clone()
    pool, *args = _dev(pool, q, k, v, g, beta)
    out = torch.full((t, hv, DV), float("nan"), device=DEVICE)
    gated_delta_prefill(*args, _i32([0, t]), pool, _i32([2]), SCALE, out=out)
    ro, rs = naive_reference(q, k, v, g, beta, SCALE, s0, dtype=torch.float64)
    assert _rel(ro, out) < 1e-5
    assert _rel(rs, pool[2]) < 1e-5
    assert torch.equal(pool[[0, 1, 3]].cpu(), untouched)


@pytest.mark.parametrize("head_map", ["grouped", "tiled"])
def test_prefill_varlen_equals_per_sequence_loop(head_map):
    hk, hv = 3, 9
    lens = [5, 70, 0, 64]  # an empty sequence keeps its slot
    slots = [3, 0, 1, 2]
    t = sum(lens)
    q, k, v, g, beta = _inputs(t, hk, hv, seed=7)
    pool0 = torch.randn(5, hv, DK, DV) * 0.5
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    pool, *args = _dev(pool0.clone(), q, k, v, g, beta)
    out = torch.full((t, hv, DV), float("nan"), device=DEVICE)
    gated_delta_prefill(*args, _i32(cu), pool, _i32(slots), SCALE, head_map, out=out)
    loop_pool = pool0.clone().to(DEVICE)
    for i, n in enumerate(lens):
        if not n:
            continue
        sl = slice(cu[i], cu[i + 1])
        one = _dev(q[sl], k[sl], v[sl], g[sl], beta[sl])
        o_one = gated_delta_prefill(*one, _i32([0, n]), loop_pool, _i32([slots[i]]), SCALE, head_map)
        assert torch.equal(out[sl], o_one), f"sequence {i}: packed != alone"
        ro, rs = naive_reference(q[sl], k[sl], v[sl], g[sl], beta[sl], SCALE, pool0[slots[i]],
                                 head_map, dtype=torch.float64)
        assert _rel(ro, out[sl]) < 1e-5 and _rel(rs, pool[slots[i]]) < 1e-5
    assert torch.equal(pool, loop_pool)
    assert torch.equal(pool[1].cpu(), pool0[1]) and torch.equal(pool[4].cpu(), pool0[4])


def test_prefill_padded_rows_belong_to_no_sequence():
    """A padded prefill graph's call: 90 rows, cu_seqlens [0, 70] and max_len 90 (the bucket's
    grid): the 70 real rows and the final state as the oracle's over those rows alone; the 20
    padding rows (NaN inputs) neither read nor written."""
    hk, hv, t, real = 1, 3, 90, 70
    q, k, v, g, beta = _inputs(t, hk, hv, seed=31)
    for x in (q, k, v):
        x[real:] = float("nan")
    g[real:], beta[real:] = float("nan"), float("nan")
    s0 = _state(hv, seed=32)
    pool, *args = _dev(s0[None].clone(), q, k, v, g, beta)
    out = torch.full((t, hv, DV), -7.0, device=DEVICE)
    gated_delta_prefill(*args, _i32([0, real]), pool, _i32([0]), SCALE, out=out, max_len=t)
    ro, rs = naive_reference(q[:real], k[:real], v[:real], g[:real], beta[:real], SCALE, s0,
                             dtype=torch.float64)  # fmt: skip
    assert _rel(ro, out[:real]) < 1e-5
    assert _rel(rs, pool[0]) < 1e-5
    assert bool((out[real:] == -7.0).all()), "a padding row was written"


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "graph-grid"])
def test_prefill_snapshot_inside_the_pass(padded):
    """snapshot [N, 2]: sequences of 150, 70, 40, 130 and 100 rows, their states after 80 rows
    (80 % 64 = 16: the chunk grid shifted, a 16-row chunk first), none, 40 (all of them),
    64 (the grid as without) and 16 (inside the first chunk) also in slots 6, -, 8, 9, 10:
    each snapshot the oracle's state over that prefix, the outputs and final states the
    oracle's over the whole sequences, the slot named without a snapshot untouched. The
    graph-grid case adds 30 padding rows past the last sequence and the bucket's max_len."""
    hk, hv = 2, 6
    lens, snaps = [150, 70, 40, 130, 100], [80, 0, 40, 64, 16]
    slots, to = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    t = sum(lens) + 30 * padded
    q, k, v, g, beta = _inputs(t, hk, hv, seed=41)
    pool0 = torch.randn(11, hv, DK, DV) * 0.5
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    pool, *args = _dev(pool0.clone(), q, k, v, g, beta)
    out = torch.full((t, hv, DV), -7.0, device=DEVICE)
    snapshot = _i32([[a, b] for a, b in zip(snaps, to)])
    gated_delta_prefill(*args, _i32(cu), pool, _i32(slots), SCALE, "tiled", out=out,
                        max_len=t if padded else None, snapshot=snapshot)  # fmt: skip
    for i, n in enumerate(lens):
        sl = slice(cu[i], cu[i + 1])
        ro, rs = naive_reference(q[sl], k[sl], v[sl], g[sl], beta[sl], SCALE, pool0[slots[i]],
                                 "tiled", dtype=torch.float64)  # fmt: skip
        assert _rel(ro, out[sl]) < 1e-5 and _rel(rs, pool[slots[i]]) < 1e-5, f"sequence {i}"
        if snaps[i]:
            pre = slice(cu[i], cu[i] + snaps[i])
            _, ss = naive_reference(q[pre], k[pre], v[pre], g[pre], beta[pre], SCALE,
                                    pool0[slots[i]], "tiled", dtype=torch.float64)  # fmt: skip
            assert _rel(ss, pool[to[i]]) < 1e-5, f"sequence {i}'s snapshot after {snaps[i]} rows"
    assert torch.equal(pool[[0, 7]].cpu(), pool0[[0, 7]]), "a slot without a snapshot was written"
    if padded:
        assert bool((out[sum(lens) :] == -7.0).all()), "a padding row was written"


@pytest.mark.parametrize("head_map", ["grouped", "tiled"])
def test_decode_batch_against_oracle(head_map):
    hk, hv, b = 3, 9, 4
    q, k, v, g, beta = _inputs(b, hk, hv, seed=11)
    pool0 = torch.randn(6, hv, DK, DV) * 0.5
    slots = [4, -1, 0, 2]  # row 1: a padded bucket row
    pool, *args = _dev(pool0.clone(), q, k, v, g, beta)
    out = torch.full((b, hv, DV), float("nan"), device=DEVICE)
    gated_delta_decode(*args, pool, _i32(slots), SCALE, head_map, out=out)
    for row, slot in enumerate(slots):
        if slot < 0:
            assert torch.equal(out[row].cpu(), torch.zeros(hv, DV))
            continue
        r = slice(row, row + 1)
        ro, rs = naive_reference(q[r], k[r], v[r], g[r], beta[r], SCALE, pool0[slot], head_map,
                                 dtype=torch.float64)
        assert _rel(ro[0], out[row]) < 1e-5 and _rel(rs, pool[slot]) < 1e-5
    for slot in (1, 3, 5):
        assert torch.equal(pool[slot].cpu(), pool0[slot])


def test_decode_128_state_block():
    """Dk = Dv = 128 (the models' heads): the kernel's real block shape, one head."""
    q, k, v, g, beta = _inputs(1, 1, 1, seed=5, dk=128, dv=128)
    s0 = _state(1, seed=6, dk=128, dv=128)
    pool, *args = _dev(s0[None].clone(), q, k, v, g, beta)
    out = torch.full((1, 1, 128), float("nan"), device=DEVICE)
    gated_delta_decode(*args, pool, _i32([0]), 128**-0.5, out=out)
    ro, rs = naive_reference(q, k, v, g, beta, 128**-0.5, s0, dtype=torch.float64)
    assert _rel(ro[0], out[0]) < 1e-5 and _rel(rs, pool[0]) < 1e-5


def test_prefill_then_decode_equals_uninterrupted_run():
    hk, hv, t_pre, t_dec = 1, 3, 67, 3
    q, k, v, g, beta = _inputs(t_pre + t_dec, hk, hv, seed=21)
    s0 = _state(hv, seed=22)
    pool = torch.zeros(2, hv, DK, DV)
    pool[1] = s0
    pool = pool.to(DEVICE)
    pre = _dev(q[:t_pre], k[:t_pre], v[:t_pre], g[:t_pre], beta[:t_pre])
    outs = [gated_delta_prefill(*pre, _i32([0, t_pre]), pool, _i32([1]), SCALE)]
    for i in range(t_pre, t_pre + t_dec):
        step = _dev(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1])
        out = torch.full((1, hv, DV), float("nan"), device=DEVICE)
        outs.append(gated_delta_decode(*step, pool, _i32([1]), SCALE, out=out))
    ro, rs = naive_reference(q, k, v, g, beta, SCALE, s0, dtype=torch.float64)
    assert _rel(ro, torch.cat(outs)) < 1e-5
    assert _rel(rs, pool[1]) < 1e-5


def test_bad_inputs_raise():
    q, k, v, g, beta = _dev(*_inputs(4, 2, 6, seed=3))
    pool = torch.zeros(2, 6, DK, DV, device=DEVICE)
    with pytest.raises(ValueError, match="do not divide"):
        gated_delta_decode(q, k, v[:, :5].contiguous(), g[:, :5].contiguous(),
                           beta[:, :5].contiguous(), pool[:, :5].contiguous(), _i32([0] * 4), SCALE)
    with pytest.raises(ValueError, match="pool"):
        gated_delta_decode(q, k, v, g, beta, pool.double(), _i32([0] * 4), SCALE)
    with pytest.raises(ValueError, match="slots"):
        gated_delta_decode(q, k, v, g, beta, pool, _i32([0, 1]), SCALE)
    with pytest.raises(ValueError, match="cu_seqlens"):
        gated_delta_prefill(q, k, v, g, beta, _i32([0, 4]), pool, _i32([0, 1]), SCALE)
    with pytest.raises(ValueError, match="head_map"):
        gated_delta_prefill(q, k, v, g, beta, _i32([0, 4]), pool, _i32([0]), SCALE, "interleaved")


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE == "cpu", reason="tf32 dots need the GPU")
@pytest.mark.parametrize("precision", ["ieee", "tf32"])
def test_prefill_real_heads_on_the_gpu(precision):
    """Dk = Dv = 128, 32 value heads over 16 key heads, 512 tokens in two sequences (qwen35 4B's
    layer): the float64 oracle within 1e-5 (ieee) or 5e-3 (tf32: 10-bit mantissas in the dots,
    fp32 sums; what the model runs)."""
    hk, hv, d, lens = 16, 32, 128, [300, 212]
    ins = [_inputs(n, hk, hv, seed=7 + i, dk=d, dv=d) for i, n in enumerate(lens)]
    s0 = [_state(hv, seed=20 + i, dk=d, dv=d) for i in range(2)]
    q, k, v, g, beta = (torch.cat([x[j] for x in ins]) for j in range(5))
    pool = torch.zeros(3, hv, d, d)
    pool[1], pool[2] = s0
    pool, *args = _dev(pool, q, k, v, g, beta)
    out = gated_delta_prefill(*args, _i32([0, lens[0], sum(lens)]), pool, _i32([1, 2]), d**-0.5,
                              precision=precision)
    bound = 1e-5 if precision == "ieee" else 5e-3
    at = 0
    for i, n in enumerate(lens):
        ro, rs = naive_reference(*(x for x in ins[i]), d**-0.5, s0[i], dtype=torch.float64)
        assert _rel(ro, out[at : at + n]) < bound
        assert _rel(rs, pool[1 + i]) < bound
        at += n
