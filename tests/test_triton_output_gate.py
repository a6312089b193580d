"""Gated attention's output gate (kernels.triton.output_gate) against its reference (the CPU
block's attn * sigmoid(gate)): the gate as the strided half of a q projection's output (each
head's query, then its gate), and the quantized output bit for bit as quantize_x of it."""

from __future__ import annotations

import pytest
import torch
from kernel_device import DEVICE  # sets TRITON_INTERPRET without a GPU: before the kernels

from deimos.kernels.activation import sigmoid_gate
from deimos.kernels.triton.output_gate import output_gate
from deimos.quant.triton.gemv_q8 import empty_quantized, quantize_x


@pytest.mark.parametrize("t", [1, 5])
def test_equals_the_reference_and_quantizes_its_output(t):
    g = torch.Generator().manual_seed(t)
    h, dh = 3, 64
    qg = (torch.randn(t, h, 2, dh, generator=g) * 3).to(DEVICE)  # query, then gate, per head
    gate = qg[:, :, 1]
    attn = torch.randn(t, h * dh, generator=g).to(DEVICE)
    want = sigmoid_gate(attn.cpu(), gate.cpu())
    got = output_gate(attn, gate)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6)
    qx = empty_quantized(t, h * dh, DEVICE)
    assert torch.equal(output_gate(attn, gate, quantized=qx), got)
    for name, a, b in zip(("xq", "xd", "xs"), quantize_x(got), qx):
        assert torch.equal(a, b), f"{name} differs"


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="attn"):
        output_gate(torch.randn(2, 30), torch.randn(2, 2, 16))
    with pytest.raises(ValueError, match="gate"):
        output_gate(torch.randn(2, 32), torch.randn(2, 16, 2).transpose(1, 2))
