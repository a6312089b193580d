"""``deimos perplexity``: llama-perplexity's windows and statistics.

Oracles: a straightforward loop (each window evaluated whole from an empty cache, every
position's logits, ``torch.log_softmax``, the second half scored) on a tiny synth model; the
window arithmetic written out by hand; llama-perplexity's own number on SmolLM2, recorded in
tests/data/reference/ by tools/compare_perplexity.py.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from testdata import data_file, llama_cpp_path, model_path, reference

from deimos import cli
from deimos.eval import corpus
from deimos.eval.logits_file import LogProbFile, LogProbHeader, LogProbWriter
from deimos.eval.perplexity import (PerplexityError, evaluate, plan_windows, ppl_estimate,
                                    window_input, window_targets)
from deimos.gguf import GGUFFile
from deimos.models import load_model
from deimos.runtime.kv_cache import KVCache
from deimos.synth import write_model

DONOR = "models/ggml-vocab-llama-spm.gguf"  # adds BOS: the windows' first token is replaced
SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    p = tmp_path_factory.mktemp("ppl") / "llama-tiny.gguf"
    write_model(p, "llama", "llama-tiny", "Q8_0", llama_cpp_path(DONOR), seed=3)
    return load_model(GGUFFile(p))


def oracle_nll(model, tokens: np.ndarray, n_ctx: int, n_chunk: int, bos: int | None) -> list[float]:
    out = []
    for c in range(n_chunk):
        ids = torch.tensor(tokens[c * n_ctx:(c + 1) * n_ctx], dtype=torch.long)
        targets = ids.clone()
        if bos is not None:
            ids[0] = bos
        kv = KVCache(model.config, n_ctx)
        logits = kv.forward(model, ids, torch.arange(n_ctx))
        logp = torch.log_softmax(logits.double(), dim=-1)
        for j in range(n_ctx // 2, n_ctx - 1):
            out.append(-float(logp[j, targets[j + 1]]))
    return out


@pytest.mark.parametrize("n_ctx,n_batch", [(16, 16), (11, 4), (10, 3)],
                         ids=["one-step", "odd-ctx", "steps-of-3"])
def test_perplexity_equals_direct_computation(tiny, n_ctx, n_batch):
    rng = np.random.default_rng(n_ctx)
    n_vocab = tiny.config.n_vocab
    tokens = rng.integers(3, n_vocab, size=3 * n_ctx + n_ctx // 2)  # a partial window is dropped
    w = plan_windows(tokens.shape[0], n_ctx)
    assert w.n_chunk == 3
    r = evaluate(tiny, tokens, w, bos_id=1, n_batch=n_batch)
    want = oracle_nll(tiny, tokens, n_ctx, 3, bos=1)
    assert r.nll.shape == (3 * (n_ctx - 1 - n_ctx // 2),)
    np.testing.assert_allclose(r.nll, want, rtol=1e-5, atol=1e-5)
    assert math.isclose(r.ppl.value, math.exp(np.mean(want)), rel_tol=1e-5)
    x = np.array(want)
    unc = math.exp(x.mean()) * math.sqrt(((x * x).mean() - x.mean() ** 2) / (x.size - 1))
    assert math.isclose(r.ppl.unc, unc, rel_tol=1e-4)
    assert r.chunk_ppl[-1] == pytest.approx(r.ppl.value)


def test_windows_and_halves():
    w = plan_windows(25, 7)  # 3 windows of 7 (4 tokens left over); first = 3; positions 3..5 scored
    assert (w.n_chunk, w.first, w.scored_per_chunk) == (3, 3, 3)
    tokens = np.arange(100, 125)
    assert window_input(tokens, w, 1, None).tolist() == list(range(107, 114))
    assert window_input(tokens, w, 1, 1).tolist() == [1, *range(108, 114)]  # replaced, not shifted
    assert window_targets(tokens, w, 1).tolist() == [111, 112, 113]  # never the BOS
    assert plan_windows(25, 7, n_chunks=2).n_chunk == 2
    assert plan_windows(25, 7, n_chunks=99).n_chunk == 3
    w = plan_windows(8, 4)
    assert (w.n_chunk, w.first, w.scored_per_chunk) == (2, 2, 1)


@pytest.mark.parametrize("n_tokens,n_ctx,chunks,message", [
    (13, 7, None, "needs at least 14"),
    (100, 3, None, "at least 4 tokens"),
    (100, 8, 0, "--chunks 0"),
])
def test_bad_windows_are_clear_errors(n_tokens, n_ctx, chunks, message):
    with pytest.raises(PerplexityError, match=message):
        plan_windows(n_tokens, n_ctx, chunks)


def test_ppl_estimate_is_llama_cpp_formula():
    x = np.array([1.0, 2.0, 4.0, 0.5])
    p = ppl_estimate(x)
    assert p.value == pytest.approx(math.exp(1.875))
    assert p.unc == pytest.approx(math.exp(1.875) * math.sqrt(np.var(x) / 3))


def test_read_text_as_llama_perplexity(tmp_path):
    f = tmp_path / "t.txt"
    f.write_bytes(b"one\r\ntwo\n\n")
    assert corpus.read_text(f) == "one\r\ntwo\n"  # CRLF kept, one newline dropped
    f.write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match="not UTF-8"):
        corpus.read_text(f)


# ---- the command on SmolLM2 -------------------------------------------------------------


def alice() -> str:
    return str(data_file("texts/alice29.txt"))


def deimos(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deimos.cli", *args], capture_output=True,
                          text=True, timeout=600)


def test_text_is_the_recorded_public_domain_file():
    src = corpus.TEXTS["alice29"]
    path = data_file("texts/alice29.txt")
    assert path.stat().st_size == src.size
    from deimos.registry import sha256_file

    assert sha256_file(path) == src.sha256


def test_cli_matches_llama_perplexity_and_kld_of_itself_is_zero(tmp_path):
    """One run writes the base file, a second reads it back: the reference number of
    llama-perplexity on the same text and -c, and a KLD of the model with itself of 0 up to
    the 16-bit storage (< 1e-5 nats), top token always the same."""
    ref = reference("perplexity-SmolLM2-135M-Instruct.Q4_1.json")
    model = str(model_path(SMOL))
    c, chunks = str(ref["n_ctx"]), str(ref["chunks"])
    base = tmp_path / "base.bin"
    r = deimos("perplexity", model, alice(), "-c", c, "--chunks", chunks, "--device", "cpu",
               "--kl-divergence-base", str(base), "--json", "-")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert "Final estimate: PPL" in r.stderr and "[1/" in r.stderr
    assert out["scored"] == ref["scored"] and out["n_tokens"] == ref["n_tokens"]
    llama = ref["llama_cpp"]["ppl"]
    rel = abs(out["ppl"] - llama) / llama
    print(f"deimos {out['ppl']:.4f} llama.cpp {llama:.4f}: rel diff {rel:.2e} "
          f"(tolerance {ref['tolerance_rel']})")
    assert rel < ref["tolerance_rel"]
    assert LogProbFile(base).header.model == SMOL

    r = deimos("perplexity", model, "--kl-divergence-base", str(base), "--kl-divergence",
               "--device", "cpu", "--json", "-")
    assert r.returncode == 0, r.stderr
    k = json.loads(r.stdout)["kld"]
    # the 16-bit reference is not exactly normalized: a KLD of a few 1e-6 either side
    assert abs(k["kld"]["value"]) < 1e-5 and k["kld_percentiles"]["max"] < 1e-4
    assert k["same_top"]["value"] == 1.0
    assert abs(k["ppl"]["value"] - out["ppl"]) < 1e-9 * out["ppl"]
    assert abs(k["delta_p"]["value"]) < 1e-4


@pytest.mark.parametrize("extra,message", [
    (["--kl-divergence"], "needs --kl-divergence-base"),
    ([], "needs a TEXT"),
    (["no-such.txt"], "no such text file: no-such.txt"),
    (["TEXT", "-c", "30000"], "needs at least 60000"),
    (["TEXT", "--chunks", "0"], "--chunks 0"),
    (["--kl-divergence-base", "BASE", "--kl-divergence"], "not a log-prob file"),
    (["--kl-divergence-base", "OTHER", "--kl-divergence"], "made with another tokenizer"),
    (["--kl-divergence-base", "NOVOCAB", "--kl-divergence", "-c", "8"], "this run asks for -c 8"),
])
def test_cli_bad_input_is_one_clear_line(extra, message, capsys, tmp_path):
    """Refused before the weights are loaded: one line on stderr, exit 1."""
    (tmp_path / "base.bin").write_bytes(b"GGUF" + bytes(40))
    for name, fingerprint in (("other", "0" * 64), ("novocab", "")):  # "": llama.cpp's files
        h = LogProbHeader(f"{name}.gguf", 49152, 4, 1, vocab_sha256=fingerprint)
        with LogProbWriter(tmp_path / f"{name}.bin", h, np.zeros(4, dtype=np.int32)) as w:
            w.write_rows(np.zeros((1, 49152)))
    files = {"TEXT": alice(), "BASE": str(tmp_path / "base.bin"),
             "OTHER": str(tmp_path / "other.bin"), "NOVOCAB": str(tmp_path / "novocab.bin")}
    extra = [files.get(a, a) for a in extra]
    assert cli.main(["perplexity", str(model_path(SMOL)), *extra, "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1
