"""The GPU weight layouts and the kernels over them besides the GEMV's own tests
(test_triton_gemv_q8.py): packing, the GEMV on real model tensors, the prefill path's fp16
dequantization and dequant-GEMM.

Oracles: deimos.quant's bit-exact decoders (the packed layout must decode to the same float32
bits) and ``gemv_ref`` (decode the GGUF bytes, multiply in float64). Without CUDA the kernels run
in Triton's interpreter on CPU tensors (kernel_device sets TRITON_INTERPRET=1 before the kernels
are imported); with CUDA the same tests run on the GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernel_device import DEVICE  # noqa: I001  (first: sets TRITON_INTERPRET)

from testdata import model_path  # noqa: E402

from deimos.gguf import GGUFFile  # noqa: E402
from deimos.gguf.constants import GGMLType  # noqa: E402
from deimos.quant import dequantize, get_format  # noqa: E402
from deimos.quant.triton import PACKED_TYPES, gemv_q8, pack, quantize_x  # noqa: E402
from deimos.quant.triton.layout import KERNEL_TYPE  # noqa: E402
from deimos.quant.triton.gemv_q8 import quantize_x_reference  # noqa: E402
from deimos.quant.triton.naive import dequantize_packed, gemv_ref  # noqa: E402



def _blocks(t: GGMLType, n: int, k: int, seed: int) -> np.ndarray:
    fmt = get_format(t)
    rng = np.random.default_rng(seed)
    return fmt.random_blocks(n * k // fmt.block_size, rng).reshape(n, -1)


@pytest.mark.parametrize("t", PACKED_TYPES, ids=lambda t: t.name)
def test_pack_decodes_bit_exact(t: GGMLType) -> None:
    """The GPU layout holds exactly the GGUF bytes: decoded, it equals deimos.quant bit for bit.
    A format packed in another's layout (Q3_K as Q6_K codes) takes exactly that format's bytes
    (the formats in Q8_0's layout: a byte a code and their scales, f16 or f32, per 32 or 16)."""
    n, k = 7, 1024
    blocks = _blocks(t, n, k, seed=1)
    w = pack(blocks, t)
    if t in KERNEL_TYPE:
        fmt = get_format(KERNEL_TYPE[t])
        assert w.ggml_type == KERNEL_TYPE[t]
        if w.ggml_type == GGMLType.Q8_0:  # a byte a code, plus the scales (f16 or f32, per 32 or 16)
            d = w.tensors["d"]
            assert w.nbytes == n * k + d.numel() * d.element_size()
        else:
            assert w.nbytes == n * k // fmt.block_size * fmt.type_size
        assert w.nbytes < n * k * 2  # under fp16's
    else:
        assert w.nbytes == blocks.nbytes, "a repack must not widen the weights"
    ref = dequantize(blocks, t, (n, k))
    got = dequantize_packed(w).numpy()
    assert np.array_equal(ref.view(np.uint32), got.view(np.uint32))


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
    """The decode GEMV on the first rows of real model tensors: equal, up to float32 rounding,
    to the GGUF bytes decoded and multiplied with the integer activation's value."""
    with GGUFFile(model_path(model)) as f:
        info = f.tensors[tensor]
        rows, k = info.shape
        blocks = np.array(f.tensor_bytes(tensor)).reshape(rows, -1)[:48]
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(0))
    w = pack(blocks, info.ggml_type).to(DEVICE)
    out = torch.full((1, w.n), float("nan"), device=DEVICE)
    y = gemv_q8(w, quantize_x(x.to(DEVICE)), out=out)
    assert torch.isfinite(out).all(), f"{tensor}: outputs left unwritten"
    ref = gemv_ref(blocks, info.ggml_type, quantize_x_reference(x))
    rel = ((y.double().cpu() - ref).norm() / ref.norm()).item()
    assert rel < 1e-5, f"{tensor} ({info.ggml_type.name}): relative RMS error {rel:.2e}"


def test_pack_bad_input() -> None:
    with pytest.raises(ValueError, match="no GPU layout for F16"):
        pack(_blocks(GGMLType.F16, 2, 256, seed=0), GGMLType.F16)
    with pytest.raises(ValueError, match="whole number"):
        pack(np.zeros((2, 100), np.uint8), GGMLType.Q4_K)


@pytest.mark.parametrize("permuted", ["element_order", "element_order-even", "word_order", "word_order-even",
                                      "word_order-rule-small", "word_order-rule-big"])
@pytest.mark.parametrize("t", PACKED_TYPES, ids=lambda t: t.name)
def test_dequantize_fp16(t: GGMLType, permuted: str) -> None:
    """The prefill path's fp16 dequantization: the GGUF decoders' values rounded to fp16, in
    element order or in word order with ``permuted_columns`` naming each column's element
    (under the default tile, the GPU rule's two tiles, whose tiles do not divide this matrix,
    and under tiles that do: no masks)."""
    from deimos.models.gpu.dequant import DequantConfig, dequant_config, dequantize_fp16, permuted_columns

    cfg = {"word_order-even": DequantConfig(1, 16, 2), "element_order-even": DequantConfig(1, 16, 2),
           "word_order-rule-small": dequant_config(1, 32),
           "word_order-rule-big": dequant_config(1 << 14, 1 << 12)}.get(permuted)

    n, k = 5, 512
    blocks = _blocks(t, n, k, seed=4)
    want = torch.from_numpy(dequantize(blocks.reshape(-1), t, (n, k))).to(torch.float16)
    w = pack(blocks, t).to(DEVICE)
    out = torch.full((n, k), float("nan"), dtype=torch.float16, device=DEVICE)
    word_order = permuted.startswith("word_order")
    got = dequantize_fp16(w, out=out, permuted=word_order, cfg=cfg).cpu()
    if word_order:
        cols = permuted_columns(w).cpu()
        assert sorted(cols.tolist()) == list(range(k))
        got_natural = torch.empty_like(got)
        got_natural[:, cols] = got
        got = got_natural
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-3, atol=1e-3)


def test_dequantize_fp16_bad_tile() -> None:
    from deimos.models.gpu.dequant import DequantConfig, dequantize_fp16

    w = pack(_blocks(GGMLType.Q4_K, 2, 256, seed=0), GGMLType.Q4_K).to(DEVICE)
    for bad in (DequantConfig(3, 128, 4), DequantConfig(2, 2048, 4), DequantConfig(2, 128, 3)):
        with pytest.raises(ValueError, match="bad tile"):
            dequantize_fp16(w, permuted=True, cfg=bad)
