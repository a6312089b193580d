"""The shared expert's gate and the MoE sum in one launch (kernels.triton.shared_gate) against
the CPU block's (deimos.models.moe.shared_gate_add):
strided rows, a width that leaves the row block part empty, in place (out = routed), and
gates driven to 0 and 1."""

from __future__ import annotations

import pytest
import torch
from kernel_device import DEVICE  # sets TRITON_INTERPRET without a GPU: before the kernels

from deimos.kernels.triton.shared_gate import shared_gate_add
from deimos.models.moe import shared_gate_add as cpu_shared_gate_add


def test_equals_the_cpu_block():
    g = torch.Generator().manual_seed(5)
    t, d = 6, 300
    wide = torch.randn(t, d + 20, generator=g)
    x = wide[:, 10 : 10 + d]
    x[0] *= 50  # a gate near 1 or 0: sigmoid's ends
    routed, shared = torch.randn(t, d, generator=g), torch.randn(t, d, generator=g)
    gate_inp = torch.randn(d, generator=g) * 0.1
    want = cpu_shared_gate_add(routed, shared, x, gate_inp)
    xd = wide.to(DEVICE)[:, 10 : 10 + d]
    got = shared_gate_add(routed.to(DEVICE), shared.to(DEVICE), xd, gate_inp.to(DEVICE))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    r = routed.clone().to(DEVICE)  # in place, as the GPU ops call it
    assert shared_gate_add(r, shared.to(DEVICE), xd, gate_inp.to(DEVICE), out=r) is r
    torch.testing.assert_close(r.cpu(), want, rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_named():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="shared"):
        shared_gate_add(torch.randn(2, 8), torch.randn(2, 7), x, torch.randn(8))
    with pytest.raises(ValueError, match="gate_inp"):
        shared_gate_add(torch.randn(2, 8), torch.randn(2, 8), x, torch.randn(9))
