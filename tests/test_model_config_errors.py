"""Bad model metadata gets one clear error naming the file and the key, fast, from the same
entry as ``deimos run`` (issue 12: a huge block_count hung the load; head_count larger than
embedding_length raised ZeroDivisionError; a BYTE token not spelled <0xNN> raised ``invalid
literal for int()`` at decode).

Oracles: llama.cpp's loader for what is an error (block_count in 1..512, per-layer arrays of
exactly block_count entries, token_embd of [embedding_length, n_tokens]); the files are tiny
deimos.synth models (tools/fuzz_gguf.py writes them and their mutations).
"""

from __future__ import annotations

import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from testdata import REPO

from deimos.cli import main as cli_main
from deimos.gguf import GGUFFile
from deimos.models import ConfigError, ModelConfig, load_model
from deimos.tokenizer import Tokenizer, VocabError

sys.path.insert(0, str(REPO / "tools"))
import fuzz_gguf as fz  # noqa: E402


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, fz.Image]:
    return fz.build_bases(tmp_path_factory.mktemp("bases"), with_real=False)


def _mutated(bases, tmp_path: Path, base: str, **sets) -> Path:
    """``base`` with metadata keys set: key=(value type, value[, item type]); '@' stands for
    the architecture prefix, '__' for '.'."""
    img = bases[base].copy()
    arch = fz._arch(img)
    for key, spec in sets.items():
        fz._set(img, key.replace("__", ".").replace("@", arch), *spec)
    path = tmp_path / f"{base}.gguf"
    fz.write_case(img, path)
    return path


def _cli_error(path: Path, capsys) -> str:
    """``deimos run PATH hi``: exit status 1 and one ``deimos: error:`` line, no traceback."""
    rc = cli_main(["run", str(path), "hi", "--device", "cpu", "-n", "2"])
    err = capsys.readouterr().err.strip()
    assert rc == 1, err
    assert len(err.splitlines()) == 1 and err.startswith(f"deimos: error: {path}: "), err
    return err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("base", ["llama-spm-q8", "gemma3-gemma-q8"])
@pytest.mark.parametrize("vtype,value", [(fz.U32, 2**31 - 1), (fz.U32, 2**32 - 1), (fz.U64, 2**64 - 1),
                                         (fz.I32, -1), (fz.U32, 513), (fz.U32, 0)])
def test_absurd_block_count_fails_fast(bases, tmp_path, capsys, base, vtype, value):
    path = _mutated(bases, tmp_path, base, **{"@__block_count": (vtype, value)})
    with GGUFFile(path) as f:
        tracemalloc.start()
        t0 = time.perf_counter()
        with pytest.raises(ConfigError, match="block_count") as e:
            load_model(f)
        dt = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert str(e.value).startswith(f"{path}: ")
    assert dt < 0.05 and peak < 1 << 20, (dt, peak)
    assert "block_count" in _cli_error(path, capsys)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("base", ["llama-spm-q8", "gemma3-gemma-q8"])
def test_block_count_one_more_than_the_layers_present(bases, tmp_path, capsys, base):
    n = fz._n_layer(bases[base])
    path = _mutated(bases, tmp_path, base, **{"@__block_count": (fz.U32, n + 1)})
    err = _cli_error(path, capsys)
    assert f"block_count' is {n + 1}, but the file has tensors of {n} layers" in err


def test_head_count_larger_than_embedding_length(bases, tmp_path, capsys):
    # llama-tiny: embedding_length 128, no key_length: the head size would be 128 // 256 = 0
    path = _mutated(bases, tmp_path, "llama-spm-q8", **{"@__attention__head_count": (fz.U32, 256),
                                                        "@__attention__head_count_kv": (fz.U32, 256)})
    err = _cli_error(path, capsys)
    assert "'llama.attention.head_count' 256 is larger than 'llama.embedding_length' 128" in err


def test_byte_token_whose_text_is_not_hex(bases, tmp_path, capsys):
    img = bases["llama-spm-q8"].copy()
    tokens = fz._tokens(img)
    types = np.array(img.get("tokenizer.ggml.token_type").value)
    tid = next(i for i, t in enumerate(tokens) if types[i] == 1 and not t.startswith("<"))
    types[tid] = 6  # BYTE
    fz._set(img, "tokenizer.ggml.token_type", fz.ARR, types, fz.I32)
    path = tmp_path / "byte.gguf"
    fz.write_case(img, path)
    with GGUFFile(path) as f, pytest.raises(VocabError) as e:
        Tokenizer.from_gguf(f)  # at load, not at decode
    assert f"token {tid} has type BYTE" in str(e.value) and repr(tokens[tid]) in str(e.value)
    assert f"token {tid} has type BYTE" in _cli_error(path, capsys)


@pytest.mark.parametrize("key,spec,words", [
    ("@__attention__layer_norm_rms_epsilon", (fz.F32, float("nan")), "layer_norm_rms_epsilon"),
    ("@__attention__layer_norm_rms_epsilon", (fz.F32, 0.0), "layer_norm_rms_epsilon"),
    ("@__rope__freq_base", (fz.F32, float("inf")), "rope.freq_base"),
    ("@__rope__freq_base", (fz.F64, -1.0), "rope.freq_base"),
    ("@__rope__scaling__factor", (fz.F32, 1e-45), "rope.scaling.factor"),
    ("@__attention__head_count_kv", (fz.I32, -1), "head_count_kv"),
    ("@__attention__head_count_kv", (fz.U32, 3), "head_count_kv"),
    ("@__attention__head_count", (fz.ARR, [4, 4, 4], fz.U32), "one per layer"),
    ("@__attention__head_count", (fz.ARR, [4, 8], fz.U32), "varies by layer"),
    ("@__attention__head_count", (fz.STR, "4"), "attention.head_count"),
    ("@__feed_forward_length", (fz.U64, 2**64 - 1), "feed_forward_length"),
    ("@__embedding_length", (fz.U32, 129), "embedding_length"),
    ("@__context_length", (fz.U32, 0), "context_length"),
    ("@__rope__dimension_count", (fz.U32, 31), "rope.dimension_count"),
    ("@__rope__dimension_count", (fz.U32, 2**31 - 1), "rope.dimension_count"),
    ("@__attention__key_length", (fz.U32, 2**32 - 1), "key_length"),
    ("@__rope__scaling__type", (fz.STR, "yarn"), "rope.scaling.type"),
    ("tokenizer__ggml__bos_token_id", (fz.STR, "1"), "bos_token_id"),
    ("tokenizer__ggml__add_bos_token", (fz.STR, "false"), "add_bos_token"),
    ("tokenizer__ggml__scores", (fz.ARR, ["a"] * 600, fz.STR), "tokenizer.ggml.scores"),
    ("tokenizer__ggml__token_type", (fz.ARR, [1] * 10, fz.I32), "tokenizer.ggml.token_type"),
])
def test_bad_value_names_the_key(bases, tmp_path, key, spec, words):
    path = _mutated(bases, tmp_path, "llama-spm-q8", **{key: spec})
    with pytest.raises((ConfigError, VocabError)) as e:
        from deimos.engine import LLM

        LLM(path, device="cpu")
    assert str(e.value).startswith(f"{path}: ") and words in str(e.value), str(e.value)


@pytest.mark.parametrize("key,value", [
    ("@__attention__sliding_window_pattern", (fz.STR, "6")),
    ("@__attention__sliding_window_pattern", (fz.ARR, [1, 0], fz.BOOL)),
    ("@__attention__sliding_window", (fz.I32, -8)),
    ("@__rope__freq_base_swa", (fz.F32, float("nan"))),
])
def test_gemma3_window_keys(bases, tmp_path, key, value):
    path = _mutated(bases, tmp_path, "gemma3-gemma-q8", **{key: value})
    with GGUFFile(path) as f, pytest.raises(ConfigError, match=key.split("__", 1)[1].replace("__", ".")):
        ModelConfig.from_gguf(f.metadata, f.path, f.tensors)


def test_uniform_per_layer_array_is_the_scalar(bases, tmp_path):
    """llama.cpp takes a per-layer array of block_count equal entries as the scalar."""
    base = bases["qwen3-smol-f16"]
    n = fz._n_layer(base)
    path = _mutated(bases, tmp_path, "qwen3-smol-f16", **{
        "@__attention__head_count": (fz.ARR, [4] * n, fz.U32),
        "@__feed_forward_length": (fz.ARR, [192] * n, fz.I32)})
    with GGUFFile(path) as f:
        assert f.value_types["qwen3.attention.head_count"][0] == fz.ARR
        cfg = ModelConfig.from_gguf(f.metadata, f.path, f.tensors)
    assert (cfg.n_head, cfg.n_ff, cfg.n_layer) == (4, 192, n)


def test_valid_bases_load_and_run(bases, tmp_path):
    """The fuzz bases themselves are fine: the checks refuse mutations, not models."""
    from deimos.engine import LLM

    for name in ("qwen2-smol-q4", "gemma3-gemma-q8"):  # biases; sliding window and its keys
        path = tmp_path / f"{name}.gguf"
        fz.write_case(bases[name], path)
        llm = LLM(path, device="cpu")
        assert len(llm.generate("hi", max_tokens=1, temperature=0).token_ids) == 1


@pytest.mark.timeout(60)
def test_forged_layer_index_in_a_tensor_name(bases, tmp_path, capsys):
    """A tensor named blk.2147483647.*: the layer check names the gap, never spans the range."""
    img = bases["llama-spm-q8"].copy()
    img.tensors[-1].name = "blk.2147483647.attn_norm.weight"
    path = tmp_path / "forged.gguf"
    fz.write_case(img, path)
    t0 = time.perf_counter()
    err = _cli_error(path, capsys)
    assert time.perf_counter() - t0 < 5
    assert "layer tensors up to blk.2147483647 with blk.2 missing" in err


def test_weight_type_without_a_decoder_names_the_file(bases, tmp_path, capsys):
    img = bases["llama-spm-q8"].copy()
    t = next(t for t in img.tensors if t.name == "blk.0.attn_q.weight")
    t.ggml_type = int(fz.GGMLType.Q8_1)  # a valid GGML type with no CPU decoder
    path = tmp_path / "q81.gguf"
    fz.write_case(img, path)
    assert "'blk.0.attn_q.weight': GGML type Q8_1 has no decoder" in _cli_error(path, capsys)


def test_token_text_that_is_not_utf8(bases, tmp_path):
    """GGUF strings are bytes to llama.cpp; a token of invalid UTF-8 decodes to its bytes."""
    img = bases["qwen3-smol-f16"].copy()
    tokens = fz._tokens(img)
    tid = next(i for i, t in enumerate(tokens) if t == "<|im_end|>")  # a control token
    tokens[tid] = "<|im_end\udcff|>"  # the reader's surrogateescape form of byte 0xFF
    path = tmp_path / "bytes.gguf"
    fz.write_case(img, path)
    with GGUFFile(path) as f:
        tok = Tokenizer.from_gguf(f)
    assert tok.token_to_piece(tid) == b"<|im_end\xff|>"
    assert tok.encode("<|im_end\udcff|>", add_special=False, parse_special=True) == [tid]


@pytest.mark.timeout(120)
def test_weights_too_big_for_memory_are_refused_before_loading(tmp_path):
    """The SmolLM2 header with every MLP 4096 times wider, shapes consistent, the data a sparse
    hole (~200 GB): the float32 CPU reference would need ~1.3 TB. Refused up front with a
    named error; run in the fuzz worker so that, were the check missing, its memory watchdog
    (2 GiB) would stop the load instead of the system's OOM killer."""
    from testdata import model_path

    img = fz.read_image(model_path("SmolLM2-135M-Instruct.Q4_1.gguf"), with_data=False)
    assert fz.m_scale_ffn(img, _Always(4096)) == "ffn x4096"
    path = tmp_path / "wide.gguf"
    fz.write_case(img, path)
    log = open(tmp_path / "worker.log", "w")  # noqa: SIM115 - closed below
    worker = fz.Worker(2 << 30, log)
    try:
        res = worker.run(path, timeout=90)
    finally:
        worker.stop()
        log.close()
    assert res["outcome"] == "clean" and res["type"] == "MemoryBudgetError", res
    assert "the float32 CPU reference needs" in res["msg"] and res["seconds"] < 10, res


class _Always:
    """A random.Random stand-in whose choice is fixed."""

    def __init__(self, value):
        self.value = value

    def choice(self, _):
        return self.value
