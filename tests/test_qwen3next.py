"""qwen3next (hybrid Gated DeltaNet + gated attention, routed experts + a shared expert) on the
CPU reference, against llama.cpp.

Oracles:
- llama.cpp (build 11434) on the random-weight qwen3next-tiny F32 files, in the current tensor
  layout (attn_qkv, attn_gate, ssm_ba) and the older converters' one (ssm_in: q, k, v, z per
  key head) (tools/make_qwen35_reference.py): logits to float32 noise, greedy tokens. The tiny
  files have 2 key heads and 4 value heads, so the grouped head map (value head h reads key
  head h // 2) differs from qwen35's tiled one (h % 2): taking the wrong one, or reading
  ssm_ba as [all betas | all alphas], moves the logits by units;
- llama.cpp's loader for what is an error (tensor shapes from the metadata, the layer pattern).
"""

from __future__ import annotations

import numpy as np
import pytest
from hybrid_support import (
    check_split_and_snapshot,
    config_of,
    forced_error,
    greedy_error,
    mix_mismatches,
    rebuild,
    ref_file,
    same_file,
)

from deimos.gguf import GGUFFile
from deimos.models import ConfigError, load_model
from deimos.models.qwen3next import Qwen3NextDeltaNet, Qwen3NextModel
from deimos.models.weights import WeightSource

PRESETS = ("qwen3next-tiny", "qwen3next-tiny-ssmin")
# measured max |logit error| on llama.cpp's top-8 (logits ~30): 5.0e-4 / 8.3e-4 forced (the two
# layouts), median 5e-5; a wrong head map or ba layout is off by units
TOLERANCE = 5e-3

pytestmark = pytest.mark.usefixtures("module_one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("qwen3next")
    return {p: rebuild(p, tmp) for p in PRESETS}


@pytest.fixture(scope="module")
def models(paths) -> dict:
    return {p: load_model(GGUFFile(path)) for p, path in paths.items()}


# ---- against llama.cpp -----------------------------------------------------------------------

@pytest.mark.parametrize("preset", PRESETS)
def test_regenerated_file_is_the_one_llama_cpp_ran(paths, preset):
    assert same_file(paths[preset], preset), "synth output changed: rerun tools/make_qwen35_reference.py"


@pytest.mark.parametrize("preset", PRESETS)
def test_forced_logits_equal_llama_cpp(models, preset):
    """Whole sequences in one step (35, 130 and 64 tokens: the chunked rule over 1-3 chunks)."""
    model = models[preset]
    blocks = [layer.mixer for layer in model.layers if layer.recurrent]
    assert len(blocks) == 3 and all(isinstance(b, Qwen3NextDeltaNet) for b in blocks)
    assert all(b.legacy == (preset == "qwen3next-tiny-ssmin") for b in blocks)
    worst = forced_error(model, preset)
    print(f"{preset} F32: forced, max |logit error| on llama.cpp's top-8 = {worst:.2e}")
    assert worst < TOLERANCE


@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_prefill_then_decode_equals_llama_cpp(models, preset):
    worst = greedy_error(models[preset], preset)
    print(f"{preset} F32: greedy, max |logit error| on llama.cpp's top-8 = {worst:.2e}")
    assert worst < TOLERANCE


def test_split_prefill_and_snapshot_equal_one_pass(models):
    check_split_and_snapshot(models["qwen3next-tiny"], ref_file("qwen3next-tiny")["forced"][1]["tokens"])


@pytest.mark.parametrize("preset", PRESETS)
def test_kernel_path_block_equals_the_reference(paths, models, preset):
    """Layer 0 (Gated DeltaNet) on the GPU path (deimos.models.gpu.deltanet_ops: the Triton
    gated delta kernels with qwen3next's projections and grouped head map; under
    TRITON_INTERPRET=1 without a GPU), the reference's matrices (``kernels=False,
    triton_ops=True``): 65 rows then one decode row against the reference block. A wrong head
    map or ba layout is off by units."""
    import torch
    from kernel_device import DEVICE
    from test_qwen35_gpu import _rel, block_rows

    ref = models[preset]
    ops = Qwen3NextModel(ref.config, WeightSource(GGUFFile(paths[preset]), DEVICE, kernels=False,
                                                  triton_ops=True))
    assert not ref.layers[0].mixer.kernels and ops.layers[0].mixer.kernels
    x = torch.randn(66, ref.config.n_embd, generator=torch.Generator().manual_seed(9))
    outs = {"ref": block_rows(ref.layers[0].mixer, ref, "cpu", x, reference=True),
            "ops": block_rows(ops.layers[0].mixer, ops, DEVICE, x)}
    rel = _rel(outs["ref"], outs["ops"])
    print(f"{preset} layer 0 on the kernel path: rel RMS {rel:.2e}")
    assert rel < 1e-4, f"{preset}: block output relative RMS error {rel:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("preset", PRESETS)
def test_gpu_whole_model_equals_the_reference(preset, tmp_path):
    """The whole model on CUDA (packed Q8_0 weights, the routed and shared experts' kernels, the
    gated delta kernels) against the CPU reference of the same Q8_0 file: 65 prompt tokens and
    3 decode steps, the routing apart (tests/moe_routing.py: the reference's routing forced,
    then the kernels' own). Under the interpreter (kernels on the CPU, 4 min a preset), forced:
    7.1e-3 / 1.0e-2 (qwen3next-tiny / ssmin), ssmin's decode 2.9e-2 (positions 64-65 amplify
    the prefill's fp16 roundings: the reference with those roundings gives the same); own
    routing 1.4e-2 / 5.8e-2, 1 / 11 positions flipped (ssmin's first at a gap of 0.0018)."""
    from moe_routing import compare_hybrid_moe
    from testdata import data_file

    from deimos.synth import write_model

    s = ref_file(preset)["synth"]
    path = write_model(tmp_path / f"{preset}-Q8_0.gguf", s["arch"], s["preset"], "Q8_0",
                       data_file(s["vocab_from"]), s["seed"])
    compare_hybrid_moe(GGUFFile(path), f"{preset} Q8_0", list(range(3, 3 + 65 * 7, 7)))


# ---- config and malformed files --------------------------------------------------------------

def test_config_reads_the_fields(paths):
    cfg = config_of(paths["qwen3next-tiny"])
    assert cfg.recurrent_layers == (True, True, True, False)
    assert (cfg.ssm_conv_kernel, cfg.ssm_head_dim, cfg.ssm_n_k_heads, cfg.ssm_n_v_heads) == (4, 16, 2, 4)
    assert (cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp, cfg.n_ff_shexp, cfg.n_ff) == (16, 5, 32, 64, 128)
    assert cfg.rope_dim == 8 and cfg.head_dim == 32 and cfg.rope_type == "neox"
    assert cfg.attn_output_gate and cfg.qk_norm and cfg.expert_weights_norm
    # plain neox RoPE: llama.cpp reads no IMROPE sections for qwen3next, a file's are ignored
    bad = np.array([2, 2, 2, 2], dtype=np.int32)  # qwen35's check would refuse these
    assert config_of(paths["qwen3next-tiny"], **{"rope.dimension_sections": bad}) == cfg


@pytest.mark.parametrize("preset,drop,changes,match", [
    ("qwen3next-tiny", "blk.1.ssm_ba.weight", {}, r"tensor 'blk.1.ssm_ba.weight' is missing"),
    ("qwen3next-tiny", None, {"ssm.time_step_rank": 8, "ssm.inner_size": 128},
     r"tensor 'blk.0.attn_qkv.weight' has dims \[64, 128\], expected \[64, 192\].*'qwen3next.ssm.time_step_rank' 8"),
    ("qwen3next-tiny", "blk.0.attn_gate.weight", {}, r"tensor 'blk.0.attn_gate.weight' is missing"),
    ("qwen3next-tiny-ssmin", None, {"ssm.state_size": 8, "ssm.inner_size": 32},
     r"tensor 'blk.0.ssm_in.weight' has dims \[64, 192\], expected \[64, 96\].*'qwen3next.ssm.state_size' 8"),
    ("qwen3next-tiny-ssmin", None, {"ssm.group_count": 4},
     r"tensor 'blk.0.ssm_in.weight' has dims \[64, 192\], expected \[64, 256\].*'qwen3next.ssm.group_count' 4"),
    ("qwen3next-tiny", None, {"expert_shared_feed_forward_length": None},
     (r"tensor 'blk.0.ffn_gate_shexp.weight' has dims \[64, 64\], expected \[64, 128\] .*"
      r"'qwen3next.feed_forward_length' 128 \('qwen3next.expert_shared_feed_forward_length' absent or 0\)")),
    ("qwen3next-tiny", None, {"expert_count": 32},
     r"tensor 'blk.0.ffn_gate_inp.weight' has dims \[64, 16\], expected \[64, 32\].*'qwen3next.expert_count' 32"),
    ("qwen3next-tiny", None, {"full_attention_interval": 2},
     (r"layer 1 is full attention by 'qwen3next.full_attention_interval' 2, but the file has its Gated "
      r"DeltaNet tensor 'blk.1.attn_qkv.weight'")),
    ("qwen3next-tiny-ssmin", None, {"attention.recurrent_layers": np.array([1, 1, 1, 1], dtype=np.int32)},
     (r"layer 3 is a Gated DeltaNet layer by 'qwen3next.attention.recurrent_layers', but the file has the "
      r"full-attention tensor 'blk.3.attn_q.weight'")),
    ("qwen3next-tiny", None, {"rope.dimension_count": 40},
     r"'qwen3next.rope.dimension_count' 40 does not fit the head size 32"),
], ids=["no-ba", "value-heads", "no-gate", "ssm-in-state-size", "ssm-in-key-heads", "shared-width-from-ff",
        "expert-count", "pattern", "pattern-array", "rope-dims"])
def test_malformed_file_is_a_named_error(paths, preset, drop, changes, match):
    with pytest.raises(ConfigError, match=match):
        config_of(paths[preset], drop, **changes)


def test_real_size_preset_has_the_published_shapes(tmp_path):
    """qwen3next-80b-a3b (Qwen3-Next-80B-A3B): its file (the data a sparse hole) passes the
    config's checks with the published sizes; 79.7B parameters with the real vocabulary."""
    from testdata import llama_cpp_path

    from deimos.synth import TYPICAL_VOCAB, get_preset, planned_size, weight_types, write_model

    p = get_preset("qwen3next-80b-a3b")
    path = write_model(tmp_path / "80b.gguf", "qwen3next", p, "Q4_K_M",
                       llama_cpp_path("models/ggml-vocab-llama-spm.gguf"), data=False)
    cfg = config_of(path)
    heads = (cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.rope_dim)
    assert (cfg.n_layer, cfg.n_embd, *heads) == (48, 2048, 16, 2, 256, 64)
    assert (cfg.ssm_n_k_heads, cfg.ssm_n_v_heads, cfg.ssm_head_dim, cfg.ssm_conv_kernel) == (16, 32, 128, 4)
    experts = (cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp, cfg.n_ff_shexp, cfg.n_ff)
    assert experts == (512, 10, 512, 512, 5120)
    assert sum(cfg.recurrent_layers) == 36 and cfg.rope_base == 5e6
    n_params, _ = planned_size(p, weight_types("Q4_K_M"), TYPICAL_VOCAB["qwen3next"])
    assert 79.5e9 < n_params < 80e9


# ---- synth mixes -----------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ["qwen3next-tiny", "qwen3next-tiny-ssmin", "qwen3next-80b-a3b"])
def test_mix_types_are_llama_quantize_types(preset):
    """Every ftype's per-tensor types as llama-quantize --dry-run gives them (ssm_ba and ssm_in
    are its other tensors; in the ssm_in layout only every fourth layer has an attn_v)."""
    bad = mix_mismatches(preset)
    assert not bad, f"{preset}: (ours, llama-quantize) {bad}"
