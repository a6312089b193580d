"""The fp16 tensor-core matmul (deimos.kernels.triton.matmul) against its float64 oracle:
under TRITON_INTERPRET=1 here at small shapes, on the GPU at real ones (``gpu`` marker)."""

from __future__ import annotations

from kernel_device import DEVICE, INTERPRETED  # noqa: I001  (sets TRITON_INTERPRET first)

import pytest
import torch

from deimos.kernels.triton.matmul import (
    GemvConfig,
    MatmulConfig,
    SplitScratch,
    gemv_f16,
    matmul_config,
    matmul_f16,
    matmul_reference,
    split_count,
)
from pdl_chain import assert_replays_match


def _inputs(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k + 16, generator=g).half()[:, :k]  # strided rows
    b = torch.randn(n, k, generator=g).half()
    return a, b


@pytest.mark.parametrize("k", [128, 96], ids=["even-k", "ragged-k"])
@pytest.mark.parametrize("cfg", [MatmulConfig(16, 32, 32, 4, 2), MatmulConfig(32, 16, 64, 2, 1), None,
                                 MatmulConfig(16, 32, 32, 4, 2, tma=True), MatmulConfig(32, 16, 64, 2, 1, tma=True)],
                         ids=["16x32", "32x16", "rule", "16x32-tma", "32x16-tma"])
def test_matmul_f16(cfg: MatmulConfig | None, k: int) -> None:
    """M and N not multiples of the tile (clamped loads, masked stores), strided a rows, K
    that the K step divides or not."""
    a, b = _inputs(21, 37, k, seed=1)
    out = torch.full((21, 37), float("nan"), device=DEVICE)
    got = matmul_f16(a.to(DEVICE), b.to(DEVICE), out=out, cfg=cfg).cpu()
    torch.testing.assert_close(got, matmul_reference(a, b), rtol=1e-4, atol=1e-4)


def test_matmul_f16_tma_unaligned_rows_fall_back() -> None:
    """A tile asking for TMA loads with rows the TMA unit cannot address (a row stride not a
    multiple of 16 bytes) runs the pointer loads instead: the same product, and a TMA tile
    with splits is refused."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(21, 96 + 3, generator=g).half()[:, :96]  # rows 198 bytes apart
    assert a.stride(0) == 99
    b = torch.randn(37, 96, generator=g).half()
    got = matmul_f16(a.to(DEVICE), b.to(DEVICE), cfg=MatmulConfig(16, 32, 32, 4, 2, tma=True)).cpu()
    torch.testing.assert_close(got, matmul_reference(a, b), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="one with tma"):
        matmul_f16(a.to(DEVICE), b.to(DEVICE), cfg=MatmulConfig(16, 32, 32, 4, 2, 2, tma=True))


def test_matmul_rule_takes_pointer_tiles_where_tma_cannot_run() -> None:
    """Past 256 rows the rule's TMA tiles (128 x 256 where that makes enough tiles) only where
    the TMA kernel runs; rows it cannot address (or a GPU without it) get the pointer kernel's
    own tiles, and the product is right."""
    assert matmul_config(2048, 28672, 4096, tma=True) == MatmulConfig(128, 256, 64, 8, 3, tma=True)
    assert matmul_config(512, 28672, 4096, tma=True) == MatmulConfig(128, 256, 64, 8, 4, tma=True)
    assert matmul_config(512, 4096, 4096, tma=True) == MatmulConfig(128, 128, 64, 4, 4, tma=True)
    assert matmul_config(512, 28672, 4096, tma=False) == MatmulConfig(128, 128, 64, 4, 4)
    assert matmul_config(2048, 28672, 4096, tma=False) == MatmulConfig(128, 256, 64, 8, 3)
    g = torch.Generator().manual_seed(6)
    a = torch.randn(300, 64 + 3, generator=g).half()[:, :64]  # rows 134 bytes apart: no TMA
    b = torch.randn(40, 64, generator=g).half()
    got = matmul_f16(a.to(DEVICE), b.to(DEVICE)).cpu()
    torch.testing.assert_close(got, matmul_reference(a, b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("k", [256, 96, 160], ids=["even-k", "ragged-k", "empty-last-split"])
@pytest.mark.parametrize("splits", [2, 3, 5])
def test_matmul_f16_split_k(splits: int, k: int) -> None:
    """K split over programs, the partials summed in split order by each tile's last program:
    the oracle's product; the same bits twice (the order never depends on which finishes
    last); the shared scratch's counters back at zero after each launch (the next reuses
    them); a split with no K steps (5 splits of 5 steps) adds zeros."""
    a, b = _inputs(21, 37, k, seed=7)
    a, b = a.to(DEVICE), b.to(DEVICE)
    scratch = SplitScratch(DEVICE)
    cfg = MatmulConfig(16, 16, 32, 4, 2, splits)
    outs = []
    for _ in range(2):
        out = torch.full((21, 37), float("nan"), device=DEVICE)
        outs.append(matmul_f16(a, b, out=out, cfg=cfg, scratch=scratch).cpu())
        assert not scratch.counters.any()
    torch.testing.assert_close(outs[0], matmul_reference(a.cpu(), b.cpu()), rtol=1e-4, atol=1e-4)
    assert torch.equal(outs[0], outs[1])
    alone = matmul_f16(a, b, cfg=cfg).cpu()  # a scratch of its own
    assert torch.equal(alone, outs[0])


def test_split_count_fills_the_sms() -> None:
    """The rule at 132 SMs and 16-row tiles (16 x 64, 128-column K steps): llama 8B's narrow
    matrices get splits, the wide ones none; K bounds the count."""
    assert split_count(448, 4096, 128, 132) == 1  # gate+up: 28672 rows
    assert split_count(64, 14336, 128, 132) == 5  # down
    assert split_count(64, 4096, 128, 132) == 5  # o
    assert split_count(16, 4096, 128, 132) == 8  # v
    assert split_count(16, 1024, 128, 132) == 2  # 8 K steps: 4 a split at least
    assert split_count(16, 256, 128, 132) == 1


def test_matmul_f16_rule_splits_with_a_scratch() -> None:
    """Without a cfg, a scratch lets the rule split (its 4 SMs on the CPU: 21 x 37 at 16 x 64
    tiles is 2 tiles, 8 K steps: 2 splits); the result is the oracle's."""
    a, b = _inputs(21, 37, 1024, seed=8)
    scratch = SplitScratch(DEVICE)
    got = matmul_f16(a.to(DEVICE), b.to(DEVICE), scratch=scratch).cpu()
    torch.testing.assert_close(got, matmul_reference(a, b), rtol=1e-4, atol=1e-4)
    assert not scratch.counters.any()


@pytest.mark.parametrize("k", [256, 96], ids=["even-k", "ragged-k"])
@pytest.mark.parametrize("cfg", [GemvConfig(4, 64, 2), GemvConfig(16, 32, 4), None], ids=["4x64", "16x32", "rule"])
def test_gemv_f16(cfg: GemvConfig | None, k: int) -> None:
    """One row: N not a multiple of the tile (clamped loads, masked stores), K that the step
    divides or not."""
    a, b = _inputs(1, 37, k, seed=5)
    out = torch.full((1, 37), float("nan"), device=DEVICE)
    got = gemv_f16(a.to(DEVICE), b.to(DEVICE), out=out, cfg=cfg).cpu()
    torch.testing.assert_close(got, matmul_reference(a, b), rtol=1e-4, atol=1e-4)


def test_gemv_f16_bad_input() -> None:
    a, b = _inputs(2, 5, 64, seed=6)
    a, b = a.to(DEVICE), b.to(DEVICE)
    with pytest.raises(ValueError, match="gemv_f16: a must be one row"):
        gemv_f16(a, b)
    with pytest.raises(ValueError, match="gemv_f16: a and b must be float16"):
        gemv_f16(a[:1].float(), b)
    with pytest.raises(ValueError, match="bad tile"):
        gemv_f16(a[:1], b, cfg=GemvConfig(8, 96, 4))
    assert not gemv_f16(a[:1, :0], b[:, :0]).any()


def test_matmul_f16_edges() -> None:
    a, b = _inputs(3, 5, 64, seed=2)
    assert matmul_f16(a[:0].to(DEVICE), b.to(DEVICE)).shape == (0, 5)
    z = matmul_f16(a[:, :0].to(DEVICE), b[:, :0].to(DEVICE))
    assert z.shape == (3, 5) and not z.any()


def test_matmul_f16_bad_input() -> None:
    a, b = _inputs(3, 5, 64, seed=3)
    a, b = a.to(DEVICE), b.to(DEVICE)
    with pytest.raises(ValueError, match=r"a must be \[M, K\] and b \[N, K\]"):
        matmul_f16(a, b[:, :32])
    with pytest.raises(ValueError, match="must be float16"):
        matmul_f16(a.float(), b)
    with pytest.raises(ValueError, match="unit column stride"):
        matmul_f16(a.T.contiguous().T, b)
    with pytest.raises(ValueError, match="1..8 splits"):
        matmul_f16(a, b, cfg=MatmulConfig(16, 16, 32, 4, 2, 9))
    with pytest.raises(ValueError, match="exceed the split scratch"):
        matmul_f16(a, b, cfg=MatmulConfig(128, 64, 32, 4, 2, 2))
    with pytest.raises(ValueError, match=r"out must be float32 \[3, 5\]"):
        matmul_f16(a, b, out=torch.zeros(3, 4, device=DEVICE))
    with pytest.raises(ValueError, match="bad tile"):
        matmul_f16(a, b, cfg=MatmulConfig(16, 24, 32, 4, 2))


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED, reason="real shapes need the GPU")
@pytest.mark.parametrize("m,n,k", [(2048, 6144, 4096), (512, 14336, 4096), (512, 4096, 4096),
                                   (77, 4096, 14336), (16, 6144, 4096), (1, 1024, 4096)])
def test_matmul_f16_gpu(m: int, n: int, k: int) -> None:
    """The launch rule at llama 8B's shapes against the oracle."""
    a, b = _inputs(m, n, k, seed=4)
    got = matmul_f16(a.to(DEVICE), b.to(DEVICE)).cpu()
    want = matmul_reference(a, b)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 1e-4, f"{matmul_config(m, n, k)}: relative RMS error {rel:.2e}"
    if m == 1:
        got = gemv_f16(a.to(DEVICE), b.to(DEVICE)).cpu()
        rel = ((got - want).norm() / want.norm()).item()
        assert rel < 1e-4, f"gemv_f16: relative RMS error {rel:.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED, reason="real shapes need the GPU")
@pytest.mark.parametrize("m,n,k", [(16, 4096, 14336), (16, 1024, 4096), (64, 4096, 4096), (4, 5120, 4096)])
def test_matmul_f16_split_gpu(m: int, n: int, k: int) -> None:
    """The rule with the model's scratch at llama 8B's narrow matrices (K split on the GPU, the
    programs racing for each tile's counter): the oracle's product, the same bits on every one
    of 20 launches, the counters back at zero."""
    a, b = _inputs(m, n, k, seed=9)
    a, b = a.to(DEVICE), b.to(DEVICE)
    scratch = SplitScratch(DEVICE)
    cfg = matmul_config(m, n, k)
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    assert split_count(tiles, k, cfg.block_k, scratch.n_sm) > 1
    first = matmul_f16(a, b, scratch=scratch)
    for _ in range(20):
        assert torch.equal(matmul_f16(a, b, scratch=scratch), first)
    torch.cuda.synchronize()
    assert not scratch.counters.any()
    want = matmul_reference(a.cpu(), b.cpu())
    rel = ((first.cpu() - want).norm() / want.norm()).item()
    assert rel < 1e-4, f"relative RMS error {rel:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16])
def test_ahead_waits_for_its_activation(monkeypatch, rows: int) -> None:
    """With PDL a matmul on a resident weight loads its first tile before waiting on the
    kernel before it (``ahead``); its activation must still be the one that kernel just
    wrote. A CUDA graph of 12 (RMSNorm writing its float16 rows, matmul or, for one row,
    gemv_f16) pairs, split-K included, replayed on new inputs: equal to the chain with the
    loads after the wait, run eagerly."""
    if INTERPRETED or not torch.cuda.is_available():
        pytest.fail("gpu test needs CUDA and TRITON_INTERPRET unset (run on the GPU machine)")
    import deimos.kernels.triton.matmul as mm
    from deimos.kernels.triton.norm import rms_norm
    from deimos.quant.triton.pdl import ahead_on

    assert ahead_on(torch.device("cuda")), "PDL off on this GPU: nothing to test"
    d = 2048
    g = torch.Generator().manual_seed(5)
    ws = [(torch.randn(d, d, generator=g) * d**-0.5).half().cuda() for _ in range(12)]
    norm_w = torch.rand(d, device="cuda") + 0.5
    scratch = SplitScratch("cuda")
    x = torch.empty(rows, d, device="cuda")

    def chain() -> torch.Tensor:
        h = x
        for w in ws:
            half = torch.empty(rows, d, dtype=torch.float16, device="cuda")
            rms_norm(h, norm_w, 1e-6, half=half)
            h = (mm.gemv_f16(half, w, ahead=True) if rows == 1
                 else mm.matmul_f16(half, w, scratch=scratch, ahead=True))  # fmt: skip
        return h

    assert_replays_match(chain, x, mm, monkeypatch)
