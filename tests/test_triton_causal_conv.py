"""The causal convolution's decode step (kernels.triton.causal_conv_decode) against its reference
(causal_conv_update_reference: deimos.kernels.deltanet.causal_conv1d, ggml_ssm_conv, row by
row), and the reference against that oracle run over a whole sequence. Odd channel counts (a
masked channel block), K = 2 and 4, slots out of order, rows sharing a scratch slot."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_device import DEVICE  # sets TRITON_INTERPRET without a GPU: before the kernels

from deimos.kernels.deltanet import causal_conv1d
from deimos.kernels.triton.causal_conv_decode import (
    causal_conv_update,
    causal_conv_update_reference,
)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("k", [2, 4], ids=lambda k: f"K{k}")
@pytest.mark.parametrize("c", [37, 300], ids=lambda c: f"C{c}")
def test_update_equals_reference(c, k):
    """3 rows into slots 4, 1, 2 of a pool of 6: every slot equals the reference's bit for bit
    (the shift only copies), the outputs within float32 rounding (SiLU's exp and, on a GPU,
    fused multiply-adds)."""
    pool = torch.randn(6, c, k - 1, generator=_gen(1))
    x = torch.randn(3, c, generator=_gen(2))
    w = torch.randn(c, k, generator=_gen(3))
    slots = [4, 1, 2]
    want_pool = pool.clone()
    want = causal_conv_update_reference(x, w, want_pool, torch.tensor(slots))
    got_pool = pool.to(DEVICE)
    out = torch.full((3, c), float("nan"), device=DEVICE)
    causal_conv_update(x.to(DEVICE), w.to(DEVICE), got_pool, _i32(slots), out=out)
    torch.testing.assert_close(got_pool.cpu(), want_pool, rtol=0, atol=0)
    err = (out.cpu() - want).abs().max().item()
    print(f"C={c} K={k}: max diff {err:.2e}")
    torch.testing.assert_close(out.cpu(), want, rtol=1e-6, atol=2e-6)
    assert torch.equal(got_pool[[0, 3, 5]].cpu(), pool[[0, 3, 5]]), "an unnamed slot changed"


def test_steps_equal_the_convolution_over_the_sequence():
    """9 steps of one sequence through the kernel equal causal_conv1d over its 9 inputs at once
    from the same carried inputs (then SiLU), and the pool ends holding the last 3 inputs."""
    c, k = 45, 4
    x = torch.randn(9, c, generator=_gen(4))
    w = torch.randn(c, k, generator=_gen(5))
    s0 = torch.randn(k - 1, c, generator=_gen(6))
    y, s9 = causal_conv1d(x, w, s0)
    pool = torch.randn(3, c, k - 1, generator=_gen(7))
    pool[1] = s0.t()
    pool = pool.to(DEVICE)
    got = torch.cat([causal_conv_update(x[t : t + 1].to(DEVICE), w.to(DEVICE), pool, _i32([1])).cpu()
                     for t in range(9)])
    err = ((got - F.silu(y)).norm() / F.silu(y).norm()).item()
    print(f"9 steps vs one pass: rel rms {err:.2e}, max diff {(got - F.silu(y)).abs().max().item():.2e}")
    assert err < 1e-6
    torch.testing.assert_close(pool[1].cpu(), s9.t(), rtol=0, atol=0)


def test_padding_rows_on_a_shared_scratch_slot_leave_the_others():
    """Rows 1 and 2 name the scratch slot 0 (graph padding): the live rows' outputs and slots are
    as without them, and no other slot changes."""
    c, k = 50, 4
    pool = torch.randn(4, c, k - 1, generator=_gen(8))
    x = torch.randn(3, c, generator=_gen(9))
    w = torch.randn(c, k, generator=_gen(10))
    alone_pool = pool.clone().to(DEVICE)
    alone = causal_conv_update(x[:1].to(DEVICE), w.to(DEVICE), alone_pool, _i32([3]))
    padded_pool = pool.clone().to(DEVICE)
    padded = causal_conv_update(x.to(DEVICE), w.to(DEVICE), padded_pool, _i32([3, 0, 0]))
    assert torch.equal(padded[:1], alone)
    assert torch.equal(padded_pool[1:], alone_pool[1:])  # slots 1, 2 untouched, slot 3 the same


def test_bad_inputs_are_named():
    x, w = torch.zeros(2, 8, device=DEVICE), torch.zeros(8, 4, device=DEVICE)
    pool = torch.zeros(3, 8, 3, device=DEVICE)
    with pytest.raises(ValueError, match="pool"):
        causal_conv_update(x, w, torch.zeros(3, 3, 8, device=DEVICE), _i32([1, 2]))
    with pytest.raises(ValueError, match="slots"):
        causal_conv_update(x, w, pool, torch.tensor([1, 2], device=DEVICE))
    with pytest.raises(ValueError, match="K >= 2"):
        causal_conv_update(x, torch.zeros(8, 1, device=DEVICE), pool, _i32([1, 2]))
    with pytest.raises(ValueError, match="out"):
        causal_conv_update(x, w, pool, _i32([1, 2]), out=torch.zeros(2, 9, device=DEVICE))
