"""The comparisons of a hybrid (Gated DeltaNet) model with llama.cpp's reference runs that
tests/test_qwen35moe.py and tests/test_qwen3next.py share (tools/make_qwen35_reference.py
wrote the references: F32 files, so llama.cpp's logits are the exact float32 function).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from test_model_vs_llama_cpp import top_errors
from testdata import data_file, llama_cpp_path, reference

from deimos.gguf import GGUFFile
from deimos.models import ModelConfig
from deimos.models.deltanet import HybridKV, RecurrentState
from deimos.runtime.kv_cache import KVCache
from deimos.synth import write_model


def tiny_qwen35(tmp_path_factory, folder: str) -> GGUFFile:
    """The qwen35-tiny Q8_0 file (seed 11, llama.cpp's SPM test vocabulary) that the GPU and
    state-pool tests share, written under a new ``folder``."""
    path = tmp_path_factory.mktemp(folder) / "qwen35-tiny-Q8_0.gguf"
    write_model(path, "qwen35", "qwen35-tiny", "Q8_0", llama_cpp_path("models/ggml-vocab-llama-spm.gguf"),
                seed=11)
    return GGUFFile(path)


def ref_file(preset: str) -> dict:
    return reference(f"synth-{preset}-F32.json")


def rebuild(preset: str, tmp: Path, ggml_type: str | None = None) -> Path:
    """The file llama.cpp ran, written again from the parameters its reference records (in
    ``ggml_type`` instead of the recorded type where given: the same weights quantized)."""
    ref = ref_file(preset)
    s = ref["synth"]
    donor = data_file(s["vocab_from"])
    assert hashlib.sha256(donor.read_bytes()).hexdigest() == s["vocab_from_sha256"], donor
    name = ref["model"]["file"] if ggml_type is None else f"synth-{s['preset']}-{ggml_type}.gguf"
    return write_model(tmp / name, s["arch"], s["preset"], ggml_type or s["ggml_type"], donor, s["seed"])


def same_file(path: Path, preset: str) -> bool:
    ref = ref_file(preset)["model"]
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return path.stat().st_size == ref["size"] and digest == ref["sha256"]


def step(model, kv: KVCache, state: RecurrentState, tokens: list[int], logits_at=None,
         device: str = "cpu") -> torch.Tensor:
    """One step of one sequence (its recurrent state through HybridKV); logits [N, V]."""
    b = kv.batch(torch.tensor(tokens, device=device), logits_at)
    b.kv = HybridKV(b.kv, [state])
    logits = model.step(b)
    kv.commit(len(tokens))
    return logits


def forced_error(model, preset: str) -> float:
    """Each forced sequence in one step: max |logit error| on llama.cpp's top-8 at every position."""
    worst = 0.0
    for case in ref_file(preset)["forced"]:
        tokens = case["tokens"]
        kv, st = KVCache(model.config, len(tokens)), RecurrentState.zeros(model.config)
        logits = step(model, kv, st, tokens, torch.arange(len(tokens)))
        worst = max(worst, float(top_errors(logits, case["top"]).max()))
        assert st.length == len(tokens)
    return worst


def greedy_error(model, preset: str, n: int = 6) -> float:
    """Each prompt in one step, then one token a step (the recurrent rule, the carried conv
    inputs); llama.cpp's first ``n`` greedy tokens asserted, the max |logit error| returned."""
    worst = 0.0
    for case in ref_file(preset)["greedy"]:
        prompt, want = case["prompt_tokens"], case["tokens"][:n]
        kv = KVCache(model.config, len(prompt) + len(want))
        st = RecurrentState.zeros(model.config)
        logits = [step(model, kv, st, prompt)[0]]
        for tok in want[:-1]:
            logits.append(step(model, kv, st, [tok])[0])
        logits = torch.stack(logits)
        assert logits.argmax(-1).tolist() == want, case["id"]
        worst = max(worst, float(top_errors(logits, case["top"][: len(want)]).max()))
    return worst


def check_split_and_snapshot(model, tokens: list[int], cut: int = 64) -> None:
    """The tokens in two steps equal one step; a snapshot taken after the first step, restored,
    continues to the same logits (bit for bit)."""
    kv, st = KVCache(model.config, len(tokens)), RecurrentState.zeros(model.config)
    whole = step(model, kv, st, tokens)
    kv, st = KVCache(model.config, len(tokens)), RecurrentState.zeros(model.config)
    step(model, kv, st, tokens[:cut])
    snap = st.clone()
    split = step(model, kv, st, tokens[cut:])
    torch.testing.assert_close(split, whole, rtol=0, atol=2e-4)
    kv.truncate(cut)
    again = step(model, kv, snap, tokens[cut:])
    torch.testing.assert_close(again, split, rtol=0, atol=0)


def config_of(path: Path, drop: str | None = None, **changes) -> ModelConfig:
    """The file's config with ``<arch>.KEY`` metadata changed (None: removed) and the tensor
    ``drop`` left out of the tensor table."""
    with GGUFFile(path) as f:
        arch = f.metadata["general.architecture"]
        md = dict(f.metadata)
        for k, v in changes.items():
            key = f"{arch}.{k}"
            if v is None:
                md.pop(key, None)
            else:
                md[key] = v
        tensors = {n: t for n, t in f.tensors.items() if n != drop}
        return ModelConfig.from_gguf(md, source="tiny", tensors=tensors)


MIX_REF = "synth-mix-types-hybrid.json"  # tools/make_hybrid_mix_reference.py


def mix_mismatches(preset: str) -> dict:
    """deimos.synth's mix types of ``preset`` against llama-quantize --dry-run's, for every
    ftype: {ftype: {tensor: (ours, llama.cpp's)}} of the tensors that differ (first 5)."""
    from deimos.synth import get_preset, weight_types
    from deimos.synth.arch import tensor_specs

    rec = reference(MIX_REF)["presets"][preset]
    p = get_preset(preset)
    specs = tensor_specs(p, 32000)  # the vocabulary size does not enter the rules
    assert sorted(s.name for s in specs) == sorted(rec["names"])
    bad = {}
    for ftype, recorded in rec["types"].items():
        want = dict(zip(rec["names"], recorded.split()))
        got = {s.name: t.name for s, t in zip(specs, weight_types(ftype).tensor_types(p, specs))}
        wrong = {n: (got[n], want[n]) for n in want if got[n] != want[n]}
        if wrong:
            bad[ftype] = dict(list(wrong.items())[:5])
    return bad
