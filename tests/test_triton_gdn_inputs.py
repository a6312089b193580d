"""The Gated DeltaNet block's fused inputs (kernels.triton.gdn_inputs) against its reference
(gdn_inputs_reference: causal_conv1d, SiLU, the l2 norm, sigmoid and softplus in torch, as the
CPU block), and the reference against the decode conv's. Packed sequences of 0, 1, 2, 3, 40
and 70 rows (shorter than the carried window, one token block, several), decode rows
(cu_seqlens None), strided conv input, qwen3next's interleaved ssm_ba views, big gate inputs
(softplus's linear branch), and a sequence one row at a time against all at once."""

from __future__ import annotations

import pytest
import torch
from kernel_device import DEVICE  # sets TRITON_INTERPRET without a GPU: before the kernels

from deimos.kernels.triton.gdn_inputs import gdn_inputs, gdn_inputs_reference

HK, HV, DH, EPS = 2, 4, 16, 1e-6
C = (2 * HK + HV) * DH


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _case(t: int, k: int, seed: int, interleaved: bool):
    """(x as a strided view, weight, pool, b, alpha, dt_bias, ssm_a) on the CPU."""
    wide = torch.randn(t, C + 24, generator=_gen(seed))  # x: columns 8 .. 8 + C of each row
    x = wide[:, 8 : 8 + C]
    w = torch.randn(C, k, generator=_gen(seed + 1))
    pool = torch.randn(7, C, k - 1, generator=_gen(seed + 2))
    if interleaved:  # qwen3next's ssm_ba: per key head its r betas, then its r alphas
        r = HV // HK
        ba = torch.randn(t, HK, 2, r, generator=_gen(seed + 3)) * 4
        b, alpha = ba[:, :, 0], ba[:, :, 1]
    else:
        proj = torch.randn(t, 2 * HV + 3, generator=_gen(seed + 3)) * 4
        b, alpha = proj[:, None, 0:HV], proj[:, None, HV + 3 : 2 * HV + 3]
    alpha[0] = 30.0  # softplus(x) = x past 20
    dt_bias = torch.randn(HV, generator=_gen(seed + 4))
    decay = -torch.rand(HV, generator=_gen(seed + 5)) * 3
    return x, w, pool, b, alpha, dt_bias, decay


def _run(args, slots, cu):
    x, w, pool, b, alpha, dt_bias, decay = args
    want_pool = pool.clone()
    cu_cpu = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    want = gdn_inputs_reference(x, w, want_pool, torch.tensor(slots, dtype=torch.int32), cu_cpu,
                                b, alpha, dt_bias, decay, HK, HV, DH, EPS)  # fmt: skip
    d = [a.to(DEVICE) for a in args]
    if DEVICE != "cpu":  # keep the views' strides on the device
        d[0] = args[0].base.to(DEVICE)[:, 8 : 8 + C] if args[0].base is not None else d[0]
    got_pool = d[2] = pool.clone().to(DEVICE)  # args' pool stays as it was
    i32 = {"dtype": torch.int32, "device": DEVICE}
    got = gdn_inputs(d[0], d[1], got_pool, torch.tensor(slots, **i32),
                     None if cu is None else torch.tensor(cu, **i32), d[3], d[4], d[5], d[6],
                     HK, HV, DH, EPS,
                     max_len=None if cu is None else max(b - a for a, b in zip(cu, cu[1:])))  # fmt: skip
    return want, want_pool, [u.cpu() for u in got], got_pool.cpu()


@pytest.mark.parametrize("k", [2, 4], ids=lambda k: f"K{k}")
@pytest.mark.parametrize("interleaved", [False, True], ids=["qwen35", "qwen3next"])
def test_packed_sequences_equal_the_reference(k, interleaved):
    """Sequences of 3, 0, 70, 1, 2 and 40 rows into slots 5, 6, 1, 0, 3, 2: q, k, v, g and
    beta within float32 rounding, every named slot's carried inputs bit for bit (copies of
    inputs or of the old slot), slot 4 untouched."""
    lens = [3, 0, 70, 1, 2, 40]
    cu = [0]
    for m in lens:
        cu.append(cu[-1] + m)
    args = _case(cu[-1], k, 10 + k, interleaved)
    slots = [5, 6, 1, 0, 3, 2]
    want, want_pool, got, got_pool = _run(args, slots, cu)
    for name, a, b in zip("qkvgb", want, got):
        err = (a - b).abs().max().item()
        print(f"K={k} {name}: max diff {err:.2e}")
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=f"{name} differs")
    torch.testing.assert_close(got_pool, want_pool, rtol=0, atol=0)
    assert torch.equal(got_pool[4], args[2][4]), "an unnamed slot changed"
    norms = got[0].norm(dim=-1)
    assert ((norms - 1).abs() < 1e-3).all(), "q rows are not unit vectors"


def test_decode_rows_equal_the_reference_and_the_whole_sequence():
    """cu_seqlens None (one row a sequence, rows sharing nothing): equal to the reference; and
    9 one-row steps of one sequence equal the 9 rows in one packed call from the same slot
    (the carried window shifted row by row ends where the packed call leaves it)."""
    args = _case(3, 4, 40, False)
    want, want_pool, got, got_pool = _run(args, [4, 1, 2], None)
    for name, a, b in zip("qkvgb", want, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=f"{name} differs")
    torch.testing.assert_close(got_pool, want_pool, rtol=0, atol=0)
    x, w, pool, b, alpha, dt_bias, decay = (u.to(DEVICE) for u in _case(9, 4, 41, False))
    i32 = {"dtype": torch.int32, "device": DEVICE}
    one = torch.tensor([3], **i32)
    step_pool, whole_pool = pool.clone(), pool.clone()
    steps = [gdn_inputs(x[t : t + 1], w, step_pool, one, None, b[t : t + 1], alpha[t : t + 1],
                        dt_bias, decay, HK, HV, DH, EPS) for t in range(9)]  # fmt: skip
    whole = gdn_inputs(x, w, whole_pool, one, torch.tensor([0, 9], **i32), b, alpha, dt_bias,
                       decay, HK, HV, DH, EPS)  # fmt: skip
    for i, name in enumerate("qkvgb"):
        torch.testing.assert_close(torch.cat([s[i] for s in steps]), whole[i], rtol=1e-6,
                                   atol=1e-6, msg=f"{name} differs")  # fmt: skip
    torch.testing.assert_close(step_pool, whole_pool, rtol=0, atol=0)


def test_padded_rows_belong_to_no_sequence():
    """A padded prefill graph's call: 40 rows, cu_seqlens [0, 25], max_len 40 (the bucket's
    grid): the 25 real rows and the slot as the reference's over those rows alone; the NaN
    padding rows not read (every real output finite and equal)."""
    x, w, pool, b, alpha, dt_bias, decay = _case(40, 4, 60, False)
    x[25:], b[25:], alpha[25:] = float("nan"), float("nan"), float("nan")
    want_pool = pool.clone()
    want = gdn_inputs_reference(x[:25], w, want_pool, torch.tensor([2], dtype=torch.int32),
                                torch.tensor([0, 25], dtype=torch.int32), b[:25], alpha[:25],
                                dt_bias, decay, HK, HV, DH, EPS)  # fmt: skip
    i32 = {"dtype": torch.int32, "device": DEVICE}
    got_pool = pool.clone().to(DEVICE)
    got = gdn_inputs(x.to(DEVICE), w.to(DEVICE), got_pool, torch.tensor([2], **i32),
                     torch.tensor([0, 25], **i32), b.to(DEVICE), alpha.to(DEVICE),
                     dt_bias.to(DEVICE), decay.to(DEVICE), HK, HV, DH, EPS, max_len=40)  # fmt: skip
    for name, a, u in zip("qkvgb", want, got):
        torch.testing.assert_close(u[:25].cpu(), a, rtol=1e-5, atol=1e-5, msg=f"{name} differs")
    torch.testing.assert_close(got_pool.cpu(), want_pool, rtol=0, atol=0)


def test_bad_arguments_are_named():
    x, w, pool, b, alpha, dt_bias, decay = _case(4, 4, 50, False)
    slots = torch.zeros(1, dtype=torch.int32)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="x"):
        gdn_inputs(x[:, :-1], w, pool, slots, cu, b, alpha, dt_bias, decay, HK, HV, DH, EPS)
    with pytest.raises(ValueError, match="conv pool"):
        gdn_inputs(x, w, pool[:, :, :2], slots, cu, b, alpha, dt_bias, decay, HK, HV, DH, EPS)
    with pytest.raises(ValueError, match="cu_seqlens"):
        gdn_inputs(x, w, pool, slots, cu[:1], b, alpha, dt_bias, decay, HK, HV, DH, EPS)
    with pytest.raises(ValueError, match="one-row"):
        gdn_inputs(x, w, pool, slots, None, b, alpha, dt_bias, decay, HK, HV, DH, EPS)
    with pytest.raises(ValueError, match="alpha"):
        gdn_inputs(x, w, pool, slots, cu, b, alpha[:, :, :3], dt_bias, decay, HK, HV, DH, EPS)


def test_a_snapshot_row_leaves_the_carried_inputs_there_in_its_slot():
    """snapshot [N, 2]: sequences of 40, 70, 2 and 20 rows into slots 1, 2, 3, 6, snapshots
    after 16 rows (into slot 5), none (naming slot 5 too: it must not write it), after 1 row
    (K - 1 = 3 inputs reach into the old slot: slot 0) and after all 20 (the final carried
    inputs: slot 4). The pool bit for bit the reference's, each snapshot the carried inputs of
    its prefix run alone, the outputs and the sequences' own slots as without snapshots."""
    lens, k = [40, 70, 2, 20], 4
    cu = [0]
    for m in lens:
        cu.append(cu[-1] + m)
    x, w, pool, b, alpha, dt_bias, decay = _case(cu[-1], k, 21, False)
    slots, snap = [1, 2, 3, 6], [[16, 5], [0, 5], [1, 0], [20, 4]]
    want_pool = pool.clone()
    i32 = torch.int32
    want = gdn_inputs_reference(x, w, want_pool, torch.tensor(slots, dtype=i32),
                                torch.tensor(cu, dtype=i32), b, alpha, dt_bias, decay, HK, HV, DH,
                                EPS, snapshot=torch.tensor(snap, dtype=i32))  # fmt: skip
    got_pool = pool.clone().to(DEVICE)
    dev = {"dtype": i32, "device": DEVICE}
    got = gdn_inputs(x.to(DEVICE), w.to(DEVICE), got_pool, torch.tensor(slots, **dev),
                     torch.tensor(cu, **dev), b.to(DEVICE), alpha.to(DEVICE), dt_bias.to(DEVICE),
                     decay.to(DEVICE), HK, HV, DH, EPS, max_len=max(lens),
                     snapshot=torch.tensor(snap, **dev))  # fmt: skip
    torch.testing.assert_close(got_pool.cpu(), want_pool, rtol=0, atol=0)
    plain_pool = pool.clone()
    plain = gdn_inputs_reference(x, w, plain_pool, torch.tensor(slots, dtype=i32),
                                 torch.tensor(cu, dtype=i32), b, alpha, dt_bias, decay, HK, HV,
                                 DH, EPS)  # fmt: skip
    for a, g in zip(plain, got):
        torch.testing.assert_close(g.cpu(), a, rtol=1e-5, atol=1e-5)
    assert torch.equal(want_pool[slots], plain_pool[slots])
    # the snapshots against the conv state of each prefix on its own
    for i, (at, to) in enumerate(snap):
        if at:
            ref = pool.clone()
            gdn_inputs_reference(x[cu[i] : cu[i] + at], w, ref, torch.tensor([slots[i]], dtype=i32),
                                 torch.tensor([0, at], dtype=i32), b[cu[i] : cu[i] + at],
                                 alpha[cu[i] : cu[i] + at], dt_bias, decay, HK, HV, DH, EPS)  # fmt: skip
            assert torch.equal(got_pool[to].cpu(), ref[slots[i]]), f"sequence {i}'s snapshot"
