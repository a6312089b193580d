"""KL-divergence statistics (deimos.eval.kld) and the log-prob files (deimos.eval.logits_file).

Oracles: torch's own ``kl_div`` and ``softmax`` for the per-position values, plain Python
loops written after llama.cpp's perplexity.cpp for its statistics and its 16-bit row
encoding, and a file laid out by hand as llama-perplexity writes it.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch

from deimos.eval import kld
from deimos.eval.logits_file import (FLOOR, LLAMA_MAGIC, LogitsFileError, LogProbFile,
                                     LogProbHeader, LogProbWriter, decode_rows, encode_rows)

V = 257  # odd: the rows carry one pad word


def logp_pair(n: int = 40, noise: float = 0.3, seed: int = 0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n, V)) * 4
    ref = kld.log_softmax(logits)
    test = kld.log_softmax(logits + rng.normal(size=(n, V)) * noise)
    return ref, test, rng.integers(0, V, size=n)


def test_against_itself_is_zero_and_same_top():
    ref, _, tokens = logp_pair()
    s = kld.compare_positions(ref, ref, tokens)
    assert np.all(s.kld == 0) and s.same_top.all() and np.all(s.delta_p == 0)
    summary = kld.summarize(s)
    assert summary.kld.value == 0 and summary.same_top.value == 1.0
    assert summary.ppl.value == pytest.approx(summary.ppl_ref.value)


def test_known_perturbation_equals_torch():
    ref, test, tokens = logp_pair()
    want = torch.nn.functional.kl_div(torch.from_numpy(test), torch.from_numpy(ref),
                                      reduction="none", log_target=True).sum(-1).numpy()
    s = kld.compare_positions(ref, test, tokens)
    np.testing.assert_allclose(s.kld, want, rtol=1e-10, atol=1e-15)
    assert np.all(s.kld > 0)
    p, q = torch.softmax(torch.from_numpy(ref), -1), torch.softmax(torch.from_numpy(test), -1)
    idx = torch.from_numpy(tokens)[:, None]
    np.testing.assert_allclose(s.delta_p, (q.gather(1, idx) - p.gather(1, idx))[:, 0].numpy(),
                               atol=1e-14)
    assert np.array_equal(s.same_top, (p.argmax(-1) == q.argmax(-1)).numpy())
    np.testing.assert_allclose(s.nll, -np.log(q.gather(1, idx)[:, 0].numpy()), rtol=1e-12)


def test_floor_drops_only_low_reference_terms():
    ref, test, _ = logp_pair()
    full = kld.kld_per_position(ref, test)
    floored = kld.kld_per_position(ref, test, floor=-16.0)
    kept = np.where(ref > -16, np.exp(ref) * (ref - test), 0).sum(-1)
    np.testing.assert_allclose(floored, kept, rtol=1e-12)
    assert np.abs(full - floored).max() < 1e-5  # what sits below e^-16 weighs nothing


def llama_percentile(values: list[float], fraction: float) -> float:
    """perplexity.cpp's lambda (its fractions are float32)."""
    fraction = float(np.float32(fraction))
    p = fraction * (len(values) - 1)
    ip = int(p)
    p -= ip
    return (1 - p) * values[ip] + p * values[min(ip + 1, len(values) - 1)]


def test_summary_is_llama_cpp_statistics():
    ref, test, tokens = logp_pair(n=101, noise=0.8, seed=1)
    s = kld.compare_positions(ref, test, tokens)
    out = kld.summarize(s)
    k = sorted(s.kld.tolist())
    n = len(k)
    mean = sum(k) / n
    unc = math.sqrt((sum(x * x for x in k) / n - mean * mean) / (n - 1))
    assert out.kld.value == pytest.approx(mean) and out.kld.unc == pytest.approx(unc)
    assert out.kld_percentiles["max"] == k[-1] and out.kld_percentiles["min"] == k[0]
    assert out.kld_percentiles["median"] == k[n // 2]
    for pct in kld.KLD_PERCENTILES:
        assert out.kld_percentiles[f"{pct:g}"] == pytest.approx(llama_percentile(k, pct / 100),
                                                                rel=1e-5)
    assert list(out.kld_percentiles)[:3] == ["max", "99.9", "99"]
    top = float(np.mean(s.same_top))
    assert out.same_top.value == top and 0 < top < 1
    assert out.same_top.unc == pytest.approx(math.sqrt(top * (1 - top) / (n - 1)))
    mse = float(np.mean(s.delta_p ** 2))
    assert out.rms_delta_p.value == pytest.approx(math.sqrt(mse))
    assert out.ppl.value == pytest.approx(math.exp(np.mean(s.nll)))
    assert out.ln_ppl_ratio.value == pytest.approx(np.mean(s.nll) - np.mean(s.nll_ref))
    assert -1 <= out.cor_ln_ppl <= 1


def test_shape_errors_are_clear():
    ref, test, tokens = logp_pair()
    with pytest.raises(ValueError, match="equal"):
        kld.kld_per_position(ref, test[:, :-1])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        kld.compare_positions(ref, test, tokens + V)
    with pytest.raises(ValueError, match="at least 2"):
        kld.summarize(kld.compare_positions(ref[:1], test[:1], tokens[:1]))


# ---- the 16-bit rows and the files ------------------------------------------------------


def llama_encode_row(logits: np.ndarray) -> np.ndarray:
    """perplexity.cpp's log_softmax(n_vocab, logits, log_prob, tok), element by element."""
    f = np.float32
    mx, mn = f(logits.max()), f(logits.min())
    mn = max(mn, f(mx - f(16)))
    lse = f(math.log(float(np.exp((logits - mx).astype(np.float32)).astype(np.float64).sum())))
    scale = f((mx - mn) / f(65535))
    out = np.zeros(2 * ((logits.size + 1) // 2) + 4, dtype=np.uint16)
    out[:4] = np.array([scale, f(mn - mx - lse)], dtype=np.float32).view(np.uint16)
    inv = f(1) / scale
    for i, x in enumerate(logits):
        out[4 + i] = int(np.rint(inv * (x - mn))) if x > mn else 0
    return out


def test_rows_encode_as_llama_cpp():
    rng = np.random.default_rng(2)
    logits = (rng.normal(size=(3, V)) * 5).astype(np.float32)
    mine = encode_rows(kld.log_softmax(logits))
    for row, want in zip(mine, (llama_encode_row(x) for x in logits), strict=True):
        head, want_head = row[:4].view(np.float32), want[:4].view(np.float32)
        np.testing.assert_allclose(head, want_head, rtol=1e-5)
        assert np.abs(row[4:].astype(int) - want[4:].astype(int)).max() <= 1  # rounding ties
    back = decode_rows(mine, V)
    x = kld.log_softmax(logits)
    kept = x > x.max(1, keepdims=True) - 16
    step = mine[:, :4].view(np.float32)[:, 0][:, None]
    assert np.all(np.abs(back - x)[kept] <= (0.5 * step + 1e-6).repeat(V, 1)[kept])


def write(path, n_ctx=8, n_chunk=2, seed=0, **header):
    h = LogProbHeader(header.pop("model", "m.gguf"), V, n_ctx, n_chunk, **header)
    rng = np.random.default_rng(seed)
    rows = kld.log_softmax(rng.normal(size=(n_chunk * h.rows_per_chunk, V)) * 3)
    tokens = rng.integers(0, V, size=n_chunk * n_ctx)
    with LogProbWriter(path, h, tokens) as w:
        w.write_rows(rows[:2])
        w.write_rows(rows[2:])
    return rows, tokens


def test_file_round_trip_and_kld_against_itself(tmp_path):
    rows, tokens = write(tmp_path / "a.bin", vocab_sha256="abc", text="t.txt")
    f = LogProbFile(tmp_path / "a.bin")
    assert f.header == LogProbHeader("m.gguf", V, 8, 2, "abc", "t.txt")
    assert np.array_equal(f.tokens, tokens)
    r = f.header.rows_per_chunk
    got = np.concatenate([f.chunk_logp(0), f.chunk_logp(1)])
    assert np.abs(got - rows)[rows > -16].max() < 2e-4
    s = kld.compare_positions(got, got, tokens[:r * 2], floor=FLOOR)
    assert np.all(s.kld == 0) and s.same_top.all()
    f.check_matches(n_vocab=V, vocab_sha256="abc", n_ctx=8, tokens=tokens)


def test_mismatched_files_are_clear_errors(tmp_path):
    path = tmp_path / "a.bin"
    _, tokens = write(path, vocab_sha256="abc")
    f = LogProbFile(path)
    with pytest.raises(LogitsFileError, match="vocabulary of 257 tokens"):
        f.check_matches(n_vocab=V + 1)
    with pytest.raises(LogitsFileError, match="another tokenizer"):
        f.check_matches(n_vocab=V, vocab_sha256="def")
    with pytest.raises(LogitsFileError, match="-c 8, this run asks for -c 16"):
        f.check_matches(n_vocab=V, n_ctx=16)
    other = tokens.copy()
    other[5] += 1
    with pytest.raises(LogitsFileError, match="from token 5 on"):
        f.check_matches(n_vocab=V, tokens=other)
    with pytest.raises(LogitsFileError, match="from token 10 on"):
        f.check_matches(n_vocab=V, tokens=tokens[:10])  # a shorter text

    data = path.read_bytes()
    (tmp_path / "short.bin").write_bytes(data[:-2])
    with pytest.raises(LogitsFileError, match="truncated"):
        LogProbFile(tmp_path / "short.bin")
    (tmp_path / "junk.bin").write_bytes(b"GGUF" + data[4:])
    with pytest.raises(LogitsFileError, match="not a log-prob file"):
        LogProbFile(tmp_path / "junk.bin")
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(LogitsFileError, match="cannot read"):
        LogProbFile(tmp_path / "empty.bin")
    with pytest.raises(LogitsFileError, match="cannot read"):
        LogProbFile(tmp_path / "missing.bin")


def test_unfinished_file_is_removed(tmp_path):
    h = LogProbHeader("m", V, 8, 2)
    path = tmp_path / "a.bin"
    with pytest.raises(LogitsFileError, match="rows written"):
        with LogProbWriter(path, h, np.zeros(16, dtype=np.int32)) as w:
            w.write_rows(np.zeros((3, V)))
    assert not path.exists()


def test_reads_llama_perplexity_files(tmp_path):
    """Its layout: "_logits_", u32 n_ctx, i32 n_vocab, i32 n_chunk, tokens, rows."""
    n_ctx, n_chunk = 8, 2
    rng = np.random.default_rng(4)
    logits = (rng.normal(size=(n_chunk * 3, V)) * 3).astype(np.float32)
    tokens = rng.integers(0, V, size=n_chunk * n_ctx).astype(np.int32)
    blob = LLAMA_MAGIC + struct.pack("<Iii", n_ctx, V, n_chunk) + tokens.tobytes()
    blob += b"".join(llama_encode_row(x).tobytes() for x in logits)
    (tmp_path / "l.bin").write_bytes(blob)
    f = LogProbFile(tmp_path / "l.bin")
    assert (f.header.n_ctx, f.header.n_vocab, f.header.engine) == (8, V, "llama.cpp")
    got = np.concatenate([f.chunk_logp(0), f.chunk_logp(1)])
    want = kld.log_softmax(logits)
    assert np.abs(got - want)[want > -16].max() < 2e-4
    f.check_matches(n_vocab=V, vocab_sha256="anything", tokens=tokens)  # no fingerprint to check


# ---- quant-check --kld ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    from testdata import llama_cpp_path

    from deimos.synth import write_model

    d = tmp_path_factory.mktemp("qkld")
    donor = llama_cpp_path("models/ggml-vocab-llama-spm.gguf")
    a = write_model(d / "a.gguf", "llama", "llama-tiny", "Q8_0", donor, seed=1)
    b = write_model(d / "b.gguf", "llama", "llama-tiny", "Q4_K_M", donor, seed=2)
    return a, b


def test_quant_kld_equals_direct_computation(tiny_pair):
    """quant_kld of two models equals torch's kl_div over every window's second half."""
    from testdata import data_file

    from deimos.eval.cli import load, quant_kld, tokenize
    from deimos.eval.perplexity import plan_windows, window_input, window_targets
    from deimos.runtime.kv_cache import KVCache

    a, b = tiny_pair
    text = str(data_file("texts/alice29.txt"))
    s = quant_kld(str(b), str(a), text, n_ctx=12, n_chunks=2)
    ref, q = load(str(a), "cpu"), load(str(b), "cpu")
    _, ids = tokenize(ref, text)
    w = plan_windows(ids.shape[0], 12, 2)
    want, top = [], []
    for i in range(2):
        x = torch.from_numpy(window_input(ids, w, i, ref.bos_id))
        lp, lq = (torch.log_softmax(KVCache(m.model.config, 12).forward(
            m.model, x, torch.arange(12)).double(), -1)[6:11] for m in (ref, q))
        want += torch.nn.functional.kl_div(lq, lp, reduction="none", log_target=True).sum(-1)
        top += (lp.argmax(-1) == lq.argmax(-1)).tolist()
        assert window_targets(ids, w, i).shape == (5,)
    assert s.n == 10
    assert s.kld.value == pytest.approx(float(np.mean(want)), rel=1e-4)
    assert s.same_top.value == pytest.approx(np.mean(top))
    same = quant_kld(str(a), str(a), text, n_ctx=12, n_chunks=2)
    assert same.kld.value == 0 and same.same_top.value == 1.0


def test_quant_check_kld_command(tiny_pair, capsys):
    from testdata import data_file

    from deimos import cli

    a, b = tiny_pair
    rc = cli.main(["quant-check", str(b), str(a), "--kld", str(data_file("texts/alice29.txt")),
                   "--kld-ctx", "12", "--kld-chunks", "2"])
    out = capsys.readouterr().out
    assert rc in (0, 1)  # 1: the random Q4_K_M "quantization" of another model is flagged
    assert "KL-divergence of b.gguf from a.gguf" in out and "Mean    KLD:" in out
    assert "Same top p:" in out
