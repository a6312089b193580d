"""The Gated DeltaNet block's output norm (kernels.triton.gated_norm) against its reference
(rms_norm then SiLU(z), the CPU block's): z as the strided columns of a wider matrix, a row
count that leaves the last program part empty, float32 and fp16 gates."""

from __future__ import annotations

import pytest
import torch
from kernel_device import DEVICE  # sets TRITON_INTERPRET without a GPU: before the kernels

from deimos.kernels.norm import gated_rms_norm
from deimos.kernels.triton.gated_norm import rms_norm_gated
from deimos.quant.triton.gemv_q8 import empty_quantized, quantize_x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
def test_gated_norm_equals_the_reference(dtype):
    g = torch.Generator().manual_seed(3)
    t, hv, dh = 7, 5, 32
    o = torch.randn(t, hv, dh, generator=g) * 3
    wide = torch.randn(t, hv * dh + 40, generator=g).to(dtype)
    z = wide[:, 16 : 16 + hv * dh].view(t, hv, dh)
    w = torch.randn(dh, generator=g)
    want = gated_rms_norm(o, z.float(), w, 1e-6).reshape(t, hv * dh)
    wd = wide.to(DEVICE)
    got = rms_norm_gated(o.to(DEVICE), wd[:, 16 : 16 + hv * dh].view(t, hv, dh), w.to(DEVICE), 1e-6)
    assert got.shape == (t, hv * dh) and got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t", [1, 3])
def test_quantized_output_is_quantize_x_of_it(t):
    """With ``quantized`` the output's integer activation equals quantize_x of the output, bit
    for bit (a decode row's out projection reads it instead of quantizing again), and the
    output is the same."""
    g = torch.Generator().manual_seed(4)
    hv, dh = 3, 64
    o = (torch.randn(t, hv, dh, generator=g) * 2).to(DEVICE)
    z = torch.randn(t, hv, dh, generator=g).to(DEVICE)
    w = torch.randn(dh, generator=g).to(DEVICE)
    qx = empty_quantized(t, hv * dh, DEVICE)
    y = rms_norm_gated(o, z, w, 1e-6, quantized=qx)
    assert torch.equal(y, rms_norm_gated(o, z, w, 1e-6))
    want = quantize_x(y)
    for name, a, b in zip(("xq", "xd", "xs"), want, qx):
        assert torch.equal(a, b), f"{name} differs"


def test_bad_shapes_are_named():
    o = torch.randn(2, 3, 16)
    with pytest.raises(ValueError, match="z"):
        rms_norm_gated(o, torch.randn(2, 3, 8), torch.randn(16), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_gated(o, torch.randn(2, 3, 16), torch.randn(8), 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        rms_norm_gated(o.transpose(0, 1), torch.randn(3, 2, 16), torch.randn(16), 1e-6)
    with pytest.raises(ValueError, match="quantized"):
        rms_norm_gated(o, torch.randn(2, 3, 16), torch.randn(16), 1e-6, quantized=empty_quantized(2, 48, "cpu"))
