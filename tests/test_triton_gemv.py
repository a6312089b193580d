"""Dequant-GEMV kernels (deimos.quant.triton) against their oracles.

Oracles: deimos.quant's bit-exact decoders (the packed layout must decode to the same float32
bits) and ``gemv_ref`` (decode the GGUF bytes, multiply in float64). Without CUDA the kernels run
in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1 is set here, before the kernels are
imported); with CUDA the same tests run on the GPU. Tests marked ``gpu`` use real model shapes,
print achieved bandwidth, and fail without CUDA (CI deselects them with ``-m "not gpu"``).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from testdata import model_path  # noqa: E402

from deimos.gguf import GGUFFile  # noqa: E402
from deimos.gguf.constants import GGMLType  # noqa: E402
from deimos.quant import dequantize, get_format  # noqa: E402
from deimos.quant.triton import PACKED_TYPES, gemv, pack, prepare_x  # noqa: E402
from deimos.quant.triton.layout import KERNEL_TYPE  # noqa: E402
from deimos.quant.triton.naive import dequantize_packed, gemv_ref  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cpu" if INTERPRETED else "cuda"
TOL = 1e-3  # relative RMS error, fp32 accumulation


def _blocks(t: GGMLType, n: int, k: int, seed: int) -> np.ndarray:
    fmt = get_format(t)
    rng = np.random.default_rng(seed)
    return fmt.random_blocks(n * k // fmt.block_size, rng).reshape(n, -1)


def _check(blocks: np.ndarray, t: GGMLType, x: torch.Tensor, label: str) -> None:
    """gemv on poisoned output vs gemv_ref: relative RMS error < TOL, every element written."""
    w = pack(blocks, t).to(DEVICE)
    b = 1 if x.dim() == 1 else x.shape[0]
    out = torch.full((b, w.n), float("nan"), device=DEVICE)
    y = gemv(w, x.to(DEVICE), out=out)
    assert y.shape == ((w.n,) if x.dim() == 1 else (b, w.n))
    unwritten = int((~torch.isfinite(out)).sum())
    assert unwritten == 0, f"{label}: {unwritten} outputs unwritten (still NaN)"
    ref = gemv_ref(blocks, t, x)
    diff = (y.double().cpu() - ref).reshape(-1)
    rel = (diff.norm() / ref.norm()).item()
    print(f"{label}: rel rms {rel:.2e}, max |diff| {diff.abs().max().item():.2e}")
    assert rel < TOL, f"{label}: relative RMS error {rel:.2e} >= {TOL}"


@pytest.mark.parametrize("t", PACKED_TYPES, ids=lambda t: t.name)
def test_pack_decodes_bit_exact(t: GGMLType) -> None:
    """The GPU layout holds exactly the GGUF bytes: decoded, it equals deimos.quant bit for bit.
    A format packed in another's layout (Q3_K as Q6_K codes) takes exactly that format's bytes
    (the formats in Q8_0's layout with float32 scales: 2 bytes more per 32)."""
    n, k = 7, 1024
    blocks = _blocks(t, n, k, seed=1)
    w = pack(blocks, t)
    if t in KERNEL_TYPE:
        fmt = get_format(KERNEL_TYPE[t])
        assert w.ggml_type == KERNEL_TYPE[t]
        wide = 2 * (n * k // 32) if w.tensors["d"].dtype == torch.float32 else 0
        assert w.nbytes == n * k // fmt.block_size * fmt.type_size + wide < n * k * 2  # under fp16's
    else:
        assert w.nbytes == blocks.nbytes, "a repack must not widen the weights"
    ref = dequantize(blocks, t, (n, k))
    got = dequantize_packed(w).numpy()
    assert np.array_equal(ref.view(np.uint32), got.view(np.uint32))


# (n, k, batch): n not a multiple of the 16-row tile, k = one super-block, several super-blocks
# (k/32 not a multiple of the 32-group step), batched x
SHAPES = [(37, 256, 1), (16, 768, 1), (5, 1280, 3)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "n{}_k{}_b{}".format(*s))
@pytest.mark.parametrize("t", PACKED_TYPES, ids=lambda t: t.name)
def test_gemv_random_blocks(t: GGMLType, shape: tuple[int, int, int]) -> None:
    n, k, b = shape
    blocks = _blocks(t, n, k, seed=n + k)
    g = torch.Generator().manual_seed(k)
    x = torch.randn(b, k, generator=g).to(torch.float16)
    _check(blocks, t, x[0] if b == 1 else x, f"{t.name} n={n} k={k} b={b}")


# real tensors of the test models (first rows, to keep the interpreter fast)
REAL = [
    ("gemma-3-270m-q4_k_m.gguf", "blk.0.attn_output.weight"),  # Q4_K 640 x 1024
    ("gemma-3-270m-q4_k_m.gguf", "blk.0.ffn_down.weight"),  # Q6_K 640 x 2048
    ("gemma-3-270m-q4_k_m.gguf", "blk.0.attn_k.weight"),  # Q5_0 256 x 640
    ("SmolLM2-135M-Instruct.Q4_1.gguf", "blk.0.ffn_down.weight"),  # Q4_1 576 x 1536
    ("SmolLM2-135M-Instruct.Q4_1.gguf", "token_embd.weight"),  # Q8_0 49152 x 576
]


@pytest.mark.parametrize("model,tensor", REAL, ids=[f"{m.split('-')[0]}:{t}" for m, t in REAL])
def test_gemv_real_tensor(model: str, tensor: str) -> None:
    with GGUFFile(model_path(model)) as f:
        info = f.tensors[tensor]
        rows, k = info.shape
        blocks = np.array(f.tensor_bytes(tensor)).reshape(rows, -1)[:48]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(k, generator=g, dtype=torch.float32)
    _check(blocks, info.ggml_type, x, f"{tensor} ({info.ggml_type.name})")


def test_prepared_x_is_shared() -> None:
    """One prepare_x serves projections of different formats and gives what raw x gives."""
    k = 512
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    xp = prepare_x(x)
    for t in (GGMLType.Q4_K, GGMLType.Q8_0):
        w = pack(_blocks(t, 9, k, seed=2), t).to(DEVICE)
        assert torch.equal(gemv(w, xp), gemv(w, x))


def test_bad_input_errors() -> None:
    w = pack(_blocks(GGMLType.Q4_K, 4, 256, seed=0), GGMLType.Q4_K).to(DEVICE)
    with pytest.raises(ValueError, match="K = 512"):
        gemv(w, torch.zeros(512, device=DEVICE))
    with pytest.raises(ValueError, match="batch 9"):
        gemv(w, torch.zeros(9, 256, device=DEVICE))
    with pytest.raises(ValueError, match="multiple of 32"):
        prepare_x(torch.zeros(100))
    with pytest.raises(ValueError, match="no GPU layout for Q2_K"):
        pack(_blocks(GGMLType.Q2_K, 2, 256, seed=0), GGMLType.Q2_K)
    with pytest.raises(ValueError, match="whole number"):
        pack(np.zeros((2, 100), np.uint8), GGMLType.Q4_K)


# ---- GPU: real shapes, correctness and achieved bandwidth ---------------------------------------

GPU_SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]  # (n, k) of an 8B model
GPU_TYPES = [GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.Q5_K, GGMLType.Q4_0,
             GGMLType.Q4_1, GGMLType.Q5_0]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 4], ids=lambda b: f"b{b}")
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("t", GPU_TYPES, ids=lambda t: t.name)
def test_gemv_gpu(t: GGMLType, shape: tuple[int, int], batch: int) -> None:
    if INTERPRETED or not torch.cuda.is_available():
        pytest.fail("gpu test needs CUDA and TRITON_INTERPRET unset (run on the GPU machine)")
    import triton.testing

    n, k = shape
    blocks = _blocks(t, n, k, seed=7)
    x = torch.randn(batch, k, generator=torch.Generator().manual_seed(1)).to(torch.float16)
    _check(blocks, t, x, f"{t.name} {n}x{k} b={batch}")
    w = pack(blocks, t).to("cuda")
    xp = prepare_x(x.cuda())
    out = torch.empty(batch, n, device="cuda")
    ms = triton.testing.do_bench(lambda: gemv(w, xp, out=out), warmup=50, rep=300)
    gbs = w.nbytes / (ms * 1e-3) / 1e9
    print(
        f"PERF {t.name:5} {n:>6}x{k:<6} b={batch} {ms * 1e3:8.2f} us  {gbs:7.0f} GB/s "
        f"({gbs / 4300:.0%} of 4.3 TB/s) weights {w.nbytes / 1e6:.1f} MB"
    )


@pytest.mark.parametrize("permuted", [False, True], ids=["element_order", "word_order"])
@pytest.mark.parametrize("t", PACKED_TYPES, ids=lambda t: t.name)
def test_dequantize_fp16(t: GGMLType, permuted: bool) -> None:
    """The prefill path's fp16 dequantization: the GGUF decoders' values rounded to fp16, in
    element order or in word order with ``permuted_columns`` naming each column's element."""
    from deimos.models.gpu.dequant import dequantize_fp16, permuted_columns

    n, k = 5, 512
    blocks = _blocks(t, n, k, seed=4)
    want = torch.from_numpy(dequantize(blocks.reshape(-1), t, (n, k))).to(torch.float16)
    w = pack(blocks, t).to(DEVICE)
    out = torch.full((n, k), float("nan"), dtype=torch.float16, device=DEVICE)
    got = dequantize_fp16(w, out=out, permuted=permuted).cpu()
    if permuted:
        cols = permuted_columns(w).cpu()
        assert sorted(cols.tolist()) == list(range(k))
        got_natural = torch.empty_like(got)
        got_natural[:, cols] = got
        got = got_natural
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("t", PACKED_TYPES, ids=lambda t: t.name)
def test_dequant_matmul(t: GGMLType) -> None:
    """The prefill dequant-GEMM (weights decoded tile by tile in registers, tensor-core dot)
    against the GGUF decoders' matrix times x, both rounded to fp16 as the kernel's inputs
    are; M and N not multiples of the tiles, x rows strided."""
    from deimos.models.gpu.dequant import dequant_matmul

    n, k, m = 37, 512, 5
    blocks = _blocks(t, n, k, seed=6)
    w16 = torch.from_numpy(dequantize(blocks.reshape(-1), t, (n, k))).to(torch.float16)
    xs = torch.randn(m, k + 32, generator=torch.Generator().manual_seed(8))[:, :k]  # strided rows
    want = xs.to(torch.float16).double() @ w16.double().T
    out = torch.full((m, n), float("nan"), device=DEVICE)
    got = dequant_matmul(pack(blocks, t).to(DEVICE), xs.to(DEVICE), out=out).double().cpu()
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 1e-3, f"{t.name}: relative RMS error {rel:.2e}"


def test_dequant_matmul_bad_input() -> None:
    from deimos.models.gpu.dequant import dequant_matmul

    w = pack(_blocks(GGMLType.Q4_K, 4, 256, seed=0), GGMLType.Q4_K).to(DEVICE)
    with pytest.raises(ValueError, match=r"x must be \[M, 256\]"):
        dequant_matmul(w, torch.zeros(3, 512, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous last dim"):
        dequant_matmul(w, torch.zeros(256, 3, device=DEVICE).T)
    with pytest.raises(ValueError, match="out must be contiguous float32"):
        dequant_matmul(w, torch.zeros(3, 256, device=DEVICE), out=torch.zeros(3, 5, device=DEVICE))
