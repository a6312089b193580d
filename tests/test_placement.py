"""The dense-weight placement (deimos.models.gpu.placement): which linears get an fp16 copy, and
the QuantLinear rule that multiplies on it.

Oracle: the packed weight dequantized by the torch reference (``gemm_q_reference``: the packed
layout decoded bit-exactly, times x in float64); every row count of the rule (1 GEMV row, 2-4
GEMV rows, 5-64 gemm_q rows, longer prefill steps) with and without the copy. Under
TRITON_INTERPRET=1 when there is no GPU.
"""

from __future__ import annotations

import pytest
import torch

from kernel_device import DEVICE  # noqa: I001  (first: sets TRITON_INTERPRET)

from testdata import llama_cpp_path  # noqa: E402

from deimos.gguf import GGUFFile  # noqa: E402
from deimos.models import ARCHITECTURES, load_model  # noqa: E402
from deimos.models.gpu.placement import dense_bytes, place_dense, quant_linears  # noqa: E402
from deimos.models.weights import WeightSource  # noqa: E402
from deimos.gguf.constants import GGMLType  # noqa: E402
from deimos.models.gpu.linear import GEMV_ROWS  # noqa: E402
from deimos.quant.triton.gemm_q import MMQ_ROWS, gemm_q_reference  # noqa: E402
from deimos.synth import write_model  # noqa: E402

DONOR = "models/ggml-vocab-llama-spm.gguf"


@pytest.fixture(scope="module")
def kernel_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("placement") / "llama-tiny-Q4_K_M.gguf"
    write_model(path, "llama", "llama-tiny", "Q4_K_M", llama_cpp_path(DONOR), seed=3)
    f = GGUFFile(path)
    cfg = load_model(f).config
    return ARCHITECTURES[cfg.arch](cfg, WeightSource(f, DEVICE, kernels=True))


def test_every_quantized_linear_is_found_once(kernel_model):
    lins = quant_linears(kernel_model)
    # per layer: q/k/v as one group (or apart where their formats differ), o, gate/up, down
    names = [lin.name for lin in lins]
    assert len(names) == len(set(map(id, lins)))
    for i in range(kernel_model.config.n_layer):
        assert any(f"blk.{i}.attn_output" in n for n in names)
        assert any(f"blk.{i}.ffn_down" in n for n in names)
    assert sum(dense_bytes(lin) for lin in lins) == sum(2 * lin.packed.n * lin.packed.k for lin in lins)


def test_modes_and_memory_checks(kernel_model):
    with pytest.raises(ValueError, match="auto, on, off"):
        place_dense(kernel_model, "always")
    if DEVICE == "cpu":
        plan = place_dense(kernel_model, "auto")
        assert plan.dense == 0 and "not on a GPU" in plan.reason
    plan = place_dense(kernel_model, "auto", free_bytes=1 << 20)  # 1 MiB free: too little
    assert plan.dense == 0 and all(lin.dense is None for lin in quant_linears(kernel_model))
    with pytest.raises(ValueError, match="dense-weights on"):
        place_dense(kernel_model, "on", free_bytes=1 << 20)
    assert place_dense(kernel_model, "off").dense == 0


@pytest.mark.parametrize("which", ["ffn_down", "attn_q"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 17, 70])
def test_the_rule_with_and_without_the_copy_matches_the_reference(kernel_model, rows, which):
    """ffn_down (Q4_K: from 5 to 32 rows the copy is skipped for gemm_q, whose rule takes mmq
    on a GPU; the interpreter's tile here) and attn_q (Q5_0 at this model's K = 128) with and
    without a copy."""
    lin = next(lin for lin in quant_linears(kernel_model) if which in lin.name)
    assert (lin.ggml_type == GGMLType.Q4_K) == (which == "ffn_down")
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, lin.packed.k, generator=g).to(DEVICE)
    want = gemm_q_reference(lin.packed, x)
    scale = want.abs().max().item()
    lin.dense = None
    plain = lin(x).cpu()
    from deimos.models.gpu.dequant import dequantize_fp16

    lin.dense = dequantize_fp16(lin.packed)
    try:
        lin.inputs._x = None  # a fresh input (the cache keys on the tensor itself)
        dense = lin(x).cpu()
    finally:
        lin.dense = None
    # fp16 x (and int8 x for the GEMV rows) against float64: ~1e-3 of the output's scale
    assert (plain - want).abs().max().item() < 2e-2 * scale
    assert (dense - want).abs().max().item() < 2e-2 * scale
    if GEMV_ROWS < rows <= MMQ_ROWS and lin.ggml_type == GGMLType.Q4_K:
        assert torch.equal(dense, plain)  # Q4_K's 5..32 rows: gemm_q through mmq, copy or not
    elif rows >= 3:  # the copy's product: fp16 x times the exact fp16 decode, fp32 sums
        from deimos.kernels.triton.matmul import matmul_f16

        assert torch.equal(dense, matmul_f16(x.half(), dequantize_fp16(lin.packed)).cpu())
        assert (dense - want).abs().max().item() < 5e-3 * scale


def test_on_gives_every_linear_its_copy(kernel_model):
    lins = quant_linears(kernel_model)
    try:
        plan = place_dense(kernel_model, "on", free_bytes=None if DEVICE == "cpu" else 1 << 40)
        assert plan.dense == plan.linears == len(lins)
        for lin in lins:
            assert lin.dense is not None and lin.dense.shape == (lin.packed.n, lin.packed.k)
            assert lin.dense.dtype == torch.float16
    finally:
        for lin in lins:
            lin.dense = None


def test_a_group_lets_go_of_its_output_once_every_part_read_it(kernel_model):
    """A fused q/k/v or gate/up matrix computes once for its parts and then drops its output
    (kept, every layer's would live to the end of the step: GBs at 2048 tokens)."""
    from deimos.models.gpu.linear import LinearPart

    mlp = kernel_model.layers[0].mlp
    if not isinstance(mlp.gate, LinearPart):
        pytest.skip("gate and up are not one group in this file")
    group = mlp.gate.group
    x = torch.randn(3, group.linear.packed.k, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    g = mlp.gate(x)
    assert group._y is not None  # up has not read it yet
    u = mlp.up(x)
    assert group._y is None and group._x is None
    lin = group.linear
    full = lin(x).cpu()
    assert torch.equal(g.cpu(), full[:, : g.shape[1]]) and torch.equal(u.cpu(), full[:, g.shape[1]:])


def test_an_offloaded_models_kv_pool_is_one_or_two_contexts_or_a_named_error():
    """qwen3moe 30B-A3B's numbers (98,304 KV bytes a token, ~1.1 GB of weights on the device)
    on an 8 GB card: the default 4k context gets two contexts, an agent's 40k one (3.8 GiB), a
    64k context does not fit and the error names the longest that would."""
    from deimos.models.gpu.placement import offload_kv_tokens

    gib = 2**30
    bpt, other, act, free = 98_304, int(1.1 * gib), 256 << 20, int(7.3 * gib)
    assert offload_kv_tokens(4096, bpt, other, act, free) == 8192
    assert offload_kv_tokens(40960, bpt, other, act, free) == 40960
    with pytest.raises(ValueError, match=r"m.gguf: a 65536-token context needs 6.0 GiB of KV "
                                         r"cache.*use a context of at most 5[0-9]{4} tokens"):
        offload_kv_tokens(65536, bpt, other, act, free, "m.gguf")
    # the prompt staging ring counts: less room, the same 40k context no longer fits
    with pytest.raises(ValueError, match="at most"):
        offload_kv_tokens(40960, bpt, other, act, free, stage_bytes=2 * gib)
    with pytest.raises(ValueError, match="too small for this model"):
        offload_kv_tokens(4096, bpt, 7 * gib, act, free)
