"""The routed-expert step on the GPU kernels (deimos.models.gpu.moe_ops.moe_step: router, top-k,
the experts' GEMVs or grouped GEMMs, the combine) against the float32 reference block.

Oracle: deimos.models.moe.moe_reference on the CPU reference model's block of the same file
(exact float32 over deimos.quant's dequantization). Not gpu-marked: one block of qwen3moe-tiny
under TRITON_INTERPRET=1 when there is no GPU (a token through moe_gemv, several through
moe_align + moe_gemm); gpu-marked: whole qwen3moe-tiny files against the reference (prefill and
decode logits, greedy tokens), as tests/test_gpu_model.py does for the dense architectures.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernel_device import DEVICE  # noqa: I001  (first: sets TRITON_INTERPRET)

from testdata import llama_cpp_path  # noqa: E402

from deimos.gguf import GGUFFile  # noqa: E402
from deimos.models import ARCHITECTURES, load_model  # noqa: E402
from deimos.models.gpu.moe_ops import ResidentSlots, moe_step  # noqa: E402
from deimos.models.moe import moe_reference  # noqa: E402
from deimos.models.weights import WeightSource  # noqa: E402
from deimos.synth import write_model  # noqa: E402

DONOR = "models/ggml-vocab-llama-spm.gguf"


@pytest.fixture(scope="module", params=["Q8_0", "Q4_K_M"])
def moe_file(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / f"qwen3moe-tiny-{request.param}.gguf"
    write_model(path, "qwen3moe", "qwen3moe-tiny", request.param, llama_cpp_path(DONOR), seed=11)
    return GGUFFile(path)


def _blocks(f: GGUFFile, layer: int):
    ref = load_model(f)
    ker = ARCHITECTURES[ref.config.arch](ref.config, WeightSource(f, DEVICE, kernels=True))
    return ref.layers[layer].moe, ker.layers[layer].moe


@pytest.mark.parametrize("tokens", [1, 5])
def test_moe_step_matches_the_reference_block(moe_file, tokens):
    ref_block, ker_block = _blocks(moe_file, 1)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, ref_block.router.shape[1], generator=g)
    want = moe_reference(x, ref_block)
    slots = ResidentSlots()(ker_block.n_expert, torch.device(DEVICE))
    got = moe_step(x.to(DEVICE), ker_block, slots).cpu()
    assert got.shape == want.shape and got.dtype == torch.float32
    rel = ((got - want).norm() / want.norm()).item()
    # int8 activations at one token (gemv_q8), fp16 activations for several (moe_gemm)
    assert rel < 2e-2, f"relative error {rel:.2e}"


def test_an_expert_off_the_device_contributes_nothing(moe_file):
    """slot -1 for every expert: the step's output is 0 (the CPU's share is added by the caller)."""
    _, ker_block = _blocks(moe_file, 0)
    x = torch.randn(3, ker_block.router.shape[1], generator=torch.Generator().manual_seed(2)).to(DEVICE)
    none = torch.full((ker_block.n_expert,), -1, dtype=torch.int32, device=DEVICE)
    for t in (1, 3):
        assert bool((moe_step(x[:t], ker_block, none) == 0).all())


@pytest.mark.gpu
def test_gpu_whole_qwen3moe_tiny(moe_file):
    from test_gpu_model import _compare_whole

    _compare_whole(moe_file, f"qwen3moe-tiny {Path(moe_file.path).name}")
