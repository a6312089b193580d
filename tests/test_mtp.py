"""MTP ("nextn") layers of qwen35, qwen35moe and qwen3next (deimos.models.mtp) on the CPU reference.

Oracles:
- llama.cpp (build 11434) running its own MTP head (tools/llama_ref/llama_mtp_ref.cpp through
  tools/make_qwen35_reference.py: a target context with the nextn embeddings and an MTP context
  on the same model, as its draft-mtp speculative driver): the main model's hidden rows after
  the final norm (h_nextn), the MTP logits of the catch-up rows (x_k, h_{k-1}) and three greedy
  drafts, on the random-weight *-tiny-mtp F32 files (one MTP layer after the *-tiny main
  weights); its main logits on those files, bit-equal to its logits on the files without MTP;
- a float64 re-implementation of one MTP step written here from the file's tensors (``_oracle``:
  the llama_model_qwen35::graph_mtp formula, its fallbacks for the optional tensors);
- llama.cpp's loader and llama-quantize --dry-run for what is an error and for the mix types.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hybrid_support import config_of, forced_error, greedy_error, rebuild, ref_file, same_file
from test_model_vs_llama_cpp import top_errors

from deimos.gguf import GGUFFile
from deimos.models import ConfigError, ModelConfig, load_model
from deimos.models.deltanet import HybridKV, RecurrentState
from deimos.models.mtp import MTPState
from deimos.quant import dequantize
from deimos.runtime.kv_cache import KVCache
from deimos.synth import get_preset, weight_types
from deimos.synth.arch import tensor_specs

PRESETS = ("qwen35-tiny-mtp", "qwen35moe-tiny-mtp", "qwen3next-tiny-mtp")
# max |logit error| on llama.cpp's top-8 (logits ~30), measured: the main models 3.5e-4 / 2.2e-3
# / 5.0e-4 (qwen35 / qwen35moe / qwen3next; as tests/test_qwen35*.py and test_qwen3next.py, whose
# bound this is); the MTP head fed llama.cpp's hidden rows 1.3e-5; end to end (fed the model's
# own, whose rows are 2e-5..4e-5 of their scale off llama.cpp's) 9.3e-4 catch-up, 2.1e-4 drafts.
# A wrong input order, norm or hidden state moves the MTP logits by units.
TOLERANCE = 5e-3  # anything through the main model
MTP_TOLERANCE = 1e-3  # the MTP head alone
H_TOLERANCE = 2e-4  # hidden rows: max |error| / max |h| (pre-norm rows are off by ~16x)

pytestmark = pytest.mark.usefixtures("module_one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("mtp")
    return {p: rebuild(p, tmp) for p in PRESETS}


@pytest.fixture(scope="module")
def models(paths) -> dict:
    return {p: load_model(GGUFFile(path)) for p, path in paths.items()}


def _main(model, tokens: list[int]):
    """The main model on one sequence: (logits [T, V], post-norm hidden rows [T, D])."""
    cfg, n = model.config, len(tokens)
    kv, st = KVCache(cfg, n), RecurrentState.zeros(cfg)
    b = kv.batch(torch.tensor(tokens), torch.arange(n))
    b.kv = HybridKV(b.kv, [st])
    return model.step(b, hidden_at=torch.arange(n))


def _shifted(h: torch.Tensor) -> torch.Tensor:
    """Row k's h is h_{k-1}; row 0's is zeros (llama.cpp's first pending row)."""
    return torch.cat((torch.zeros_like(h[:1]), h[:-1]))


# ---- against llama.cpp -----------------------------------------------------------------------

@pytest.mark.parametrize("preset", PRESETS)
def test_regenerated_file_is_the_one_llama_cpp_ran(paths, preset):
    assert same_file(paths[preset], preset), "synth output changed: rerun tools/make_qwen35_reference.py"


@pytest.mark.parametrize("preset", PRESETS)
def test_llama_cpp_main_logits_unchanged_by_the_mtp_layers(preset):
    """llama.cpp's greedy and forced runs of the main model are the same numbers with and
    without the MTP layer in the file (it skips them in its main graph); with load_mtp too."""
    with_mtp, without = ref_file(preset), ref_file(preset.removesuffix("-mtp"))
    assert with_mtp["model"]["sha256"] != without["model"]["sha256"]
    assert with_mtp["greedy"] == without["greedy"]
    assert with_mtp["forced"] == without["forced"]
    assert with_mtp["mtp"]["results"][0]["main_top"] == with_mtp["forced"][0]["top"]


@pytest.mark.parametrize("preset", PRESETS)
def test_main_model_equals_llama_cpp(models, preset):
    model = models[preset]
    assert (model.config.n_layer, model.config.n_mtp_layers) == (4, 1)
    worst = max(forced_error(model, preset), greedy_error(model, preset))
    print(f"{preset}: main model, max |logit error| on llama.cpp's top-8 = {worst:.2e}")
    assert worst < TOLERANCE


@pytest.mark.parametrize("preset", PRESETS)
def test_hidden_rows_are_llama_cpp_h_nextn(models, preset):
    """step(hidden_at=...) gives llama.cpp's t_h_nextn: the hidden state after output_norm; and
    the logits are the head of those rows."""
    model = models[preset]
    for case in ref_file(preset)["mtp"]["results"]:
        logits, h = _main(model, case["tokens"])
        ref = torch.tensor(case["h"])
        err = float((h - ref).abs().max() / ref.abs().max())
        print(f"{preset}: {len(case['tokens'])} rows, max |h error| / max |h| = {err:.1e}")
        assert err < H_TOLERANCE
        torch.testing.assert_close(model.lm_head(h), logits, rtol=0, atol=0)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("source", ["llama-h", "own-h"])
def test_mtp_catch_up_equals_llama_cpp(models, preset, source):
    """Rows (x_k, h_{k-1}) at positions k, one step: the MTP logits at every row, with
    llama.cpp's hidden rows (the head alone) and with the model's own (end to end)."""
    model, worst = models[preset], 0.0
    for case in ref_file(preset)["mtp"]["results"]:
        tokens = case["tokens"]
        h = torch.tensor(case["h"]) if source == "llama-h" else _main(model, tokens)[1]
        state = model.mtp.new_state(len(tokens))
        out = model.mtp.forward(state, torch.tensor(tokens), _shifted(h), torch.arange(len(tokens)))
        assert state.length == len(tokens) and out.logits.shape == (len(tokens), model.config.n_vocab)
        worst = max(worst, float(top_errors(out.logits, case["mtp_top"]).max()))
    print(f"{preset} ({source}): MTP catch-up, max |logit error| on llama.cpp's top-8 = {worst:.2e}")
    assert worst < (MTP_TOLERANCE if source == "llama-h" else TOLERANCE)


@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_drafts_equal_llama_cpp(models, preset):
    """After the catch-up: the main model's next token with h_{N-1}, then each draft with the
    head's own h': llama.cpp's three drafted tokens, their logits and the last h'."""
    model, worst = models[preset], 0.0
    for case in ref_file(preset)["mtp"]["results"]:
        tokens, want = case["tokens"], case["draft"]
        logits, h = _main(model, tokens)
        state = model.mtp.new_state(len(tokens) + len(want["tokens"]))
        model.mtp.forward(state, torch.tensor(tokens), _shifted(h))
        tok, hid, drafted, rows = int(logits[-1].argmax()), h[-1], [], []
        assert tok == want["first"]
        for _ in want["tokens"]:
            out = model.mtp.draft(hid, tok, state)
            tok, hid = int(out.logits.argmax()), out.hidden
            drafted.append(tok)
            rows.append(out.logits)
        assert drafted == want["tokens"]
        worst = max(worst, float(top_errors(torch.stack(rows), want["top"]).max()))
        ref = torch.tensor(want["last_h"])
        assert float((hid - ref).abs().max() / ref.abs().max()) < H_TOLERANCE
    print(f"{preset}: drafts, max |logit error| on llama.cpp's top-8 = {worst:.2e}")
    assert worst < TOLERANCE


# ---- against the float64 formula -------------------------------------------------------------

def _f64(f: GGUFFile, name: str) -> torch.Tensor:
    info = f.tensors[name]
    return torch.from_numpy(dequantize(f.tensor_bytes(name), info.ggml_type, tuple(info.shape))
                            .astype(np.float64))


def _oracle(f: GGUFFile, tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
    """One MTP layer over rows (tokens[t], hidden[t]) at positions 0 .. T-1 of an empty cache,
    float64, from the tensors: logits [T, V]. llama_model_qwen35::graph_mtp written out."""
    md = f.metadata
    a = md["general.architecture"]
    eps = md[f"{a}.attention.layer_norm_rms_epsilon"]
    L = md[f"{a}.block_count"] - md[f"{a}.nextn_predict_layers"]
    nh, nkv, dh = md[f"{a}.attention.head_count"], md[f"{a}.attention.head_count_kv"], md[f"{a}.attention.key_length"]
    rot, base = md[f"{a}.rope.dimension_count"], md[f"{a}.rope.freq_base"]
    p = f"blk.{L}."

    def w(name: str, fallback: str | None = None) -> torch.Tensor:
        return _f64(f, p + name if p + name in f.tensors else fallback)

    def rms(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * g

    def rope(x: torch.Tensor) -> torch.Tensor:  # neox on the first `rot` dims, position = row
        half = rot // 2
        theta = torch.arange(len(tokens), dtype=torch.float64)[:, None] * base ** (
            -2 * torch.arange(half, dtype=torch.float64) / rot)
        c, s = theta.cos()[:, None], theta.sin()[:, None]
        x1, x2 = x[..., :half], x[..., half:rot]
        return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c, x[..., rot:]), -1)

    def swiglu(x, gate, up, down):
        g = x @ gate.T
        return (g / (1 + torch.exp(-g)) * (x @ up.T)) @ down.T

    head_w = "output.weight" if "output.weight" in f.tensors else "token_embd.weight"
    e = w("nextn.embed_tokens.weight", "token_embd.weight")[tokens]
    u = torch.cat((rms(e, w("nextn.enorm.weight")), rms(hidden.double(), w("nextn.hnorm.weight"))), -1)
    u = u @ w("nextn.eh_proj.weight").T
    x = rms(u, w("attn_norm.weight"))
    n = len(tokens)
    qg = (x @ w("attn_q.weight").T).view(n, nh, 2, dh)
    q = rope(rms(qg[:, :, 0], w("attn_q_norm.weight")))
    k = rope(rms((x @ w("attn_k.weight").T).view(n, nkv, dh), w("attn_k_norm.weight")))
    v = (x @ w("attn_v.weight").T).view(n, nkv, dh)
    att = torch.empty(n, nh, dh, dtype=torch.float64)
    for hq in range(nh):
        hk = hq // (nh // nkv)
        scores = (q[:, hq] @ k[:, hk].T) / dh**0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        att[:, hq] = torch.softmax(scores, -1) @ v[:, hk]
    gate = torch.sigmoid(qg[:, :, 1].reshape(n, nh * dh))
    h1 = u + (att.reshape(n, nh * dh) * gate) @ w("attn_output.weight").T
    y = rms(h1, w("post_attention_norm.weight"))
    if p + "ffn_gate_inp.weight" not in f.tensors:
        ffn = swiglu(y, w("ffn_gate.weight"), w("ffn_up.weight"), w("ffn_down.weight"))
    else:
        k_used = md[f"{a}.expert_used_count"]
        router, ge, ue, de = (w(f"ffn_{t}.weight") for t in ("gate_inp", "gate_exps", "up_exps", "down_exps"))
        ffn = torch.zeros_like(y)
        for t in range(n):
            probs = torch.softmax(router @ y[t], -1)
            ids = torch.argsort(-probs, stable=True)[:k_used]
            for e_id, wt in zip(ids.tolist(), (probs[ids] / probs[ids].sum()).tolist()):
                ffn[t] += wt * swiglu(y[t], ge[e_id], ue[e_id], de[e_id])
        shared = swiglu(y, w("ffn_gate_shexp.weight"), w("ffn_up_shexp.weight"), w("ffn_down_shexp.weight"))
        ffn = ffn + shared * torch.sigmoid(y @ w("ffn_gate_inp_shexp.weight"))[:, None]
    out = rms(h1 + ffn, w("nextn.shared_head_norm.weight", "output_norm.weight"))
    return out @ w("nextn.shared_head_head.weight", head_w).T


@pytest.mark.parametrize("preset", PRESETS)
def test_mtp_forward_equals_the_float64_formula(paths, models, preset):
    """13 rows of random hidden states (rms ~10) through the MTP layer, one step."""
    model, f = models[preset], GGUFFile(paths[preset])
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, model.config.n_vocab, (13,), generator=g).tolist()
    hidden = 10 * torch.randn(13, model.config.n_embd, generator=g)
    want = _oracle(f, tokens, hidden)
    state = model.mtp.new_state(13)
    got = model.mtp.forward(state, torch.tensor(tokens), hidden, torch.arange(13)).logits
    rel = float((got.double() - want).norm() / want.norm())
    print(f"{preset}: MTP logits vs float64, relative RMS error {rel:.1e}, "
          f"max |diff| {float((got.double() - want).abs().max()):.1e}")
    assert rel < 1e-5
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()


def test_optional_tensors_and_fallbacks(models):
    """qwen35-tiny-mtp: token_embd for the embedding and the (tied) head, its shared_head_norm;
    qwen35moe-tiny-mtp: its own nextn.embed_tokens and shared_head_head, output_norm."""
    dense, moe = models["qwen35-tiny-mtp"], models["qwen35moe-tiny-mtp"]
    b = dense.mtp.blocks[0]
    assert b.layer == 4 and b.embed is dense.embed and b.head is dense.lm_head and b.norm is not dense.norm
    b = moe.mtp.blocks[0]
    assert b.embed is not moe.embed and b.head is not moe.lm_head and b.norm is moe.norm
    assert b.embed.name == "blk.4.nextn.embed_tokens.weight"
    assert b.head.name == "blk.4.nextn.shared_head_head.weight"


# ---- the per-sequence state ------------------------------------------------------------------

def test_rows_in_pieces_equal_one_step(models):
    """The catch-up in pieces (7, 1, 5 rows: the cache carried) equals one step over the rows."""
    model = models["qwen3next-tiny-mtp"]
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, model.config.n_vocab, (13,), generator=g)
    hidden = 10 * torch.randn(13, model.config.n_embd, generator=g)
    whole = model.mtp.forward(model.mtp.new_state(16), tokens, hidden, torch.arange(13))
    state, parts, t = model.mtp.new_state(16), [], 0
    for n in (7, 1, 5):
        parts.append(model.mtp.forward(state, tokens[t:t + n], hidden[t:t + n], torch.arange(n)))
        t += n
    torch.testing.assert_close(torch.cat([p.logits for p in parts]), whole.logits, rtol=0, atol=2e-4)
    torch.testing.assert_close(torch.cat([p.hidden for p in parts]), whole.hidden, rtol=0, atol=2e-5)


def test_rejected_drafts_roll_back(models):
    """Drafting, then truncating the state to before the drafts, drafts the same again (bit for
    bit); a clone taken before is untouched by the drafts."""
    model = models["qwen35-tiny-mtp"]
    case = ref_file("qwen35-tiny-mtp")["mtp"]["results"][0]
    tokens = case["tokens"]
    logits, h = _main(model, tokens)
    state = model.mtp.new_state(len(tokens) + 4)
    model.mtp.forward(state, torch.tensor(tokens), _shifted(h))
    snap = state.clone()
    first = model.mtp.draft(h[-1], int(logits[-1].argmax()), state)
    second = model.mtp.draft(first.hidden, 5, state)
    assert state.length == len(tokens) + 2
    state.truncate(len(tokens))
    again = model.mtp.draft(h[-1], int(logits[-1].argmax()), state)
    torch.testing.assert_close(again.logits, first.logits, rtol=0, atol=0)
    from_snap = model.mtp.draft(h[-1], int(logits[-1].argmax()), snap)
    torch.testing.assert_close(from_snap.logits, first.logits, rtol=0, atol=0)
    assert not torch.equal(second.logits, first.logits)


def test_bad_calls_are_named_errors(models):
    model = models["qwen35-tiny-mtp"]
    cfg, mtp = model.config, model.mtp
    state = mtp.new_state(4)
    with pytest.raises(ValueError, match="hidden_last has 63 values, expected 64"):
        mtp.draft(torch.zeros(63), 1, state)
    with pytest.raises(ValueError, match=r"hidden \(2, 64\), expected \(3, 64\)"):
        mtp.forward(state, torch.tensor([1, 2, 3]), torch.zeros(2, 64))
    with pytest.raises(ValueError, match="5 positions > capacity 4"):
        mtp.forward(state, torch.tensor([1] * 5), torch.zeros(5, 64))
    with pytest.raises(ValueError, match="head 1 outside the model's 1 MTP layers"):
        MTPState(cfg, 4, head=1)
    with pytest.raises(ValueError, match=r"truncate: 2 outside \[0, 0\]"):
        state.truncate(2)
    with pytest.raises(ValueError, match="token id out of range"):
        mtp.draft(torch.zeros(64), cfg.n_vocab, state)


# ---- malformed files -------------------------------------------------------------------------

@pytest.mark.parametrize("changes,drop,match", [
    ({"nextn_predict_layers": 2}, None,
     (r"'qwen35.nextn_predict_layers' 2 makes blk.3 .. blk.4 the MTP layers \(of 'qwen35.block_count' "
      r"5\), but tensor 'blk.3.nextn.eh_proj.weight' is missing")),
    ({"nextn_predict_layers": None}, None,
     (r"tensor 'blk.4.nextn.\w+.weight' is an MTP \(nextn\) tensor of layer 4, but metadata key "
      r"'qwen35.nextn_predict_layers' absent \(0\) makes layer 4 a main layer \(of 'qwen35.block_count' 5\)")),
    ({"nextn_predict_layers": 0}, None,
     r"an MTP \(nextn\) tensor of layer 4, but metadata key 'qwen35.nextn_predict_layers' 0 makes"),
    ({"nextn_predict_layers": 5}, None,
     r"'qwen35.nextn_predict_layers' 5 leaves no main layer of 'qwen35.block_count' 5"),
    ({"block_count": 4}, None, r"'qwen35.block_count' is 4, but the file has tensors of 5 layers"),
    ({}, "blk.4.nextn.eh_proj.weight",
     (r"'qwen35.nextn_predict_layers' 1 makes blk.4 .. blk.4 the MTP layers .* tensor "
      r"'blk.4.nextn.eh_proj.weight' is missing")),
    ({}, "blk.4.nextn.hnorm.weight", r"tensor 'blk.4.nextn.hnorm.weight' is missing"),
    ({}, "blk.4.attn_q.weight", r"tensor 'blk.4.attn_q.weight' is missing"),
    ({}, "blk.4.ffn_down.weight", r"tensor 'blk.4.ffn_down.weight' is missing"),
    ({"attention.recurrent_layers": np.array([1, 1, 1, 0, 1], dtype=np.int32)}, None,
     r"'qwen35.attention.recurrent_layers' marks layer 4 recurrent, but it is an MTP layer"),
    ({"attention.recurrent_layers": np.array([1, 1, 1, 0], dtype=np.int32)}, None,
     r"'qwen35.attention.recurrent_layers' has 4 entries, expected one per layer \(block_count 5\)"),
    ({"attention.head_count": np.array([4, 4, 4, 4], dtype=np.int32)}, None,
     r"'qwen35.attention.head_count' has 4 entries, expected one per layer \(block_count 5\)"),
], ids=["count-2", "count-absent", "count-0", "count-all", "block-count", "no-eh-proj", "no-hnorm",
        "no-attn-q", "no-ffn", "pattern-marks-mtp", "pattern-length", "per-layer-length"])
def test_malformed_mtp_metadata_and_tensors_are_named_errors(paths, changes, drop, match):
    with pytest.raises(ConfigError, match=match):
        config_of(paths["qwen35-tiny-mtp"], drop=drop, **changes)


def test_pattern_array_with_mtp_entry_zero_is_accepted(paths):
    cfg = config_of(paths["qwen35-tiny-mtp"],
                    **{"attention.recurrent_layers": np.array([1, 1, 1, 0, 0], dtype=np.int32)})
    assert cfg.recurrent_layers == (True, True, True, False) and list(cfg.mtp_layers) == [4]
    assert not cfg.is_recurrent(4)


def test_gated_deltanet_tensor_in_the_mtp_layer_is_a_named_error(paths):
    with GGUFFile(paths["qwen35-tiny-mtp"]) as f:
        tensors = dict(f.tensors)
        tensors["blk.4.ssm_conv1d.weight"] = tensors["blk.0.ssm_conv1d.weight"]
        with pytest.raises(ConfigError, match=r"layer 4 is an MTP layer \(full attention\) by "
                                              r"'qwen35.nextn_predict_layers' 1, but the file has its "
                                              r"Gated DeltaNet tensor 'blk.4.ssm_conv1d.weight'"):
            ModelConfig.from_gguf(f.metadata, source="tiny", tensors=tensors)


def test_mtp_layers_of_another_architecture_are_a_named_error():
    md = {"general.architecture": "llama", "llama.block_count": 2, "llama.nextn_predict_layers": 1}
    with pytest.raises(ConfigError, match=r"'llama.nextn_predict_layers' is 1: MTP layers are supported "
                                          r"for qwen35, qwen35moe, qwen3next only, not llama"):
        ModelConfig.from_gguf(md, source="tiny")


# ---- synth -----------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", PRESETS)
def test_mix_types_equal_llama_quantize(preset):
    """deimos.synth's per-tensor types of every llama.cpp mix on the MTP preset (its layer rules
    count the MTP layer, as llama-quantize's n_layer_all) against llama-quantize --dry-run."""
    rec = ref_file(preset)["mix_types"]
    p = get_preset(preset)
    specs = tensor_specs(p, 32000)
    assert [s.name for s in specs] == rec["names"]
    for ftype, recorded in rec["types"].items():
        got = [t.name for t in weight_types(ftype).tensor_types(p, specs)]
        wrong = [(n, a, b) for n, a, b in zip(rec["names"], got, recorded.split()) if a != b]
        assert not wrong, f"{ftype}: {wrong[:5]}"


@pytest.mark.parametrize("preset", PRESETS)
def test_the_gpu_path_leaves_the_mtp_layers_in_the_file(paths, preset):
    """deimos.models.gpu.source.main_tensors (what the GPU path packs) and the placement's
    byte counts skip exactly the MTP layer's tensors (built only by load_mtp)."""
    from deimos.models.gpu.placement import expert_bytes
    from deimos.models.gpu.source import main_tensors

    f = GGUFFile(paths[preset])
    n = load_model(f).config.n_layer
    names = {t.name for t in main_tensors(f)}
    mtp = {name for name in f.tensors if name.startswith(f"blk.{n}.")}
    assert mtp and any(".nextn." in name for name in mtp)
    assert names == set(f.tensors) - mtp
    experts, other = expert_bytes(f)
    assert experts + other == sum(f.tensors[name].nbytes for name in names)
    experts, other = expert_bytes(f, mtp=True)  # MTP drafting asked for: they go on the device
    assert experts + other == sum(t.nbytes for t in f.tensors.values())


def test_the_placement_counts_the_mtp_layers_when_mtp_drafting_is_asked_for(paths):
    """With free memory for the main layers but not for the MTP layer's weights too (a MoE
    layer, its experts among them), MTP drafting sends the experts to the host (where
    LLM refuses it before loading, naming why), and without it they stay on the GPU."""
    from deimos.models.gpu.placement import expert_bytes, plan_experts
    from deimos.runtime.gpu_memory import headroom

    f = GGUFFile(paths["qwen35moe-tiny-mtp"])
    main = sum(expert_bytes(f))
    extra = sum(expert_bytes(f, mtp=True)) - main
    assert extra > 0
    free = 0
    while free - headroom(free) < main + extra // 2:  # the room: main + half the MTP layer's bytes
        free += 1 << 20
    room = free - headroom(free)
    assert main <= room < main + extra
    assert plan_experts(f, "auto", free_bytes=free).device == "gpu"
    assert plan_experts(f, "auto", free_bytes=free, mtp=True).device == "cpu"
