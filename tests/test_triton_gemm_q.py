"""The batched decode GEMM over packed weights (deimos.quant.triton.gemm_q) against its oracles.

Oracles: ``gemm_q_reference`` (the packed layout decoded by ``naive.dequantize_packed``, bit
exact against deimos.quant, times x in float64): the kernel decodes each weight to fp16 for
the tensor cores, so it must agree to fp16 rounding (relative RMS < 1e-3); and the product of
the weights as the kernel's decode makes them (what it multiplies: its float16 decode,
``naive.dequantize_packed_half``, or its float32 one, the reference's weights rounded to fp16),
which it must equal up to float32 accumulation (< 1e-5): that pins the decode itself. Without CUDA the kernel
runs in Triton's interpreter on CPU tensors; gpu-marked tests use 8B shapes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_device import DEVICE, INTERPRETED  # first: sets TRITON_INTERPRET

from deimos.gguf.constants import GGMLType
from deimos.models.gpu.dequant import permuted_columns
from deimos.quant import get_format
from deimos.quant.triton.dequant_gemv import FMT_ID
from deimos.quant.triton.gemm_q import (
    HALF_DECODE,
    GemmQConfig,
    gemm_q,
    gemm_q_config,
    gemm_q_reference,
    k_runs,
    mmq_config,
    takes_elements,
)
from deimos.quant.triton.layout import PackedWeight, pack
from deimos.quant.triton.naive import dequantize_packed, dequantize_packed_half

# the kernels' formats, and formats packed in another's layout: Q3_K as Q6_K codes, the IQ /
# ternary / MXFP4 formats as Q8_0 codes with f16 scales (TQ2_0), f32 scales per 32 (IQ4_XS,
# MXFP4) or per 16 (IQ2_XS: SCALE16)
FORMATS = [*FMT_ID, GGMLType.Q3_K, GGMLType.IQ4_XS, GGMLType.IQ2_XS, GGMLType.TQ2_0, GGMLType.MXFP4]
LEGACY = [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0]  # blocks of 32


def _blocks(t: GGMLType, n: int, k: int, seed: int) -> np.ndarray:
    fmt = get_format(t)
    return fmt.random_blocks(n * k // fmt.block_size, np.random.default_rng(seed)).reshape(n, -1)


def _case(t: GGMLType, n: int, k: int, m: int, seed: int) -> tuple[PackedWeight, torch.Tensor]:
    """A packed random weight on DEVICE and fp16 activations [m, k] in element order (CPU)."""
    w = pack(_blocks(t, n, k, seed), t).to(DEVICE)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1)).to(torch.float16)
    return w, x


def _run(w: PackedWeight, x: torch.Tensor, cfg: GemmQConfig | None, elements: bool = False) -> torch.Tensor:
    """gemm_q's output (CPU) for x in element order: permuted for it, or (``elements``) as it
    is, reordered by mmq's loop."""
    xp = (x if elements else x[:, permuted_columns(w).cpu()]).contiguous().to(DEVICE)
    out = torch.full((x.shape[0], w.n), float("nan"), device=DEVICE)
    y = gemm_q(w, xp, out=out, cfg=cfg, x_permuted=not elements)
    assert y is out
    assert torch.isfinite(out).all(), "outputs left unwritten"
    return y.cpu()


def _check(w: PackedWeight, x: torch.Tensor, y: torch.Tensor, what: str,
           half: bool = HALF_DECODE) -> None:
    ref = gemm_q_reference(w, x).double()
    rel = ((y.double() - ref).norm() / ref.norm()).item()
    diff = (y.double() - ref).abs().max().item()
    # what the tensor cores multiply (GemmQConfig.half: the float16 decode's weights)
    w16 = (dequantize_packed_half(w) if half else dequantize_packed(w).to(torch.float16)).double()
    ref16 = x.double() @ w16.T
    rel16 = ((y.double() - ref16).norm() / ref16.norm()).item()
    print(f"{what}: rel RMS {rel:.2e} (max diff {diff:.2e}); vs fp16 weights {rel16:.2e}")
    assert rel < 1e-3, f"{what}: relative RMS error {rel:.2e} against gemm_q_reference"
    assert rel16 < 1e-5, f"{what}: {rel16:.2e} against the fp16-rounded weights' product"


# (n, k): odd row counts; k = 1024 and 512 put some formats' rows in whole steps of the
# interpreter's tile (no masks) and others in a part step (masked loads)
SHAPES = [(70, 1024), (200, 512)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"n{s[0]}_k{s[1]}")
@pytest.mark.parametrize("m", [2, 3, 16, 17, 64], ids=lambda m: f"m{m}")
@pytest.mark.parametrize("t", FORMATS, ids=lambda t: t.name)
def test_gemm_q_formats(t: GGMLType, m: int, shape: tuple[int, int]) -> None:
    """Every format under the default tile (on the interpreter: its tile, block_m 16/32/64)."""
    n, k = shape
    w, x = _case(t, n, k, m, seed=n + m)
    _check(w, x, _run(w, x, None), f"{t.name} m={m} {n}x{k}")


# tiles other than the default: narrow and wide rows, every block_m, split-K by 2 (whole
# and part steps), 3 (uneven runs) and 4, several stages. (16, 128, 64, 8, 4 stages) needs
# 352 KB of shared memory on Triton 3.6 (the H200, 2026-12-01): 2 stages here.
TILES = [GemmQConfig(16, 16, 16, 4, 3, 1, True), GemmQConfig(32, 32, 32, 4, 2, 2, True),
         GemmQConfig(64, 64, 8, 4, 3, 2, True), GemmQConfig(16, 128, 64, 8, 2, 3, True),
         GemmQConfig(64, 16, 32, 2, 1, 4, True),
         GemmQConfig(16, 32, 32, 4, 2, 1), GemmQConfig(32, 64, 16, 4, 3, 2)]


@pytest.mark.parametrize("cfg", TILES, ids=lambda c: "m{}_n{}_j{}_w{}_s{}_k{}{}".format(
    *c[:6], "" if c.half else "_f32"))
@pytest.mark.parametrize("t", [GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.Q5_0,
                               GGMLType.Q2_K, GGMLType.IQ2_XS], ids=lambda t: t.name)
def test_gemm_q_tiles(t: GGMLType, cfg: GemmQConfig) -> None:
    n, k = 37, 1536
    m = min(cfg.block_m, 13 if cfg.block_m == 16 else cfg.block_m - 5)
    w, x = _case(t, n, k, m, seed=5)
    _check(w, x, _run(w, x, cfg), f"{t.name} m={m} {cfg}", cfg.half)


# Q4_K, Q5_K and Q6_K through mmq's products: both of mmq_config's tile heights, K of 5 blocks
# whole and split into runs of whole blocks (2: 3 + 2, 3: 2 + 2 + 1, the last run short),
# float32 and float16 weights
MMQ_TILES = [GemmQConfig(16, 32, 32, 4, 1, 1, False, True), GemmQConfig(32, 64, 32, 4, 2, 2, False, True),
             GemmQConfig(16, 16, 32, 4, 2, 3, True, True), GemmQConfig(32, 32, 32, 4, 1, 1, True, True)]


@pytest.mark.parametrize("cfg", MMQ_TILES, ids=lambda c: "m{}_n{}_k{}{}".format(
    c.block_m, c.block_n, c.split_k, "_half" if c.half else ""))
@pytest.mark.parametrize("t", [GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.IQ4_XS,
                               GGMLType.IQ2_XS], ids=lambda t: t.name)
def test_gemm_q_mmq(t: GGMLType, cfg: GemmQConfig) -> None:
    """Q8_0's layout too: Q8_0 (float16 scales), IQ4_XS (float32), IQ2_XS (one a 16)."""
    n, k = 37, 1280
    m = 13 if cfg.block_m == 16 else 27
    w, x = _case(t, n, k, m, seed=9)
    wpg = 8 if w.ggml_type == GGMLType.Q8_0 else 4
    cfg = cfg._replace(block_j=8 * wpg)
    _check(w, x, _run(w, x, cfg), f"{t.name} m={m} {cfg}", cfg.half)


@pytest.mark.parametrize("cfg", MMQ_TILES[:2], ids=lambda c: f"m{c.block_m}_n{c.block_n}_k{c.split_k}")
@pytest.mark.parametrize("t", [GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0], ids=lambda t: t.name)
def test_gemm_q_mmq_elements(t: GGMLType, cfg: GemmQConfig) -> None:
    """x in the elements' order (``x_permuted=False``: no permuted copy), reordered in mmq's
    loop: the same product; a tile that is not mmq's refuses it."""
    n, k = 37, 1280
    m = 13 if cfg.block_m == 16 else 27
    w, x = _case(t, n, k, m, seed=11)
    cfg = cfg._replace(block_j=8 * (8 if w.ggml_type == GGMLType.Q8_0 else 4))
    _check(w, x, _run(w, x, cfg, elements=True), f"{t.name} m={m} {cfg} elements", cfg.half)
    with pytest.raises(ValueError, match="elements' order needs an mmq tile"):
        gemm_q(w, x.to(DEVICE), cfg=cfg._replace(mmq=False, block_j=16), x_permuted=False)


# Q4_K's 64-row forms: the weights the dot's first operand (SWAP), a group one K = 32 dot
# (JOIN), K whole and split into runs (3: 2 + 2 + 1 blocks)
WIDE_TILES = [GemmQConfig(64, 32, 32, 4, 1, 1, False, True, True, True),
              GemmQConfig(64, 16, 32, 4, 2, 3, False, True, True, False),
              GemmQConfig(64, 32, 32, 4, 1, 3, True, True, False, True)]


@pytest.mark.parametrize("elements", [False, True], ids=["words", "elements"])
@pytest.mark.parametrize("cfg", WIDE_TILES, ids=lambda c: f"n{c.block_n}_k{c.split_k}_swap{int(c.swap)}"
                                                          f"_join{int(c.join)}")
def test_gemm_q_mmq_swap_join(cfg: GemmQConfig, elements: bool) -> None:
    """The 64-row mmq tiles, x permuted or in element order; swap / join on another format
    than Q4_K is refused."""
    n, k, m = 37, 1280, 45
    w, x = _case(GGMLType.Q4_K, n, k, m, seed=13)
    _check(w, x, _run(w, x, cfg, elements=elements), f"Q4_K m={m} {cfg}", cfg.half)
    w6, x6 = _case(GGMLType.Q6_K, n, k, m, seed=13)
    with pytest.raises(ValueError, match="swap and join are Q4_K's mmq forms"):
        _run(w6, x6, cfg, elements=elements)


def test_gemm_q_mmq_config() -> None:
    """mmq's tile rule: 16 rows a tile up to 16 rows of x, then 32, then 64 with SWAP and JOIN;
    a step a block of 256 (what the kernel's runs need); splits into runs of whole blocks."""
    for n, k in ((4096, 4096), (1024, 4096), (28672, 4096), (4096, 14336), (512, 512), (1536, 8960)):
        for m in (5, 16, 17, 32, 33, 64):
            cfg = mmq_config(n, k, m)
            assert cfg.mmq and cfg.block_j == 32 and cfg.block_m == (16 if m <= 16 else 32 if m <= 32 else 64)
            assert cfg.swap == cfg.join == (m > 32)
            s_split, runs, _ = k_runs(k, 4, cfg)
            assert s_split % 8 == 0 and runs * s_split >= k // 32 > (runs - 1) * s_split
    w, x = _case(GGMLType.Q2_K, 8, 512, 4, seed=0)
    xp = x[:, permuted_columns(w).cpu()].contiguous().to(DEVICE)
    with pytest.raises(ValueError, match="mmq tiles are for Q4_K, Q5_K, Q6_K, Q8_0 with K a multiple of 256, "
                                         "the weight is Q2_K with K 512"):
        gemm_q(w, xp, cfg=mmq_config(8, 512, 4))
    w, x = _case(GGMLType.Q8_0, 8, 800, 4, seed=0)
    xp = x[:, permuted_columns(w).cpu()].contiguous().to(DEVICE)
    with pytest.raises(ValueError, match="the weight is Q8_0 with K 800"):
        gemm_q(w, xp, cfg=mmq_config(8, 800, 4, GGMLType.Q8_0))
    w, x = _case(GGMLType.Q4_K, 8, 512, 4, seed=0)
    xp = x[:, permuted_columns(w).cpu()].contiguous().to(DEVICE)
    with pytest.raises(ValueError, match="needs block_j 32"):
        gemm_q(w, xp, cfg=GemmQConfig(16, 16, 16, 4, 2, 1, False, True))


@pytest.mark.parametrize("split", [1, 2], ids=lambda s: f"split{s}")
@pytest.mark.parametrize("k", [96, 800], ids=lambda k: f"k{k}")
@pytest.mark.parametrize("t", LEGACY, ids=lambda t: t.name)
def test_gemm_q_legacy_k(t: GGMLType, k: int, split: int) -> None:
    """Formats of 32-element blocks at K a multiple of 32 but not of 256: part steps, a
    split whose last run is short."""
    n, m = 45, 5
    w, x = _case(t, n, k, m, seed=k)
    cfg = GemmQConfig(16, 32, 8, 4, 2, split)
    _check(w, x, _run(w, x, cfg), f"{t.name} k={k} split={split}")


def _rule_tiles(t: GGMLType) -> list[GemmQConfig]:
    """Every tile the rule gives for the benchmark shapes (llama 8B, qwen3 0.6B)."""
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096),
              (4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)]
    return sorted({gemm_q_config(t, n, k, m) for n, k in shapes for m in (2, 4, 8, 16, 32, 64)})


@pytest.mark.parametrize("t", [GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.Q2_K],
                         ids=lambda t: t.name)
def test_gemm_q_rule_tiles(t: GGMLType) -> None:
    """The GPU rule's tiles for real shapes, on a small matrix (their splits cut its short
    rows into fewer runs)."""
    n, k = 41, 1024
    cfgs = _rule_tiles(t)
    assert cfgs
    for cfg in cfgs:
        m = {16: 9, 32: 32, 64: 33}[cfg.block_m]
        w, x = _case(t, n, k, m, seed=cfg.block_n + cfg.split_k)
        _check(w, x, _run(w, x, cfg), f"{t.name} m={m} {cfg}")


def test_gemm_q_config_rule() -> None:
    """The rule's invariants: block_m pads M, K steps of 64-512 columns, enough programs on
    the H200 where the matrix is large; formats in another's layout get that format's tile."""
    for t in FMT_ID:
        for n, k in ((4096, 4096), (1024, 2048), (151936, 1024), (4096, 14336)):
            for m in (1, 2, 16, 17, 33, 64):
                cfg = gemm_q_config(t, n, k, m)
                assert cfg.block_m >= m and cfg.block_m in (16, 32, 64)
                nk = 32 // (8 if t == GGMLType.Q8_0 else 2 if t == GGMLType.Q2_K else 4)
                assert 64 <= cfg.block_j * nk <= 512
                programs = -(-n // cfg.block_n) * cfg.split_k
                # ~2 programs an SM of 132 where the matrix is large (8B's 16M+ weights)
                assert programs >= (200 if n * k >= 1 << 24 else 64), f"{t.name} {n}x{k} m={m}: {cfg}"
    assert gemm_q_config(GGMLType.IQ4_XS, 4096, 4096, 2) == gemm_q_config(GGMLType.Q8_0, 4096, 4096, 2)


def test_gemm_q_reference_is_element_order() -> None:
    """The oracle takes x in element order: equal to the dequantized matrix product."""
    w, x = _case(GGMLType.Q4_K, 9, 256, 2, seed=3)
    want = x.double() @ dequantize_packed(w).double().T
    assert torch.allclose(gemm_q_reference(w, x).double(), want, rtol=1e-6, atol=1e-6)


def test_gemm_q_one_row_and_new_out() -> None:
    w, x = _case(GGMLType.Q6_K, 23, 512, 1, seed=9)
    xp = x[:, permuted_columns(w).cpu()].contiguous().to(DEVICE)
    y = gemm_q(w, xp)
    assert y.shape == (1, 23) and y.dtype == torch.float32
    _check(w, x, y.cpu(), "Q6_K m=1 out=None")


def test_gemm_q_bad_input() -> None:
    w, x = _case(GGMLType.Q4_K, 8, 512, 4, seed=0)
    xp = x[:, permuted_columns(w).cpu()].contiguous().to(DEVICE)
    with pytest.raises(ValueError, match="must be float16"):
        gemm_q(w, xp.float())
    with pytest.raises(ValueError, match=r"x must be \[M, 512\]"):
        gemm_q(w, xp[:, :256].contiguous())
    with pytest.raises(ValueError, match=r"x must be \[M, 512\]"):
        gemm_q(w, xp[0])
    with pytest.raises(ValueError, match="M = 65"):
        gemm_q(w, torch.zeros(65, 512, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="M = 0"):
        gemm_q(w, torch.zeros(0, 512, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="unit column stride"):
        gemm_q(w, torch.zeros(512, 4, dtype=torch.float16, device=DEVICE).T)
    with pytest.raises(ValueError, match="out must be"):
        gemm_q(w, xp, out=torch.empty(4, 9, device=DEVICE))
    with pytest.raises(ValueError, match="block_m 16 < M = 17"):
        gemm_q(w, torch.zeros(17, 512, dtype=torch.float16, device=DEVICE),
               cfg=GemmQConfig(16, 16, 16, 4, 2))
    for bad in (GemmQConfig(24, 16, 16, 4, 2), GemmQConfig(16, 24, 16, 4, 2), GemmQConfig(16, 8, 16, 4, 2),
                GemmQConfig(16, 16, 1, 4, 2), GemmQConfig(16, 16, 12, 4, 2), GemmQConfig(16, 16, 16, 3, 2),
                GemmQConfig(16, 16, 16, 4, 0), GemmQConfig(16, 16, 16, 4, 2, 0),
                GemmQConfig(16, 16, 16, 4, 2, 1, "yes")):
        with pytest.raises(ValueError, match="bad tile"):
            gemm_q(w, xp, cfg=bad)
    f16 = PackedWeight(GGMLType.F16, 8, 512, {"qw": torch.zeros(8, 256, dtype=torch.int32)})
    with pytest.raises(ValueError, match="no kernel for F16"):
        gemm_q(f16, xp.cpu())


def test_sweep_runs_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    """bench/sweep_gemm_batch.py (run on the H200 later, in one short call) has no Python
    errors: its --tiny sweep, one format and one M, every tile checked and timed."""
    import importlib.util

    from testdata import REPO

    spec = importlib.util.spec_from_file_location("sweep_gemm_batch", REPO / "bench" / "sweep_gemm_batch.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    sweep.main(["--tiny", "--types", "Q6_K", "--rows", "3", "--jobs", "1"])
    text = capsys.readouterr().out
    assert "skipped" not in text and "WRONG" not in text and "no tile ran" not in text, text
    assert text.count("Q6_K ") >= 3 and "one tile for all shapes" in text, text


GPU_SHAPES = [(4096, 4096), (1024, 4096), (28672, 4096), (4096, 14336), (151936, 1024)]
PERIOD = 512  # the GPU test's weights: PERIOD random rows repeated (packing 117M weights is slow)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 16, 32, 64], ids=lambda m: f"m{m}")
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("t", [*FMT_ID, GGMLType.IQ2_XS], ids=lambda t: t.name)
def test_gemm_q_gpu(t: GGMLType, shape: tuple[int, int], m: int) -> None:
    """The launch rule's tiles at real shapes: every output row against the oracle of its
    period row, and the time (CUDA-graph replay) and GB/s of the weight's bytes."""
    if INTERPRETED or not torch.cuda.is_available():
        pytest.fail("gpu test needs CUDA and TRITON_INTERPRET unset (run on the GPU machine)")
    from deimos.quant.triton.bench import ROOF_GBS, time_graph

    n, k = shape
    small, x = _case(t, PERIOD, k, m, seed=7)
    reps = -(-n // PERIOD)
    w = PackedWeight(small.ggml_type, n, k, {a: v.repeat(reps, 1)[:n].contiguous()
                                             for a, v in small.tensors.items()})
    y = _run(w, x, None)
    ref = gemm_q_reference(small, x).double()[:, torch.arange(n) % PERIOD]
    rel = ((y.double() - ref).norm() / ref.norm()).item()
    assert rel < 1e-3, f"{t.name} {n}x{k} m={m}: relative RMS error {rel:.2e}"
    if takes_elements(w, m):  # the engine's call: x in element order
        y = _run(w, x, None, elements=True)
        rel = ((y.double() - ref).norm() / ref.norm()).item()
        assert rel < 1e-3, f"{t.name} {n}x{k} m={m} (x in element order): relative RMS error {rel:.2e}"
    xp = x[:, permuted_columns(w).cpu()].contiguous().cuda()
    out = torch.empty(m, n, device="cuda")
    sec = time_graph(lambda: gemm_q(w, xp, out=out))
    gbs = w.nbytes / sec / 1e9
    print(f"PERF gemm_q {t.name:5} {n:>6}x{k:<6} m={m:<2} {tuple(gemm_q_config(t, n, k, m))} "
          f"{sec * 1e6:7.2f} us {gbs:6.0f} GB/s {gbs / ROOF_GBS:4.0%} (weights partly in L2 when small)")


@pytest.mark.parametrize("t", [*FMT_ID, GGMLType.IQ4_XS], ids=lambda t: t.name)
def test_half_decode_fidelity(t: GGMLType) -> None:
    """The float16 decode's weights (``dequantize_packed_half``: scales and mins rounded to
    float16, then one rounding of the fused multiply-add) against the exact dequantized ones:
    where the scales are float16 already (Q4_0, Q5_0, Q8_0) equal to one rounding of the
    exact weight; elsewhere at most ~2.5x its error (Q4_K: ~1.9x, emulated)."""
    w, _ = _case(t, 64, 1024, 1, seed=11)
    exact = dequantize_packed(w).double()
    once = dequantize_packed(w).half().double()
    half = dequantize_packed_half(w).double()
    e_once = ((once - exact).norm() / exact.norm()).item()
    e_half = ((half - exact).norm() / exact.norm()).item()
    if t in (GGMLType.Q4_0, GGMLType.Q5_0, GGMLType.Q8_0):
        assert torch.equal(half, once)
    else:
        assert e_half <= 2.5 * e_once, f"{t.name}: {e_half:.2e} against one rounding's {e_once:.2e}"


def test_a_bad_decode_switch_is_named() -> None:
    """DEIMOS_DECODE_F16 other than 0 or 1: a named error when the kernels are imported."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "DEIMOS_DECODE_F16": "true"}
    r = subprocess.run([sys.executable, "-c", "import deimos.quant.triton.gemm_q"], env=env,
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode != 0 and "DEIMOS_DECODE_F16 must be 0 or 1, got 'true'" in r.stderr
