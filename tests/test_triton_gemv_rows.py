"""The multi-row integer-activation GEMV (deimos.quant.triton.gemv_rows) against its oracles.

Oracles: gemv_q8 on each activation row alone with the same tile (the kernel must equal it bit
for bit: the same float expressions, the same group order), and ``gemv_ref`` (the GGUF bytes
decoded by deimos.quant, multiplied in float64) applied to ``quantize_x_reference`` (what the
two-plane activation represents): equal up to float32 rounding. Without CUDA the kernels run in
Triton's interpreter (dp4a emulated); gpu-marked tests use llama 8B shapes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_device import DEVICE, INTERPRETED  # before deimos: sets TRITON_INTERPRET

from deimos.gguf.constants import GGMLType
from deimos.quant import get_format
from deimos.quant.triton import PACKED_TYPES, pack
from deimos.quant.triton.gemv_q8 import (
    Q8Config,
    QuantizedX,
    gemv_q8,
    q8_config,
    quantize_x,
    quantize_x_reference,
)
from deimos.quant.triton.gemv_rows import RowsConfig, gemv_rows, rows_config
from deimos.quant.triton.layout import KERNEL_TYPE
from deimos.quant.triton.naive import gemv_ref


def _blocks(t: GGMLType, n: int, k: int, seed: int) -> np.ndarray:
    fmt = get_format(t)
    return fmt.random_blocks(n * k // fmt.block_size, np.random.default_rng(seed)).reshape(n, -1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu().reshape(-1), b.double().cpu().reshape(-1)
    return ((a - b).norm() / b.norm()).item()


def _same_sum(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same integer dot products summed in another order: bitwise equal under the
    interpreter; on the GPU the compiler may reorder the float sums (seen on the H200: up to
    6e-7 apart), so within 2e-6 of the row's largest magnitude (at least 1)."""
    if a.device.type == "cpu":
        return torch.equal(a, b)
    return (a - b).abs().max().item() <= 2e-6 * max(1.0, b.abs().max().item())


def _row(qx: QuantizedX, r: int) -> QuantizedX:
    return QuantizedX(*(a[r : r + 1] for a in qx))


def _check(t: GGMLType, n: int, k: int, rows: int, seed: int, cfg: RowsConfig | Q8Config | None = None) -> None:
    blocks = _blocks(t, n, k, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = (torch.randn(rows, k, generator=g) * torch.linspace(0.1, 3, k)).to(torch.float16)
    w = pack(blocks, t).to(DEVICE)
    qx = quantize_x(x.to(DEVICE))
    out = torch.full((rows, n), float("nan"), device=DEVICE)
    y = gemv_rows(w, qx, out=out, cfg=cfg)
    assert y is out
    assert torch.isfinite(out).all(), "outputs left unwritten"
    one = None if cfg is None else Q8Config(*cfg[:4])  # the same tile (prefetch: loads only)
    for r in range(rows):
        alone = gemv_q8(w, _row(qx, r), cfg=one)[0]
        diff = (y[r] - alone).abs().max().item()
        assert _same_sum(y[r], alone), f"{t.name} row {r}: differs from gemv_q8 alone by up to {diff:.3e}"
    rel = _rel(y, gemv_ref(blocks, t, quantize_x_reference(x)))
    assert rel < 1e-5, f"{t.name}: relative RMS error {rel:.2e} against the dequantized-x oracle"


@pytest.mark.parametrize("t", PACKED_TYPES, ids=lambda t: t.name)
def test_gemv_rows_every_format(t: GGMLType) -> None:
    _check(t, 37, 768, 3, seed=11)


# formats with their own code paths: nibble + min (Q4_K), fifth bit (Q5_0), high bits and two
# scales a group (Q6_K), bytes (Q8_0), a scale per 16 (IQ2_XS), crumbs (Q2_K); whole tiles
# (6 x 1024): the steps divide the groups (unmasked EVEN loads), rows past N clamped
ROW_TYPES = [GGMLType.Q4_K, GGMLType.Q5_0, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.IQ2_XS, GGMLType.Q2_K]


@pytest.mark.parametrize("rows", [2, 3, 5, 8], ids=lambda r: f"r{r}")
@pytest.mark.parametrize("t", ROW_TYPES, ids=lambda t: t.name)
def test_gemv_rows_row_counts(t: GGMLType, rows: int) -> None:
    _check(t, 37, 1280, rows, seed=rows)


@pytest.mark.parametrize("t", ROW_TYPES, ids=lambda t: t.name)
def test_gemv_rows_whole_tiles(t: GGMLType) -> None:
    _check(t, 6, 1024, 5, seed=6)


# the rule's kinds of tile (rows in registers with x broadcast, 1-2 groups a thread) and rows
# on warps; row tails (9 rows) and group tails (40 groups of 1280) masked
TILES = [Q8Config(4, 32, 1, True), Q8Config(2, 64, 2, True), Q8Config(4, 32, 4, False)]


@pytest.mark.parametrize("cfg", TILES, ids=lambda c: f"n{c.block_n}_s{c.block_s}_w{c.num_warps}_xb{int(c.xb)}")
@pytest.mark.parametrize("t", [GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0], ids=lambda t: t.name)
def test_gemv_rows_tiles(t: GGMLType, cfg: Q8Config) -> None:
    _check(t, 9, 1280, 2, seed=5, cfg=cfg)


# the next step's words loaded ahead (PREFETCH), with and without the high-bit array; the
# prefetch past the last group masked both when the steps divide the groups (6 x 1024, EVEN)
# and when they do not (9 x 1280); rows on warps once
PREFETCH_CASES = [(t, RowsConfig(4, 32, 1, True, True))
                  for t in (GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q5_0, GGMLType.Q8_0, GGMLType.Q2_K)]
PREFETCH_CASES.append((GGMLType.Q4_K, RowsConfig(2, 32, 4, False, True)))


@pytest.mark.parametrize("shape", [(9, 1280), (6, 1024)], ids=lambda s: "n{}_k{}".format(*s))
@pytest.mark.parametrize("case", PREFETCH_CASES,
                         ids=lambda c: f"{c[0].name}_n{c[1].block_n}_w{c[1].num_warps}_xb{int(c[1].xb)}")
def test_gemv_rows_prefetch(case: tuple[GGMLType, RowsConfig], shape: tuple[int, int]) -> None:
    _check(case[0], *shape, 3, seed=9, cfg=case[1])


def test_gemv_rows_one_row_is_gemv_q8() -> None:
    _check(GGMLType.Q4_K, 37, 768, 1, seed=2)


def test_gemv_rows_errors() -> None:
    w = pack(_blocks(GGMLType.Q4_K, 4, 256, seed=0), GGMLType.Q4_K).to(DEVICE)
    qx = quantize_x(torch.zeros(2, 256, device=DEVICE))
    with pytest.raises(ValueError, match="K = 512"):
        gemv_rows(w, quantize_x(torch.zeros(2, 512, device=DEVICE)))
    with pytest.raises(ValueError, match="9 activation rows"):
        gemv_rows(w, QuantizedX(*(torch.cat([a] * 5)[:9] for a in qx)))
    with pytest.raises(ValueError, match="contiguous"):
        gemv_rows(w, QuantizedX(qx.xq.t().contiguous().t(), qx.xd, qx.xs))  # column-major xq
    with pytest.raises(ValueError, match="out must be"):
        gemv_rows(w, qx, out=torch.empty(1, 4, device=DEVICE))
    for bad in (Q8Config(3, 32, 4), Q8Config(4, 48, 4), Q8Config(4, 8, 4), Q8Config(4, 32, 3)):
        with pytest.raises(ValueError, match="bad tile"):
            gemv_rows(w, qx, cfg=bad)


LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]


@pytest.mark.parametrize("t", list(dict.fromkeys(KERNEL_TYPE.get(t, t) for t in PACKED_TYPES)),
                         ids=lambda t: t.name)  # fmt: skip
def test_rows_config_is_the_measured_rule(t: GGMLType) -> None:
    """The rule at every llama 8B matrix: gemv_q8's one-row tile (rows on warps), at most 32
    groups a step (the H200 sweep's best tile at 2 and 4 rows for Q4_K and Q6_K); the
    x-broadcast and narrow tiles as gemv_q8's."""
    for n, k in LLAMA_8B:
        one = q8_config(t, n, k, 1)
        for rows in (2, 4, 8):
            cfg = rows_config(t, n, k, rows)
            want = tuple(one) if one.xb or one.block_s < 32 else (one.block_n, 32, one.num_warps, False)
            assert tuple(cfg[:4]) == want, f"{t.name} {n}x{k} at {rows} rows: {cfg}"


@pytest.mark.gpu
@pytest.mark.parametrize("shape", LLAMA_8B[:4], ids=lambda s: f"{s[0]}x{s[1]}")  # (the vocabulary's
# float64 oracle would take 4 GB: bench/sweep_gemv.py --rows covers the output matrix)
@pytest.mark.parametrize("t", [GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.Q5_K, GGMLType.IQ2_XS],
                         ids=lambda t: t.name)  # fmt: skip
def test_gemv_rows_gpu(t: GGMLType, shape: tuple[int, int]) -> None:
    """At the rule's tiles: row r equals gemv_q8 on row r with the same tile bit for bit; against
    gemv_q8 at its own (1-row) rule the max difference is printed; the time against gemv_q8 on
    all rows (one program per activation row)."""
    if INTERPRETED or not torch.cuda.is_available():
        pytest.fail("gpu test needs CUDA and TRITON_INTERPRET unset (run on the GPU machine)")
    from deimos.quant.triton.bench import time_graph

    n, k = shape
    blocks = _blocks(t, n, k, seed=7)
    w = pack(blocks, t).to("cuda")
    for rows in (2, 4, 8):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.float16)
        qx = quantize_x(x.cuda())
        cfg = rows_config(w.ggml_type, n, k, rows)
        out = torch.full((rows, n), float("nan"), device="cuda")
        y = gemv_rows(w, qx, out=out)
        assert torch.isfinite(y).all()
        assert _rel(y, gemv_ref(blocks, t, quantize_x_reference(x))) < 1e-5
        rule_diff = 0.0
        for r in range(rows):
            assert _same_sum(y[r], gemv_q8(w, _row(qx, r), cfg=Q8Config(*cfg[:4]))[0]), f"row {r} vs gemv_q8 at {cfg}"
            rule_diff = max(rule_diff, (y[r] - gemv_q8(w, _row(qx, r))[0]).abs().max().item())
        t_rows = time_graph(lambda qx=qx, out=out: gemv_rows(w, qx, out=out))
        t_q8 = time_graph(lambda qx=qx, out=out: gemv_q8(w, qx, out=out))
        print(f"PERF rows {t.name:5} {n:>6}x{k:<6} R={rows} {tuple(cfg)} {t_rows * 1e6:7.2f} us "
              f"(gemv_q8 {t_q8 * 1e6:7.2f} us); max |diff| vs gemv_q8's own rule {rule_diff:.2e}")
