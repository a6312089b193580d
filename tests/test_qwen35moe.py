"""qwen35moe (qwen35's hybrid layers, routed experts + a shared expert) on the CPU reference,
against llama.cpp.

Oracles:
- llama.cpp (build 11434) on the random-weight qwen35moe-tiny F32 file
  (tools/make_qwen35_reference.py): no activation quantization there, so logits to float32
  noise, routing included; greedy runs with the prompt in one step, then one token a step;
- the shared expert: its formula written out in float64 from the file's tensors (llama.cpp's
  build_layer_ffn: SwiGLU of ffn_{gate,up,down}_shexp times sigmoid(ffn_gate_inp_shexp . x));
- llama.cpp's loader for what is an error (the shared expert's width from
  expert_shared_feed_forward_length or feed_forward_length, tensor shapes from the metadata);
- llama-quantize --dry-run for the synth mixes (tools/make_hybrid_mix_reference.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
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
from deimos.models.moe import MoEShared, moe_reference, shared_expert_reference
from deimos.models.qwen35moe import Qwen35MoeModel
from deimos.quant import dequantize

PRESET = "qwen35moe-tiny"
# measured max |logit error| on llama.cpp's top-8 (logits ~30): 2.2e-3 forced, at one position of
# the 130-token random sequence where float64 (deimos.eval.float64) is 1.2e-3 from llama.cpp and
# 9.6e-4 from our float32 (an ill-conditioned token: both float32 runs are that far from exact;
# median 6e-5); greedy 4.4e-5. A wrong head map or projection layout is off by units.
TOLERANCE = 5e-3

pytestmark = pytest.mark.usefixtures("module_one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return rebuild(PRESET, tmp_path_factory.mktemp("qwen35moe"))


@pytest.fixture(scope="module")
def model(path):
    return load_model(GGUFFile(path))


# ---- against llama.cpp -----------------------------------------------------------------------

def test_regenerated_file_is_the_one_llama_cpp_ran(path):
    assert same_file(path, PRESET), "synth output changed: rerun tools/make_qwen35_reference.py"


def test_forced_logits_equal_llama_cpp(model):
    """Whole sequences in one step (35, 130 and 64 tokens: the chunked rule over 1-3 chunks,
    every token routed)."""
    assert isinstance(model, Qwen35MoeModel)
    worst = forced_error(model, PRESET)
    print(f"{PRESET} F32: forced, max |logit error| on llama.cpp's top-8 = {worst:.2e}")
    assert worst < TOLERANCE


def test_greedy_prefill_then_decode_equals_llama_cpp(model):
    worst = greedy_error(model, PRESET)
    print(f"{PRESET} F32: greedy, max |logit error| on llama.cpp's top-8 = {worst:.2e}")
    assert worst < TOLERANCE


def test_split_prefill_and_snapshot_equal_one_pass(model):
    check_split_and_snapshot(model, ref_file(PRESET)["forced"][1]["tokens"])


def test_llm_greedy_generation_batched(path):
    """deimos.LLM on the CPU (the engine's hybrid states), two raw prompts decoded together and
    one alone: llama.cpp's prompt tokens and greedy tokens."""
    from deimos.engine import LLM

    ref = ref_file(PRESET)
    cases = ref["greedy"][:2]
    llm = LLM(path, device="cpu")
    prompts = [ref["prompts"][c["id"]] for c in cases]
    assert [llm.encode_raw(p) for p in prompts] == [c["prompt_tokens"] for c in cases]
    n = 8
    outs = llm.generate_many(prompts, max_tokens=n, raw=True, temperature=0)
    for case, out in zip(cases, outs, strict=True):
        assert out.token_ids == case["tokens"][:n], case["id"]
    alone = llm.generate(prompts[1], max_tokens=n, raw=True, temperature=0)
    assert alone.token_ids == outs[1].token_ids


@pytest.mark.gpu
def test_gpu_whole_model_equals_reference(tmp_path):
    """qwen35moe on the kernel path (packed weights and experts, the Triton ops and gated delta
    rule, the shared expert through the GPU linears) on CUDA against the CPU reference, a Q8_0
    file: 65 prompt tokens and 3 decode steps, the routing apart (tests/moe_routing.py: the
    reference's routing forced, then the kernels' own). Under the interpreter (kernels on the
    CPU, 4 min): forced 6.0e-3 (the prefill's fp16 roundings; dense qwen35: under 1e-2), own
    routing 1.0e-2, 2 positions flipped at gaps 0.0018 and 0.0047."""
    from moe_routing import compare_hybrid_moe
    from testdata import llama_cpp_path

    from deimos.synth import write_model

    path = write_model(tmp_path / "q8.gguf", "qwen35moe", PRESET, "Q8_0",
                       llama_cpp_path("models/ggml-vocab-llama-spm.gguf"), seed=11)
    f = GGUFFile(path)
    n_vocab = load_model(f).config.n_vocab
    prompt = torch.randint(0, n_vocab, (65,), generator=torch.Generator().manual_seed(5)).tolist()
    compare_hybrid_moe(f, f"{PRESET} Q8_0", prompt)


@pytest.mark.gpu
def test_gpu_offloaded_decode_graphs_answer_as_the_eager_steps(tmp_path):
    """The hybrid MoE with its routed experts on the host (deimos.models.gpu.offload): decode
    steps captured as graphs (the recurrent states in the state pool, the host answering each
    MoE layer through the mailbox) give the eager steps' tokens exactly, every miss on the CPU
    in both."""
    from testdata import llama_cpp_path

    from deimos.engine import LLM
    from deimos.engine.request import Request
    from deimos.kernels.sampling import SamplingParams
    from deimos.synth import write_model

    path = write_model(tmp_path / "q8.gguf", "qwen35moe", PRESET, "Q8_0",
                       llama_cpp_path("models/ggml-vocab-llama-spm.gguf"), seed=12)
    prompt = torch.randint(0, 30000, (9,), generator=torch.Generator().manual_seed(2)).tolist()
    got = {}
    for graphs in (False, True):
        llm = LLM(path, n_ctx=128, device="cuda", experts="cpu", expert_cache_gib=0.0, max_seqs=2,
                  cuda_graphs=graphs)
        llm.offload.fix_share(0.0)
        got[graphs] = llm.run_many([Request(prompt, 10, SamplingParams(temperature=0))])[0].output_ids
        assert (sum(g.replays for g in llm.engine.runner.decode_graphs.values()) > 0) == graphs
    assert got[True] == got[False]


# ---- the blocks ------------------------------------------------------------------------------

def _f64(f: GGUFFile, name: str) -> torch.Tensor:
    info = f.tensors[name]
    data = dequantize(f.tensor_bytes(name), info.ggml_type, tuple(info.shape))
    return torch.from_numpy(data.astype(np.float64))


@pytest.mark.parametrize("layer", [0, 3], ids=["deltanet-layer", "attention-layer"])
def test_shared_expert_is_the_formula(path, model, layer):
    block = model.layers[layer].mlp
    assert isinstance(block, MoEShared)
    g = torch.Generator().manual_seed(layer)
    x = 4 * torch.randn(7, model.config.n_embd, generator=g)  # the normed stream's scale
    with GGUFFile(path) as f:
        p = f"blk.{layer}."
        wg, wu, wd = (_f64(f, p + f"ffn_{n}_shexp.weight") for n in ("gate", "up", "down"))
        gate = _f64(f, p + "ffn_gate_inp_shexp.weight")
    xd = x.double()
    want = torch.sigmoid(xd @ gate)[:, None] * ((torch.nn.functional.silu(xd @ wg.T) * (xd @ wu.T)) @ wd.T)
    got = block.shared(x)
    ref = shared_expert_reference(x, block.shared)
    rel = float((got.double() - want).norm() / want.norm())
    print(f"layer {layer}: shared expert rel err {rel:.1e}, max |diff| {float((got - want).abs().max()):.1e}")
    assert rel < 1e-6
    torch.testing.assert_close(ref, got, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(block(x), moe_reference(x, block.moe) + ref, rtol=1e-6, atol=1e-6)


def test_layers_expose_their_routed_experts(model):
    """The GPU expert placement and offload find a MoE layer's routed block as ``layer.moe``."""
    assert all(layer.moe is layer.mlp.moe for layer in model.layers)
    assert [layer.moe.n_expert_used for layer in model.layers] == [4] * 4


# ---- config and malformed files --------------------------------------------------------------

def test_config_reads_the_moe_and_hybrid_fields(path):
    cfg = config_of(path)
    assert cfg.recurrent_layers == (True, True, True, False)
    assert (cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp, cfg.n_ff_shexp) == (16, 4, 32, 64)
    assert cfg.n_ff == 0 and cfg.expert_weights_norm and cfg.has_shared_expert
    assert cfg.rope_dim == 16 and cfg.rope_type == "neox" and cfg.attn_output_gate and cfg.qk_norm
    with GGUFFile(path) as f:  # as Qwen3.5-MoE files: no dense intermediate size
        assert "qwen35moe.feed_forward_length" not in f.metadata


@pytest.mark.parametrize("drop,changes,match", [
    (None, {"expert_shared_feed_forward_length": None},
     (r"'qwen35moe.expert_shared_feed_forward_length' is missing and there is no "
      r"'qwen35moe.feed_forward_length'")),
    (None, {"expert_shared_feed_forward_length": None, "feed_forward_length": 96},
     (r"tensor 'blk.0.ffn_gate_shexp.weight' has dims \[64, 64\], expected \[64, 96\] .*"
      r"'qwen35moe.feed_forward_length' 96 \('qwen35moe.expert_shared_feed_forward_length' absent or 0\)")),
    (None, {"expert_shared_feed_forward_length": 48},
     (r"tensor 'blk.0.ffn_gate_shexp.weight' has dims \[64, 64\], expected \[64, 48\] .*"
      r"'qwen35moe.expert_shared_feed_forward_length' 48")),
    (None, {"expert_feed_forward_length": 64},
     (r"tensor 'blk.0.ffn_gate_exps.weight' has dims \[64, 32, 16\], expected \[64, 64, 16\].*"
      r"'qwen35moe.expert_feed_forward_length' 64")),
    (None, {"expert_count": 8},
     r"tensor 'blk.0.ffn_gate_inp.weight' has dims \[64, 16\], expected \[64, 8\].*'qwen35moe.expert_count' 8"),
    (None, {"expert_used_count": 17}, r"'qwen35moe.expert_used_count' 17 is greater than 'qwen35moe.expert_count' 16"),
    (None, {"expert_count": None}, r"required metadata key 'qwen35moe.expert_count' is missing"),
    ("blk.2.ffn_gate_inp_shexp.weight", {}, r"tensor 'blk.2.ffn_gate_inp_shexp.weight' is missing"),
    ("blk.3.ffn_down_shexp.weight", {}, r"tensor 'blk.3.ffn_down_shexp.weight' is missing"),
    (None, {"full_attention_interval": 2},
     (r"layer 1 is full attention by 'qwen35moe.full_attention_interval' 2, but the file has its Gated "
      r"DeltaNet tensor 'blk.1.attn_qkv.weight'")),
    (None, {"ssm.conv_kernel": 3},
     r"tensor 'blk.0.ssm_conv1d.weight' has dims \[4, 128\], expected \[3, 128\].*'qwen35moe.ssm.conv_kernel' 3"),
    (None, {"rope.dimension_sections": np.array([2, 2, 2, 2], dtype=np.int32)},
     r"rope.dimension_sections' .* leave rotated pair 6 .* to the 4th \(e\) section"),
], ids=["no-shared-width", "shared-width-from-ff", "shared-width", "expert-width", "expert-count",
        "used-count", "no-expert-count", "no-shared-gate", "no-shared-down", "pattern", "conv-kernel",
        "sections"])
def test_malformed_file_is_a_named_error(path, drop, changes, match):
    with pytest.raises(ConfigError, match=match):
        config_of(path, drop, **changes)


def test_real_size_preset_has_the_published_shapes(tmp_path):
    """qwen35moe-35b-a3b (Qwen3.5/3.6-35B-A3B's text decoder): its file (the data a sparse
    hole) passes the config's checks with the published sizes; 34.7B parameters with the real
    vocabulary, 3.4B a token."""
    from testdata import llama_cpp_path

    from deimos.synth import TYPICAL_VOCAB, get_preset, planned_size, weight_types, write_model

    p = get_preset("qwen35moe-35b-a3b")
    path = write_model(tmp_path / "35b.gguf", "qwen35moe", p, "Q4_K_M",
                       llama_cpp_path("models/ggml-vocab-llama-spm.gguf"), data=False)
    cfg = config_of(path)
    heads = (cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.rope_dim)
    assert (cfg.n_layer, cfg.n_embd, *heads) == (40, 2048, 16, 2, 256, 64)
    assert (cfg.ssm_n_k_heads, cfg.ssm_n_v_heads, cfg.ssm_head_dim, cfg.ssm_conv_kernel) == (16, 32, 128, 4)
    assert (cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp, cfg.n_ff_shexp) == (256, 8, 512, 512)
    assert sum(cfg.recurrent_layers) == 30 and cfg.rope_base == 1e7
    n_params, _ = planned_size(p, weight_types("Q4_K_M"), TYPICAL_VOCAB["qwen35moe"])
    assert 34.5e9 < n_params < 35e9


# ---- synth mixes -----------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ["qwen35-tiny", "qwen35moe-tiny", "qwen35-4b", "qwen35moe-35b-a3b"])
def test_mix_types_are_llama_quantize_types(preset):
    """Every ftype's per-tensor types as llama-quantize --dry-run gives them (attn_qkv is its
    attn_v-like category; the shared expert's tensors its ffn categories)."""
    bad = mix_mismatches(preset)
    assert not bad, f"{preset}: (ours, llama-quantize) {bad}"
