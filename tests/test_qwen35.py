"""qwen35 (hybrid Gated DeltaNet + full attention) on the CPU reference, against llama.cpp.

Oracles:
- the delta rule: the naive per-token recurrence (deimos.kernels.deltanet, ggml's
  gated_delta_net op written out) for the chunked WY form, at chunk-boundary lengths;
- the convolution: one call over the whole sequence for the same inputs fed in pieces with
  the carried state;
- llama.cpp (build 11434) on the random-weight qwen35-tiny F32 file
  (tools/make_qwen35_reference.py): no activation quantization there, so logits to float32
  noise; greedy runs with the prompt in one step, then one token a step as llama.cpp does;
- llama.cpp's loader for what is an error (the layer pattern against the tensors present, the
  state sizes against the tensor shapes).
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from test_model_vs_llama_cpp import top_errors
from testdata import data_file, reference

from deimos.gguf import GGUFFile
from deimos.kernels.deltanet import (
    causal_conv1d,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
)
from deimos.models import ConfigError, ModelConfig, load_model
from deimos.models.deltanet import HybridKV, RecurrentState, StateError
from deimos.runtime.kv_cache import KVCache
from deimos.synth import write_model

# measured max |logit error| on llama.cpp's top-8: 1.4e-4 (logits ~20)
TOLERANCE = 1e-3


pytestmark = pytest.mark.usefixtures("module_one_thread")  # tests/conftest.py


def _ref() -> dict:
    return reference("synth-qwen35-tiny-F32.json")


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    s = _ref()["synth"]
    donor = data_file(s["vocab_from"])
    return write_model(tmp_path_factory.mktemp("qwen35") / _ref()["model"]["file"], s["arch"], s["preset"],
                       s["ggml_type"], donor, s["seed"])


@pytest.fixture(scope="module")
def model(path):
    return load_model(GGUFFile(path))


def _step(model, kv: KVCache, state: RecurrentState, tokens: list[int], logits_at=None) -> torch.Tensor:
    b = kv.batch(torch.tensor(tokens), logits_at)
    b.kv = HybridKV(b.kv, [state])
    logits = model.step(b)
    kv.commit(len(tokens))
    return logits


# ---- the math --------------------------------------------------------------------------------

def _inputs(n: int, h: int = 3, dk: int = 16, dv: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(n, h, dk, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(n, h, dk, generator=g), dim=-1)
    v = torch.randn(n, h, dv, generator=g)
    decay = -torch.rand(n, h, generator=g) * 0.5
    beta = torch.rand(n, h, generator=g)
    state = torch.randn(h, dv, dk, generator=g)
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("n", [1, 5, 63, 64, 65, 130], ids=lambda n: f"T{n}")
@pytest.mark.parametrize("chunk", [64, 16, 7], ids=lambda c: f"chunk{c}")
def test_chunked_delta_rule_equals_the_recurrence(n, chunk):
    q, k, v, g, beta, state = _inputs(n)
    o_ref, s_ref = gated_delta_rule_recurrent(q, k, v, g, beta, state, 0.25)
    o, s = gated_delta_rule_chunked(q, k, v, g, beta, state, 0.25, chunk=chunk)
    err_o = float((o - o_ref).norm() / o_ref.norm())
    err_s = float((s - s_ref).norm() / s_ref.norm())
    print(f"T={n} chunk={chunk}: rel err out {err_o:.1e} state {err_s:.1e}")
    assert err_o < 2e-6 and err_s < 2e-6


def test_recurrence_is_the_delta_rule_written_out():
    """One token in float64 by the formula (decay, delta, outer product, readout)."""
    q, k, v, g, beta, state = (t.double() for t in _inputs(1, h=2, dk=4, dv=3))
    o, s = gated_delta_rule_recurrent(q, k, v, g, beta, state, 0.5)
    for h in range(2):
        s0 = state[h] * np.exp(float(g[0, h]))
        s1 = s0 + torch.outer(beta[0, h] * (v[0, h] - s0 @ k[0, h]), k[0, h])
        torch.testing.assert_close(s[h], s1)
        torch.testing.assert_close(o[0, h], s1 @ (0.5 * q[0, h]))


@pytest.mark.parametrize("cuts", [[1, 1, 1, 1, 1, 1, 1], [3, 4], [2, 5], [7]], ids=str)
def test_conv_state_carried_across_steps_equals_one_call(cuts):
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(7, 9, generator=g), torch.randn(9, 4, generator=g)
    zero = torch.zeros(3, 9)
    whole, last = causal_conv1d(x, w, zero)
    # the oracle: a zero-padded depthwise conv1d
    direct = torch.nn.functional.conv1d(torch.cat((zero, x)).T[None], w[:, None, :], groups=9)[0].T
    torch.testing.assert_close(whole, direct)
    state, parts, t = zero, [], 0
    for n in cuts:
        y, state = causal_conv1d(x[t : t + n], w, state)
        parts.append(y)
        t += n
    torch.testing.assert_close(torch.cat(parts), whole, rtol=0, atol=0)
    torch.testing.assert_close(state, last, rtol=0, atol=0)
    assert torch.equal(last, x[-3:])


# ---- against llama.cpp -----------------------------------------------------------------------

def test_regenerated_file_is_the_one_llama_cpp_ran(path):
    ref = _ref()["model"]
    assert path.stat().st_size == ref["size"]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == ref["sha256"], \
        "synth output changed: rerun tools/make_qwen35_reference.py"


def test_forced_logits_equal_llama_cpp(model):
    """Whole sequences in one step (35, 130 and 64 tokens: the chunked rule over 1-3 chunks)."""
    worst = 0.0
    for case in _ref()["forced"]:
        tokens = case["tokens"]
        kv, st = KVCache(model.config, len(tokens)), RecurrentState.zeros(model.config)
        logits = _step(model, kv, st, tokens, torch.arange(len(tokens)))
        worst = max(worst, float(top_errors(logits, case["top"]).max()))
        assert st.length == len(tokens)
    print(f"qwen35-tiny F32: forced, max |logit error| on llama.cpp's top-8 = {worst:.2e}")
    assert worst < TOLERANCE


def test_greedy_prefill_then_decode_equals_llama_cpp(model):
    """Prompt in one step, then one token a step (the recurrent rule, the carried conv
    inputs): llama.cpp's greedy tokens and their logits."""
    worst = 0.0
    for case in _ref()["greedy"]:
        prompt, want = case["prompt_tokens"], case["tokens"][:6]
        kv = KVCache(model.config, len(prompt) + len(want))
        st = RecurrentState.zeros(model.config)
        logits = [_step(model, kv, st, prompt)[0]]
        for tok in want[:-1]:
            logits.append(_step(model, kv, st, [tok])[0])
        logits = torch.stack(logits)
        assert logits.argmax(-1).tolist() == want, case["id"]
        worst = max(worst, float(top_errors(logits, case["top"][: len(want)]).max()))
    print(f"qwen35-tiny F32: greedy, max |logit error| on llama.cpp's top-8 = {worst:.2e}")
    assert worst < TOLERANCE


def test_split_prefill_and_snapshot_equal_one_pass(model):
    """A prompt in two steps (64 then 66) equals one step; a snapshot taken after the first
    step, restored, continues to the same logits."""
    tokens = _ref()["forced"][1]["tokens"]
    kv, st = KVCache(model.config, len(tokens)), RecurrentState.zeros(model.config)
    whole = _step(model, kv, st, tokens)
    kv, st = KVCache(model.config, len(tokens)), RecurrentState.zeros(model.config)
    _step(model, kv, st, tokens[:64])
    snap = st.clone()
    split = _step(model, kv, st, tokens[64:])
    torch.testing.assert_close(split, whole, rtol=0, atol=2e-4)
    kv.truncate(64)
    again = _step(model, kv, snap, tokens[64:])
    torch.testing.assert_close(again, split, rtol=0, atol=0)


def test_state_out_of_step_is_a_named_error(model):
    kv, st = KVCache(model.config, 8), RecurrentState.zeros(model.config)
    _step(model, kv, st, [1, 2, 3])
    kv.truncate(1)
    with pytest.raises(StateError, match="starts at position 1, its recurrent state is at 3"):
        _step(model, kv, st, [5])
    b = KVCache(model.config, 8).batch(torch.tensor([1, 2]))
    with pytest.raises(StateError, match="HybridKV"):
        model.step(b)


# ---- malformed files -------------------------------------------------------------------------

def _config(path, **changes):
    with GGUFFile(path) as f:
        md = dict(f.metadata)
        md.update({f"qwen35.{k}": v for k, v in changes.items()})
        return ModelConfig.from_gguf(md, source="tiny", tensors=f.tensors)


def test_config_reads_the_hybrid_fields(path):
    cfg = _config(path)
    assert cfg.recurrent_layers == (True, True, True, False)
    assert (cfg.ssm_conv_kernel, cfg.ssm_head_dim, cfg.ssm_n_k_heads, cfg.ssm_n_v_heads) == (4, 16, 2, 4)
    assert cfg.rope_dim == 16 and cfg.head_dim == 32 and cfg.attn_output_gate and cfg.qk_norm


@pytest.mark.parametrize("changes,match", [
    ({"full_attention_interval": 2},
     (r"layer 1 is full attention by 'qwen35.full_attention_interval' 2, but the file has its Gated "
      r"DeltaNet tensor 'blk.1.attn_qkv.weight'")),
    ({"full_attention_interval": 5},
     (r"layer 3 is a Gated DeltaNet layer by 'qwen35.full_attention_interval' 5, but the file has the "
      r"full-attention tensor 'blk.3.attn_q.weight'")),
    ({"attention.recurrent_layers": np.array([1, 1, 1, 1], dtype=np.int32)},
     r"layer 3 is a Gated DeltaNet layer by 'qwen35.attention.recurrent_layers'"),
    ({"attention.recurrent_layers": np.array([1, 1, 0], dtype=np.int32)},
     r"'qwen35.attention.recurrent_layers' has 3 entries, expected one per layer"),
    ({"ssm.state_size": 8, "ssm.inner_size": 32},
     r"tensor 'blk.0.attn_qkv.weight' has dims \[64, 128\], expected \[64, 64\].*'qwen35.ssm.state_size' 8"),
    ({"ssm.conv_kernel": 3},
     r"tensor 'blk.0.ssm_conv1d.weight' has dims \[4, 128\], expected \[3, 128\].*'qwen35.ssm.conv_kernel' 3"),
    ({"ssm.time_step_rank": 8, "ssm.inner_size": 128},
     r"tensor 'blk.0.attn_qkv.weight' has dims .*'qwen35.ssm.time_step_rank' 8"),
    ({"ssm.inner_size": 60}, r"'qwen35.ssm.inner_size' 60 is not 'qwen35.ssm.state_size' 16 x"),
    ({"ssm.time_step_rank": 3}, r"'qwen35.ssm.time_step_rank' 3 \(value heads\) is not a multiple"),
    ({"rope.dimension_sections": np.array([2, 2, 2, 2], dtype=np.int32)},
     r"rope.dimension_sections' .* leave rotated pair 6 .* to the 4th \(e\) section"),
], ids=["pattern-2", "pattern-5", "pattern-array", "pattern-length", "state-size", "conv-kernel",
        "value-heads", "inner-size", "heads-ratio", "sections"])
def test_malformed_hybrid_metadata_is_a_named_error(path, changes, match):
    with pytest.raises(ConfigError, match=match):
        _config(path, **changes)
