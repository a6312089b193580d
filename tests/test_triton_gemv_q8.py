"""The integer-activation GEMV (deimos.quant.triton.gemv_q8) against its oracles.

Oracles: ``quantize_x_reference`` (torch) for what the two-plane activation represents, and
``gemv_ref`` (the GGUF bytes decoded by deimos.quant, multiplied in float64) applied to that
dequantized activation: the kernel must equal it up to float32 rounding. The error against the
unquantized activation (the fixed-point rounding itself) is bounded separately. Without CUDA the
kernels run in Triton's interpreter (dp4a emulated); gpu-marked tests use 8B shapes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernel_device import DEVICE, INTERPRETED  # noqa: I001  (first: sets TRITON_INTERPRET)

from deimos.gguf.constants import GGMLType  # noqa: E402
from deimos.quant import get_format  # noqa: E402
from deimos.quant.triton import PACKED_TYPES, pack  # noqa: E402
from deimos.quant.triton.gemv_q8 import (  # noqa: E402
    PLANE_INT,
    Q8Config,
    gemv_q8,
    quantize_x,
    quantize_x_reference,
)
from deimos.quant.triton.naive import gemv_ref  # noqa: E402
from pdl_chain import assert_replays_match  # noqa: E402



def _blocks(t: GGMLType, n: int, k: int, seed: int) -> np.ndarray:
    fmt = get_format(t)
    return fmt.random_blocks(n * k // fmt.block_size, np.random.default_rng(seed)).reshape(n, -1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu().reshape(-1), b.double().cpu().reshape(-1)
    return ((a - b).norm() / b.norm()).item()


def test_quantize_x_matches_reference() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 640, generator=g) * torch.linspace(0.01, 30, 640)
    x[1, 32:64] = 0.0  # an all-zero group: scale 0, codes 0
    qx = quantize_x(x.to(DEVICE))
    ref = quantize_x_reference(x)
    planes = qx.xq.cpu().contiguous().view(torch.int8).view(3, 20, 2, 8, 4).int()  # [b, u, plane, q, j]
    fixed = planes[:, :, 0] * PLANE_INT + planes[:, :, 1]  # [b, u, q, j]: element 8j + q
    fixed = fixed.permute(0, 1, 3, 2).reshape(3, 20, 32)
    deq = (fixed.float() * qx.xd.cpu()[:, :, None]).view(3, 640)
    # the GPU's float division may put v a last bit off the reference's: a q2 rounding tie can
    # then go the other way, one code of the second plane (xd) at most
    step = qx.xd.cpu().repeat_interleave(32, dim=1)
    assert ((deq - ref).abs() <= step * 1.001 + 1e-12).all()
    assert ((deq - ref).abs() > 1e-6).sum() <= 3
    assert planes.abs().max() <= 127
    halves = fixed.view(3, 20, 2, 16).sum(dim=3).reshape(3, 40)
    assert torch.equal(qx.xs.cpu(), halves)
    assert _rel(ref, x) < 5e-5  # ~15 bits of every group's max


# (6, 1024, 1): the groups fill whole tiles (the unmasked EVEN path), rows past N clamped
SHAPES = [(37, 256, 1), (16, 768, 1), (5, 1280, 3), (6, 1024, 1)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "n{}_k{}_b{}".format(*s))
@pytest.mark.parametrize("t", PACKED_TYPES, ids=lambda t: t.name)
def test_gemv_q8_random_blocks(t: GGMLType, shape: tuple[int, int, int]) -> None:
    n, k, b = shape
    blocks = _blocks(t, n, k, seed=n + k)
    x = torch.randn(b, k, generator=torch.Generator().manual_seed(k)).to(torch.float16)
    w = pack(blocks, t).to(DEVICE)
    out = torch.full((b, n), float("nan"), device=DEVICE)
    y = gemv_q8(w, quantize_x(x.to(DEVICE)), out=out)
    assert torch.isfinite(out).all(), "outputs left unwritten"
    ref = gemv_ref(blocks, t, quantize_x_reference(x))
    rel = _rel(y, ref)
    assert rel < 1e-5, f"{t.name}: relative RMS error {rel:.2e} against the dequantized-x oracle"
    exact = gemv_ref(blocks, t, x.float())
    assert _rel(y, exact) < 1e-4, "activation rounding error larger than 15-bit fixed point makes"


# tiles other than the default: x broadcast over rows held in registers (xb), one row per
# program, rows on warps; row and group tails (37 rows, 40 groups) masked
TILES = [Q8Config(4, 32, 1, True), Q8Config(2, 64, 2, True), Q8Config(1, 32, 1, True),
         Q8Config(8, 16, 4, False), Q8Config(4, 64, 4, False)]


@pytest.mark.parametrize("k", [1280, 2048])  # 2048: 64 groups, whole tiles (unmasked loads)
@pytest.mark.parametrize("cfg", TILES, ids=lambda c: f"n{c.block_n}_s{c.block_s}_w{c.num_warps}_xb{int(c.xb)}")
@pytest.mark.parametrize("t", [GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.Q2_K, GGMLType.IQ2_XS],
                         ids=lambda t: t.name)
def test_gemv_q8_tiles(t: GGMLType, cfg: Q8Config, k: int) -> None:
    n, b = 37, 2
    blocks = _blocks(t, n, k, seed=3)
    x = torch.randn(b, k, generator=torch.Generator().manual_seed(4))
    w = pack(blocks, t).to(DEVICE)
    out = torch.full((b, n), float("nan"), device=DEVICE)
    y = gemv_q8(w, quantize_x(x.to(DEVICE)), out=out, cfg=cfg)
    assert torch.isfinite(out).all(), "outputs left unwritten"
    assert _rel(y, gemv_ref(blocks, t, quantize_x_reference(x))) < 1e-5


def test_gemv_q8_errors() -> None:
    w = pack(_blocks(GGMLType.Q4_K, 4, 256, seed=0), GGMLType.Q4_K).to(DEVICE)
    with pytest.raises(ValueError, match="K = 512"):
        gemv_q8(w, quantize_x(torch.zeros(512, device=DEVICE)))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_x(torch.zeros(100))
    with pytest.raises(ValueError, match="batch 9"):
        quantize_x(torch.zeros(9, 256))
    qx = quantize_x(torch.zeros(1, 256, device=DEVICE))
    for bad in (Q8Config(3, 32, 4), Q8Config(4, 48, 4), Q8Config(4, 8, 4), Q8Config(4, 32, 3)):
        with pytest.raises(ValueError, match="bad tile"):
            gemv_q8(w, qx, cfg=bad)


GPU_SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("t", PACKED_TYPES, ids=lambda t: t.name)
def test_gemv_q8_gpu(t: GGMLType, shape: tuple[int, int]) -> None:
    if INTERPRETED or not torch.cuda.is_available():
        pytest.fail("gpu test needs CUDA and TRITON_INTERPRET unset (run on the GPU machine)")
    from deimos.quant.triton.bench import ROOF_GBS, time_graph

    n, k = shape
    blocks = _blocks(t, n, k, seed=7)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(1)).to(torch.float16)
    w = pack(blocks, t).to("cuda")
    qx = quantize_x(x.cuda())
    out = torch.empty(1, n, device="cuda")
    y = gemv_q8(w, qx, out=out)
    assert _rel(y, gemv_ref(blocks, t, quantize_x_reference(x))) < 1e-5
    sec = time_graph(lambda: gemv_q8(w, qx, out=out))
    gbs = w.nbytes / sec / 1e9
    print(f"PERF q8 {t.name:5} {n:>6}x{k:<6} {sec * 1e6:7.2f} us {gbs:6.0f} GB/s {gbs / ROOF_GBS:4.0%}")


@pytest.mark.gpu
def test_gemv_q8_ahead_waits_for_its_activation(monkeypatch) -> None:
    """With PDL a GEMV loads its first weights before waiting on the kernel before it
    (``ahead``); its activation must still be the one that kernel just wrote. A CUDA graph
    of 12 (RMSNorm writing the quantized activation, GEMV) pairs, each GEMV reading what the
    norm before it wrote, replayed on new inputs: equal to the chain with the loads after the
    wait, run eagerly."""
    if INTERPRETED or not torch.cuda.is_available():
        pytest.fail("gpu test needs CUDA and TRITON_INTERPRET unset (run on the GPU machine)")
    import importlib

    gq = importlib.import_module("deimos.quant.triton.gemv_q8")  # the package re-exports a function of its name
    from deimos.kernels.triton.norm import rms_norm
    from deimos.quant.triton.pdl import ahead_on

    assert ahead_on(torch.device("cuda")), "PDL off on this GPU: nothing to test"
    d = 2048
    types = [GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0]
    ws = [pack(_blocks(types[i % 3], d, d, seed=20 + i), types[i % 3]).to("cuda") for i in range(12)]
    norm_w = torch.rand(d, device="cuda") + 0.5
    x = torch.empty(1, d, device="cuda")

    def chain() -> torch.Tensor:
        h = x
        for w in ws:
            q = gq.empty_quantized(1, d, "cuda")
            rms_norm(h, norm_w, 1e-6, quantized=q)
            h = gq.gemv_q8(w, q)
        return h

    assert_replays_match(chain, x, gq, monkeypatch)


def test_gemv_grid_holds_large_vocabularies() -> None:
    """gemma3's tied output matrix has 262144 rows: 65536 row tiles, one past CUDA's limit
    for grid axes 1 and 2 (a launch failed with "invalid argument" on the H200 when they were
    on axis 1). Row tiles go on axis 0 (limit 2^31 - 1)."""
    from deimos.quant.triton.dequant_gemv import gemv_grid

    for n in (262144, 1 << 22):
        tiles, cols = gemv_grid(n, 8, 4)
        assert tiles == n // 4 and cols == 8 and cols <= 65535 and tiles <= 2**31 - 1
    # and the kernels run with that grid (a small case in the interpreter)
    w = pack(_blocks(GGMLType.Q4_K, 9, 256, seed=1), GGMLType.Q4_K).to(DEVICE)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2))
    y = gemv_q8(w, quantize_x(x.to(DEVICE)))
    ref = gemv_ref(_blocks(GGMLType.Q4_K, 9, 256, seed=1), GGMLType.Q4_K, quantize_x_reference(x))
    assert _rel(y, ref) < 1e-5
