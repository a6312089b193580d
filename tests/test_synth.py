"""deimos.synth: random-weight GGUF files of real architectures.

Oracles:
- llama.cpp loaded and ran each tiny file (tools/make_synth_reference.py); the reference
  records the file's sha256, so regenerating the byte-identical file proves the writer still
  writes what llama.cpp accepted;
- gguf-py's per-architecture tensor-name tables (independent of our arch.py);
- llama.cpp's greedy logits in the references show the promised peaked distributions.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import gguf
import numpy as np
import pytest
from testdata import LLAMA_CPP, data_file, reference

from deimos.gguf import GGUFFile
from deimos.quant import dequantize
from deimos.synth import PRESETS, get_preset, write_model
from deimos.synth.writer import NORM_GAIN, OUTPUT_GAIN

ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
VOCABS = f"{LLAMA_CPP}/models"
GGUF_PY_ARCH = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "gemma3": gguf.MODEL_ARCH.GEMMA3,
}


def synth_reference(arch: str) -> dict:
    return reference(f"synth-{arch}-tiny.json")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory) -> dict[str, Path]:
    """The four reference models, written again from the parameters their reference records."""
    out = {}
    tmp = tmp_path_factory.mktemp("synth")
    for arch in ARCHS:
        s = synth_reference(arch)["synth"]
        donor = data_file(s["vocab_from"])
        assert sha256(donor) == s["vocab_from_sha256"], f"{donor} is not the recorded donor"
        out[arch] = write_model(tmp / f"{arch}.gguf", arch, s["preset"], s["ggml_type"], donor,
                                s["seed"])
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_regenerated_file_is_the_one_llama_cpp_ran(arch, regenerated):
    ref = synth_reference(arch)
    path = regenerated[arch]
    assert path.stat().st_size == ref["model"]["size"]
    assert sha256(path) == ref["model"]["sha256"], (
        "synth output changed: if intended, rerun tools/make_synth_reference.py")


@pytest.mark.parametrize("arch", ARCHS)
def test_tensor_names_are_those_gguf_py_knows_for_the_arch(arch, regenerated):
    known = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[GGUF_PY_ARCH[arch]]}
    preset = get_preset(synth_reference(arch)["synth"]["preset"])
    with GGUFFile(regenerated[arch]) as f:
        assert f.metadata["general.architecture"] == arch
        names = list(f.tensors)
        n_vocab = len(f.metadata["tokenizer.ggml.tokens"])
        emb = f.tensors["token_embd.weight"]
    for name in names:
        base, _, suffix = name.rpartition(".")
        if base.startswith("blk."):
            layer = int(base.split(".")[1])
            base = base.replace(f"blk.{layer}.", "blk.{bid}.", 1)
        assert suffix in ("weight", "bias") and base in known, f"{name} is not a {arch} tensor"
    assert ("output.weight" in names) == (not preset.tied_embeddings)
    assert emb.dims == (preset.n_embd, n_vocab)
    n_layer_tensors = {int(n.split(".")[1]) for n in names if n.startswith("blk.")}
    assert n_layer_tensors == set(range(preset.n_layer))


@pytest.mark.parametrize("arch", ARCHS)
def test_llama_cpp_next_token_distributions_are_peaked(arch):
    # The writer's scales promise a top-2 logit gap > 0.1 in most steps (stable greedy tokens).
    ref = synth_reference(arch)
    gaps = np.array([s[0][1] - s[1][1] for r in ref["greedy"] for s in r["top"]])
    assert len(gaps) >= 100
    assert np.mean(gaps > 0.1) > 0.85, f"{arch}: only {np.mean(gaps > 0.1):.0%} of gaps > 0.1"
    distinct = {t for r in ref["greedy"] for t in r["tokens"]}
    assert len(distinct) > len(gaps) // 4, f"{arch}: greedy output collapses to few tokens"


def test_norm_gains_match_the_documented_scales(regenerated):
    with GGUFFile(regenerated["gemma3"]) as f:
        def values(name):
            info = f.tensors[name]
            return dequantize(f.tensor_bytes(name), info.ggml_type, info.shape, name)

        assert abs(values("output_norm.weight").mean() - OUTPUT_GAIN) < 0.1 * OUTPUT_GAIN
        assert abs(values("blk.0.ffn_norm.weight").mean() - NORM_GAIN) < 0.1 * NORM_GAIN
        assert abs(values("blk.0.attn_q_norm.weight").mean() - 1.0) < 0.1
        w = values("blk.0.ffn_up.weight")
        assert 0.01 < w.std() < 0.2 and np.isfinite(w).all()


def test_tokenizer_keys_copied_exactly(regenerated):
    s = synth_reference("qwen2")["synth"]
    with GGUFFile(data_file(s["vocab_from"])) as donor, GGUFFile(regenerated["qwen2"]) as out:
        keys = [k for k in donor.metadata if k.startswith("tokenizer.")]
        assert "tokenizer.ggml.merges" in keys
        for k in keys:
            a, b = donor.metadata[k], out.metadata[k]
            same = np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
            assert same and donor.value_types[k] == out.value_types[k], k


def test_seed_changes_weights_only(tmp_path):
    donor = data_file(f"{VOCABS}/ggml-vocab-llama-spm.gguf")
    a = write_model(tmp_path / "a.gguf", "qwen3", "qwen3-tiny", "Q8_0", donor, seed=1)
    b = write_model(tmp_path / "b.gguf", "qwen3", "qwen3-tiny", "Q8_0", donor, seed=2)
    with GGUFFile(a) as fa, GGUFFile(b) as fb:
        assert list(fa.tensors) == list(fb.tensors)
        assert fa.data_offset == fb.data_offset
        name = "blk.1.attn_q.weight"
        assert not np.array_equal(fa.tensor_bytes(name), fb.tensor_bytes(name))


def test_presets_cover_each_arch_tiny_and_real():
    for arch in ARCHS:
        assert f"{arch}-tiny" in PRESETS
    for name in ("llama-1b", "llama-8b", "qwen3-0.6b", "qwen3-4b", "gemma3-270m"):
        assert name in PRESETS


@pytest.mark.parametrize(
    "args, match",
    [
        (("qwen3", "qwen3-huge", "F32"), "unknown synth preset 'qwen3-huge'"),
        (("llama", "qwen3-tiny", "F32"), "is a qwen3 model, not llama"),
        (("qwen3", "qwen3-tiny", "Q9_9"), "unknown GGML type 'Q9_9'"),
        (("qwen3", "qwen3-tiny", "I32"), "I32 is not a weight type"),
        (("qwen3", "qwen3-tiny", "Q4_K"),
         r"token_embd.weight: row length 64 .* Q4_K block size 256"),
    ],
    ids=["preset", "arch", "type", "int-type", "block"],
)
def test_bad_arguments_are_named(tmp_path, args, match):
    donor = data_file(f"{VOCABS}/ggml-vocab-llama-spm.gguf")
    with pytest.raises(ValueError, match=match):
        write_model(tmp_path / "x.gguf", *args, donor, seed=0)
    assert not (tmp_path / "x.gguf").exists()


def test_donor_without_tokenizer_is_refused(tmp_path):
    w = gguf.GGUFWriter(tmp_path / "empty.gguf", "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    with pytest.raises(ValueError, match="no tokenizer.ggml.tokens"):
        write_model(tmp_path / "x.gguf", "qwen3", "qwen3-tiny", "F32", tmp_path / "empty.gguf")
