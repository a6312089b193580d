"""qwen3moe on the CPU reference: routed experts in float32, against llama.cpp.

Oracles:
- llama.cpp (build 11434) on random-weight qwen3moe-tiny files (tools/make_moe_reference.py):
  the test rebuilds each file byte for byte (its sha256), then compares with llama.cpp on the
  file's F32 twin (ggml's own dequantization, no activation quantization: the exact float32
  function, routing included) to float32 noise, and with llama.cpp on the quantized file
  itself, where every greedy divergence must be explained (its top two within 0.1, or its F32
  twin picks our token: 8-bit activations move llama.cpp's router, MoE logits move by units);
- for the block alone: a per-token loop over the experts' full dequantized 3-D tensors
  (deimos.quant on the whole tensor, no cache), and llama.cpp's routing rules written out
  (softmax, std::sort by descending prob, which for E <= 16 is libstdc++'s stable insertion
  sort, the weights divided by their sum clamped at 2^-14);
- llama.cpp's loader for what is an error (expert_used_count <= expert_count <= 1024, tensor
  shapes from the metadata).
"""

from __future__ import annotations

import hashlib
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_model_vs_llama_cpp import (
    divergence_rows,
    first_divergence,
    forced_logits,
    print_divergences,
    top_errors,
)
from testdata import REPO, data_file, reference

from deimos.gguf import GGUFFile
from deimos.models import ARCHITECTURES, ConfigError, ModelConfig, load_model
from deimos.models.moe import moe_reference, route
from deimos.models.weights import WeightSource
from deimos.quant import dequantize
from deimos.runtime.kv_cache import KVCache
from deimos.synth import write_model

sys.path.insert(0, str(REPO / "tools"))
import fuzz_gguf as fz  # noqa: E402

TYPES = ("Q8_0", "Q4_K_M")
# measured max |logit error| on llama.cpp's top-8: 8.4e-4 (Q8_0), 3.3e-4 (Q4_K_M), of logits ~45
TWIN_TOLERANCE = 2e-3


pytestmark = pytest.mark.usefixtures("module_one_thread")  # tests/conftest.py


def _ref(wtype: str) -> dict:
    return reference(f"synth-qwen3moe-tiny-{wtype}.json")


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    """The reference files, written again from the parameters their references record."""
    tmp = tmp_path_factory.mktemp("moe")
    out = {}
    for t in TYPES:
        s = _ref(t)["synth"]
        donor = data_file(s["vocab_from"])
        assert _sha256(donor) == s["vocab_from_sha256"], f"{donor} is not the recorded donor"
        out[t] = write_model(tmp / _ref(t)["model"]["file"], s["arch"], s["preset"], s["ggml_type"],
                             donor, s["seed"])
    return out


@pytest.fixture(scope="module")
def models(files) -> dict:
    return {t: load_model(GGUFFile(p)) for t, p in files.items()}


# ---- against llama.cpp ---------------------------------------------------------------------

@pytest.mark.parametrize("wtype", TYPES)
def test_regenerated_file_is_the_one_llama_cpp_ran(files, wtype):
    ref = _ref(wtype)["model"]
    path = files[wtype]
    assert path.stat().st_size == ref["size"]
    assert _sha256(path) == ref["sha256"], "synth output changed: rerun tools/make_moe_reference.py"
    with GGUFFile(path) as f:
        assert sorted({t.ggml_type.name for t in f.tensors.values() if len(t.dims) == 3}) == \
            ref["expert_types"]


@pytest.mark.parametrize("wtype", TYPES)
def test_logits_equal_llama_cpp_on_the_f32_twin(models, wtype):
    """Teacher-forced sequences and the twin's greedy runs: logits to float32 noise, the same
    greedy tokens (only a float32-level tie may flip one)."""
    ref, model = _ref(wtype)["twin"], models[wtype]
    worst = 0.0
    for case in ref["forced"]:
        logits = forced_logits(model, case["tokens"] + [0], 1)  # positions 0..n-1 predict 1..n
        worst = max(worst, float(top_errors(logits, case["top"]).max()))
    for case in ref["greedy"]:
        logits = forced_logits(model, case["prompt_tokens"] + case["tokens"], len(case["prompt_tokens"]))
        worst = max(worst, float(top_errors(logits, case["top"]).max()))
        at = first_divergence(logits, case)
        if at is not None:
            (_, a), (_, b) = case["top"][at][:2]
            assert a - b < 2e-3, f"{case['id']}: token {at} differs, llama.cpp's top two {a} vs {b}"
    print(f"qwen3moe-tiny {wtype}: F32 twin, max |logit error| on llama.cpp's top-8 = {worst:.2e}")
    assert worst < TWIN_TOLERANCE


@pytest.mark.parametrize("wtype", TYPES)
def test_greedy_vs_llama_cpp_on_the_quantized_file(models, wtype, capsys):
    ref = _ref(wtype)
    model = models[wtype]
    twin = {c["id"]: c["tokens"] for c in ref["twin"]["greedy"]}
    rows = divergence_rows(model, ref["quantized"]["greedy"], twin)
    print_divergences(rows, f"qwen3moe-tiny {wtype}", capsys)
    bad = [r for r in rows if r[1] is not None and not (r[2] < 0.1 or r[3])]
    assert not bad, bad


def test_llm_greedy_generation_batched(files):
    """deimos.LLM on the CPU, three raw prompts decoded together (one step routes every
    sequence's token): the prompt tokens and the greedy tokens are llama.cpp's on the twin."""
    from deimos.engine import LLM

    ref = _ref("Q8_0")
    cases = [c for c in ref["twin"]["greedy"] if c["id"] in ("prose", "json", "url")]
    llm = LLM(files["Q8_0"], device="cpu")
    prompts = [ref["prompts"][c["id"]] for c in cases]
    assert [llm.encode_raw(p) for p in prompts] == [c["prompt_tokens"] for c in cases]
    n = 12
    outs = llm.generate_many(prompts, max_tokens=n, raw=True, temperature=0)
    for case, out in zip(cases, outs, strict=True):
        assert out.token_ids == case["tokens"][:n], case["id"]
    alone = llm.generate(prompts[1], max_tokens=n, raw=True, temperature=0)
    assert alone.token_ids == outs[1].token_ids


# ---- the block -------------------------------------------------------------------------------

def _llama_cpp_route(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """build_moe_ffn's softmax gating for one token, as written there: probs = softmax, ids =
    argsort descending (std::sort: insertion sort for <= 16 elements, stable), weights divided
    by their sum clamped at 6.103515625e-5."""
    p = np.exp(logits - logits.max())
    p = (p / p.sum()).astype(np.float32)
    ids = list(range(len(p)))
    for i in range(1, len(ids)):  # libstdc++'s __insertion_sort with comp = p[a] > p[b]
        j, v = i, ids[i]
        while j > 0 and p[v] > p[ids[j - 1]]:
            ids[j] = ids[j - 1]
            j -= 1
        ids[j] = v
    sel = np.array(ids[:k])
    w = p[sel]
    return w / max(w.sum(), np.float32(6.103515625e-5)), sel


@pytest.mark.parametrize("e,k", [(4, 2), (8, 3), (16, 16), (5, 1)], ids=lambda v: str(v))
def test_route_is_llama_cpps_softmax_top_k(e, k):
    g = torch.Generator().manual_seed(e * 100 + k)
    logits = torch.randn(37, e, generator=g) * 3
    logits[0] = 0.5  # every expert tied: lowest ids first
    logits[1, ::2] = logits[1, 1]  # ties among some
    logits[2] = torch.arange(e, dtype=torch.float32)  # the last expert first
    weights, ids = route(logits, k, normalize=True)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert ids[0].tolist() == list(range(k))
    assert ids[2].tolist() == list(range(e - 1, e - 1 - k, -1))
    for t in range(logits.shape[0]):
        w, sel = _llama_cpp_route(logits[t].double().numpy(), k)
        assert ids[t].tolist() == sel.tolist(), t
        torch.testing.assert_close(weights[t], torch.from_numpy(w).float(), rtol=1e-6, atol=1e-7)
    plain, plain_ids = route(logits, k, normalize=False)
    assert torch.equal(plain_ids, ids)
    torch.testing.assert_close(plain, torch.softmax(logits, -1).gather(1, ids))


def test_route_rejects_bad_k():
    with pytest.raises(ValueError, match="1 <= k <= E"):
        route(torch.zeros(3, 4), 5, True)
    with pytest.raises(ValueError, match="1 <= k <= E"):
        route(torch.zeros(4), 1, True)


def _dense_experts(f: GGUFFile, name: str) -> torch.Tensor:
    info = f.tensors[name]
    return torch.from_numpy(dequantize(f.tensor_bytes(name), info.ggml_type, info.shape, name))


def _per_token(x: torch.Tensor, router, gate, up, down, k: int) -> torch.Tensor:
    """The oracle: token by token, the full [E, n, k] tensors, the route written out."""
    out = torch.empty_like(x)
    for t in range(x.shape[0]):
        w, sel = _llama_cpp_route((router @ x[t]).double().numpy(), k)
        acc = None
        for s, e in enumerate(sel.tolist()):
            h = torch.nn.functional.silu(gate[e] @ x[t]) * (up[e] @ x[t])
            y = (down[e] @ h) * float(w[s])
            acc = y if acc is None else acc + y
        out[t] = acc
    return out


@pytest.mark.parametrize("wtype", TYPES)
def test_block_equals_a_per_token_loop_over_the_full_tensors(files, models, wtype):
    model = models[wtype]
    cfg = model.config
    with GGUFFile(files[wtype]) as f:
        for layer in (0, cfg.n_layer - 1):
            block = model.layers[layer].moe
            p = f"blk.{layer}."
            gate, up, down = (_dense_experts(f, f"{p}ffn_{n}_exps.weight") for n in ("gate", "up", "down"))
            x = torch.randn(29, cfg.n_embd, generator=torch.Generator().manual_seed(layer)) * 4
            x[3] = x[5]  # two equal tokens
            ours = moe_reference(x, block)
            want = _per_token(x, block.router, gate, up, down, cfg.n_expert_used)
            rel = float((ours - want).norm() / want.norm())
            print(f"{wtype} layer {layer}: rel. RMS error {rel:.1e}, max {float((ours - want).abs().max()):.1e}")
            assert rel < 1e-6
            assert torch.equal(ours[3], ours[5])


def test_block_with_every_token_on_one_expert_and_on_the_edges():
    """A hand-made block (lists as the experts): all tokens to the last expert, to expert 0,
    and k = E; float64 input stays float64."""
    g = torch.Generator().manual_seed(7)
    e, d, f = 5, 12, 7
    gate, up = torch.randn(e, f, d, generator=g), torch.randn(e, f, d, generator=g)
    down = torch.randn(e, d, f, generator=g)
    x = torch.randn(9, d, generator=g)
    x[:, 0] = 1.0
    for target in (0, e - 1):
        router = torch.zeros(e, d)
        router[target, 0] = 100.0  # logit 100 for the target, 0 for the others, every token
        for k in (1, 2, e):
            block = SimpleNamespace(router=router, gate=list(gate), up=list(up), down=list(down),
                                    n_expert_used=k, normalize=True, activation="silu")
            got = moe_reference(x, block)
            want = _per_token(x, router, gate, up, down, k)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            if k == 1:
                only = torch.nn.functional.silu(x @ gate[target].T) * (x @ up[target].T) @ down[target].T
                torch.testing.assert_close(got, only, rtol=1e-5, atol=1e-5)
    wide = moe_reference(x.double(), SimpleNamespace(router=router.double(), gate=list(gate), up=list(up),
                                                     down=list(down), n_expert_used=2, normalize=True,
                                                     activation="silu"))
    assert wide.dtype == torch.float64
    assert moe_reference(x[:0], block).shape == (0, d)


def test_experts_are_dequantized_lazily_and_the_cache_keeps_its_budget(files, models):
    path = files["Q4_K_M"]
    f = GGUFFile(path)
    cfg = ModelConfig.from_gguf(f.metadata, f.path, f.tensors)
    one = cfg.n_ff_exp * cfg.n_embd * 4  # bytes of one expert's matrix
    w = WeightSource(f, "cpu", expert_cache_bytes=5 * one)
    small = ARCHITECTURES["qwen3moe"](cfg, w)
    assert w.expert_cache.nbytes == 0  # nothing dequantized at load
    tokens = [1, 450, 2217, 338, 263, 1243, 29889, 13, 450]
    ref = forced_logits(models["Q4_K_M"], tokens, 1)
    got = forced_logits(small, tokens, 1)
    assert torch.equal(got, ref)
    cache = w.expert_cache
    assert 0 < cache.nbytes <= 5 * one and cache.misses > 0
    assert len(cache._entries) == 5
    # one token, a cache for everything: exactly its experts (k per layer, three matrices each)
    w = WeightSource(f, "cpu")
    big = ARCHITECTURES["qwen3moe"](cfg, w)
    KVCache(cfg, 1).forward(big, torch.tensor(tokens[:1]), torch.tensor([0]))
    assert len(w.expert_cache._entries) == cfg.n_layer * cfg.n_expert_used * 3
    assert w.expert_cache.nbytes == cfg.n_layer * cfg.n_expert_used * 3 * one


def test_gpu_source_packs_each_expert_tensor_as_one_matrix(files):
    """The kernel-path model loads (WeightSource with kernels=True; numpy packing, no kernel
    runs): each block holds PackedExperts, whose rows e*n .. e*n+n-1 decode (the layout's
    torch oracle) to expert e of deimos.quant's dequantization of the whole 3-D tensor."""
    from deimos.models.gpu.source import PackedExperts
    from deimos.quant.triton.naive import dequantize_packed

    f = GGUFFile(files["Q4_K_M"])
    cfg = ModelConfig.from_gguf(f.metadata, f.path, f.tensors)
    w = WeightSource(f, "cpu", kernels=True)
    model = ARCHITECTURES["qwen3moe"](cfg, w)
    kinds = set()
    for layer, proj in ((0, "gate"), (0, "down"), (cfg.n_layer - 1, "up"), (cfg.n_layer - 1, "down")):
        pe = getattr(model.layers[layer].moe, proj)
        name = f"blk.{layer}.ffn_{proj}_exps.weight"
        info = f.tensors[name]
        assert isinstance(pe, PackedExperts) and pe.name == name
        e, n, k = info.shape
        assert (pe.n_expert, pe.n, pe.k, pe.weight.n, pe.weight.k) == (e, n, k, e * n, k)
        full = _dense_experts(f, name)
        dec = dequantize_packed(pe.weight)
        for i in range(e):
            assert torch.equal(dec[i * n:(i + 1) * n], full[i]), (name, i)
        kinds.add(info.ggml_type.name)
    assert kinds == {"Q4_K", "Q6_K"}
    assert model.layers[0].moe.router.dtype == torch.float32
    with pytest.raises(ValueError, match="expected the 3-D"):
        w.gpu.experts(f.tensors["blk.0.attn_q.weight"])
    with pytest.raises(ValueError, match="'blk.0.ffn_gate_inp.weight' is F32: routed experts"):
        w.gpu.experts(f.tensors["blk.0.ffn_gate_inp.weight"]._replace(shape=(2, 2, 256)))


# ---- malformed files -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def header(files) -> fz.Image:
    """The Q8_0 file's header (sparse data: the checks must refuse before reading any)."""
    return fz.read_image(files["Q8_0"], with_data=False)


def _mutated(header, tmp_path, kvs=None, dims=None, drop=()):
    img = header.copy()
    for key, value in (kvs or {}).items():
        fz._set(img, f"qwen3moe.{key}", fz.U32, value)
    img.kvs = [kv for kv in img.kvs if kv.key not in {f"qwen3moe.{k}" for k in drop}]
    for t in img.tensors:
        if dims and t.name in dims:
            t.dims = dims[t.name]
    path = tmp_path / "mutated.gguf"
    fz.write_case(img, path)
    return path


def _config_error(path) -> str:
    with GGUFFile(path) as f, pytest.raises(ConfigError) as e:
        ModelConfig.from_gguf(f.metadata, f.path, f.tensors)
    msg = str(e.value)
    assert msg.startswith(f"{path}: "), msg
    return msg


@pytest.mark.parametrize("kvs,dims,want", [
    ({"expert_used_count": 5}, None,
     "'qwen3moe.expert_used_count' 5 is greater than 'qwen3moe.expert_count' 4"),
    ({"expert_count": 0}, None, "'qwen3moe.expert_count' is 0, outside [1, 1024]"),
    ({"expert_count": 1025}, None, "'qwen3moe.expert_count' is 1025, outside [1, 1024]"),
    ({"expert_used_count": 0}, None, "'qwen3moe.expert_used_count' is 0, outside"),
    ({"expert_count": 8}, None,  # the metadata says 8, the router has 4 rows
     ("tensor 'blk.0.ffn_gate_inp.weight' has dims [256, 4], expected [256, 8] "
      "(ne0 = 256 from 'qwen3moe.embedding_length' 256; ne1 = 8 from 'qwen3moe.expert_count' 8)")),
    (None, {"blk.3.ffn_gate_inp.weight": (256, 5)},  # a router width that is not the expert count
     "tensor 'blk.3.ffn_gate_inp.weight' has dims [256, 5], expected [256, 4]"),
    (None, {"blk.0.ffn_up_exps.weight": (256, 512, 3)},
     ("tensor 'blk.0.ffn_up_exps.weight' has dims [256, 512, 3], expected [256, 512, 4] "
      "(ne0 = 256 from 'qwen3moe.embedding_length' 256; ne1 = 512 from "
      "'qwen3moe.expert_feed_forward_length' 512; ne2 = 4 from 'qwen3moe.expert_count' 4)")),
    (None, {"blk.5.ffn_down_exps.weight": (256, 512, 4)},  # gate/up's shape where down's belongs
     "tensor 'blk.5.ffn_down_exps.weight' has dims [256, 512, 4], expected [512, 256, 4]"),
    (None, {"blk.1.ffn_gate_exps.weight": (256, 512)},  # a 2-D tensor where the 3-D one belongs
     "tensor 'blk.1.ffn_gate_exps.weight' has dims [256, 512], expected [256, 512, 4]"),
    ({"expert_feed_forward_length": 384}, None,
     "tensor 'blk.0.ffn_gate_exps.weight' has dims [256, 512, 4], expected [256, 384, 4]"),
], ids=["used>count", "count-0", "count-1025", "used-0", "count-vs-router", "router-width",
        "up-experts", "down-swapped", "gate-2d", "ff-exp"])
def test_malformed_moe_files_get_a_named_error(header, tmp_path, kvs, dims, want):
    assert want in _config_error(_mutated(header, tmp_path, kvs, dims))


def test_missing_expert_width_falls_back_as_llama_cpp(header, tmp_path):
    """Without expert_feed_forward_length llama.cpp takes feed_forward_length / expert_used_count
    (1024 / 2 = 512 here: the file still loads); without either, a named error."""
    path = _mutated(header, tmp_path, drop=("expert_feed_forward_length",))
    with GGUFFile(path) as f:
        assert ModelConfig.from_gguf(f.metadata, f.path, f.tensors).n_ff_exp == 512
    path = _mutated(header, tmp_path, kvs={"feed_forward_length": 3072},
                    drop=("expert_feed_forward_length",))
    msg = _config_error(path)
    assert "expected [256, 1536, 4]" in msg and "feed_forward_length / expert_used_count = 1536" in msg
    path = _mutated(header, tmp_path, drop=("expert_feed_forward_length", "feed_forward_length"))
    assert "'qwen3moe.expert_feed_forward_length' is missing" in _config_error(path)


def test_malformed_moe_file_through_deimos_run(header, tmp_path, capsys):
    from deimos.cli import main as cli_main

    path = _mutated(header, tmp_path, dims={"blk.2.ffn_gate_inp.weight": (256, 3)})
    rc = cli_main(["run", str(path), "hi", "--device", "cpu", "-n", "2"])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and len(err.splitlines()) == 1, err
    assert err.startswith(f"deimos: error: {path}: tensor 'blk.2.ffn_gate_inp.weight'"), err
