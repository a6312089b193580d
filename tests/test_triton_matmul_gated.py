"""The gated MLP input in one launch (deimos.kernels.triton.matmul_gated) against its float64
oracle and against the two launches it replaces (matmul_f16, then gated_act): under
TRITON_INTERPRET=1 here at small shapes, on the GPU at llama 8B's (``gpu`` marker)."""

from __future__ import annotations

from kernel_device import DEVICE, INTERPRETED  # noqa: I001  (sets TRITON_INTERPRET first)

import pytest
import torch

from deimos.kernels.triton.activation import gated_act
from deimos.kernels.triton.matmul import MatmulConfig, matmul_f16
from deimos.kernels.triton.matmul_gated import gated_config, matmul_gated, matmul_gated_reference


def _inputs(m: int, f: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k + 16, generator=g).half()[:, :k]  # strided rows
    b = (torch.randn(2 * f, k, generator=g) / k**0.5 * 3).half()  # products of a few units
    return a, b


def _check(a: torch.Tensor, b: torch.Tensor, activation: str, cfg: MatmulConfig | None) -> None:
    m, f = a.shape[0], b.shape[0] // 2
    out = torch.full((m, f), float("nan"), dtype=torch.float16, device=DEVICE)
    got = matmul_gated(a.to(DEVICE), b.to(DEVICE), activation, out=out, cfg=cfg)
    assert got is out
    got = got.cpu().float()
    want = matmul_gated_reference(a, b, activation)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 2e-3, f"{activation} {cfg}: relative RMS error {rel:.2e} against the oracle"
    # the two launches it replaces, rounded to float16 as the down projection reads them
    y = matmul_f16(a.to(DEVICE), b.to(DEVICE))
    two = gated_act(y[:, :f], y[:, f:], activation).half().cpu().float()
    torch.testing.assert_close(got, two, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("k", [128, 96], ids=["even-k", "ragged-k"])
@pytest.mark.parametrize("cfg", [MatmulConfig(16, 32, 32, 4, 2), MatmulConfig(32, 64, 64, 2, 1), None,
                                 MatmulConfig(16, 32, 32, 4, 2, tma=True), MatmulConfig(32, 64, 32, 4, 1, tma=True)],
                         ids=["16x16", "32x32", "rule", "16x16-tma", "32x32-tma"])
def test_matmul_gated(cfg: MatmulConfig | None, k: int, activation: str) -> None:
    """M and F not multiples of the tile (clamped or next rows loaded, masked stores), strided
    a rows, K that the K step divides or not, both activations, pointer and TMA loads."""
    a, b = _inputs(21, 37, k, seed=1)
    _check(a, b, activation, cfg)


def test_matmul_gated_config_and_bad_input() -> None:
    """The rule splits matmul_f16's tile between gate and up and never splits K; bad operands
    and tiles get a ValueError naming what is wrong."""
    for m in (20, 64, 200, 512, 2048):
        cfg = gated_config(m, 14336, 4096)
        assert cfg.splits == 1 and cfg.block_n >= 32 and cfg.block_n % 2 == 0
    a, b = _inputs(5, 8, 64, seed=2)
    a, b = a.to(DEVICE), b.to(DEVICE)
    with pytest.raises(ValueError, match="unknown activation 'relu'"):
        matmul_gated(a, b, "relu")
    with pytest.raises(ValueError, match=r"b must be \[2F, K\].*got 15 rows"):
        matmul_gated(a, b[:15], "silu")
    with pytest.raises(ValueError, match=r"out must be float16 \[5, 8\]"):
        matmul_gated(a, b, "silu", out=torch.zeros(5, 8, device=DEVICE))
    with pytest.raises(ValueError, match="bad tile"):
        matmul_gated(a, b, "silu", cfg=MatmulConfig(16, 32, 32, 4, 2, 2))
    with pytest.raises(ValueError, match="float16"):
        matmul_gated(a.float(), b, "silu")
    assert matmul_gated(a[:0], b, "silu").shape == (0, 8)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED, reason="real shapes need the GPU")
@pytest.mark.parametrize("m", [2048, 512, 200, 48, 20])
def test_matmul_gated_gpu(m: int) -> None:
    """The rule at llama 8B's gate/up ([2 x 14336, 4096]): TMA tiles past 256 rows, the pointer
    loads below."""
    a, b = _inputs(m, 14336, 4096, seed=4)
    a = a.contiguous()  # the engine's rows: 16-byte aligned (TMA)
    _check(a, b, "silu", None)
