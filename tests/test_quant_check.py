"""``deimos quant-check`` on real files.

Oracles: ggml's own quantizer (libggml-base.so, through tools/requantize.py) for the expected
error of each format; SmolLM2 re-quantized by it, against the F32 decoding of the original
file, for plausible numbers and no flags; a decoder broken on purpose (the bytes it sees are
corrupted the way a real decoder bug would read them) for the flags.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from requant_support import SMOLLM2, quantizer, variant, write_tensors
from testdata import model_path

from deimos.cli import main
from deimos.gguf import GGUFFile
from deimos.gguf.constants import GGMLType
from deimos.quant import dequantize, get_format
from deimos.quant.check import (
    EXPECTED_REL_RMS,
    FACTOR,
    QuantCheckError,
    check_files,
    render_check,
    thresholds,
)

# ggml_quantize_init builds these types' grid tables in 10-30 s on a 2-core runner; their
# entries were measured the same way once and are not re-measured here.
NOT_REMEASURED = {GGMLType.IQ1_S, GGMLType.IQ1_M, GGMLType.IQ2_S, GGMLType.IQ2_XS}


def test_expected_errors_are_ggmls_on_gaussian_data():
    q = quantizer()
    x = np.random.default_rng(0).standard_normal((64, 4096)).astype(np.float32)
    for t, expected in EXPECTED_REL_RMS.items():
        if t in NOT_REMEASURED:
            continue
        data = x
        t0 = time.perf_counter()
        if t == GGMLType.F32:
            blocks = data.view(np.uint8).reshape(-1)
        else:
            # a uniform importance matrix for the types that refuse to quantize without one
            needs = q.lib.ggml_quantize_requires_imatrix(int(t))
            blocks = q.quantize(data, t, np.ones(4096, np.float32) if needs else None)
        y = dequantize(blocks, t, data.shape).astype(np.float64)
        rel = np.linalg.norm(y - data) / np.linalg.norm(data.astype(np.float64))
        took = time.perf_counter() - t0
        print(f"{t.name:8s} measured {rel:.4g} table {expected:.3g} ({took:.1f}s)")
        assert rel == pytest.approx(expected, rel=0.005, abs=1e-9), t.name  # table: 3 digits


@pytest.fixture(scope="module")
def original():
    with GGUFFile(model_path(SMOLLM2)) as f:
        yield f


@pytest.fixture(scope="module")
def f32_original(original, tmp_path_factory):
    """Every tensor of the original Q4_1 file decoded to F32 (the higher-precision copy)."""
    path = tmp_path_factory.mktemp("f32") / "smollm2-f32.gguf"
    return write_tensors(original, list(original.tensors), path, f32=True)


@pytest.mark.parametrize("ggml_type", ["Q6_K", "Q4_K", "TQ2_0"])
def test_requantized_variants_pass_with_plausible_numbers(ggml_type, original, f32_original,
                                                          capsys):
    c = check_files(variant(SMOLLM2, ggml_type), f32_original)
    with capsys.disabled():
        from rich.console import Console

        Console(width=100).print(render_check(c))
    assert not c.problems
    assert len(c.tensors) == len(original.tensors)
    for t in c.tensors:
        source = original.tensors[t.name].ggml_type
        ratio = t.rel_rms / t.expected if t.expected else None
        if t.quant_type == source:
            # F32 copied; the Q8_0 embedding re-quantized to Q8_0 gives back its own grid
            assert t.rel_rms == 0.0, t
        elif t.quant_type == GGMLType.Q4_K:
            # Q4_K's 32-wide sub-blocks with 6-bit scale and min almost hold Q4_1's 4-bit grid
            assert 0.1 < ratio < 0.5, t
        else:
            # fresh quantization error: the Q4_1 weights come out as Gaussian data does
            assert 0.8 < ratio < 1.4, t


# ---- decoders broken on purpose --------------------------------------------------------------


def _swap_nibbles(b: np.ndarray) -> np.ndarray:
    return ((b << 4) | (b >> 4)).astype(np.uint8)


def _q5_0_swapped_nibbles(blocks: np.ndarray) -> np.ndarray:
    # block_q5_0: d (f16) | qh (4 bytes) | qs (16 bytes: low nibble = element j, high = j + 16)
    out = blocks.copy()
    out[:, 6:22] = _swap_nibbles(out[:, 6:22])
    return out


def _q4_k_no_min(blocks: np.ndarray) -> np.ndarray:
    # block_q4_K: d (f16) | dmin (f16) | scales (12) | qs (128); a decoder that forgets the min
    out = blocks.copy()
    out[:, 2:4] = 0
    return out


# TQ2_0 code c in {0, 1, 2} means c - 1; reading it as 1 - c flips every weight's sign
_NEG = np.array([sum(((2 - c if c < 3 else 3) << (2 * k)) for k in range(4)
                     for c in [(b >> (2 * k)) & 3]) for b in range(256)], dtype=np.uint8)


def _tq2_0_negated(blocks: np.ndarray) -> np.ndarray:
    # block_tq2_0: qs (64 bytes of four 2-bit codes) | d (f16)
    out = blocks.copy()
    out[:, :64] = _NEG[out[:, :64]]
    return out


def _break(monkeypatch, t: GGMLType, corrupt) -> None:
    cls = type(get_format(t))
    good = cls.decode_blocks
    monkeypatch.setattr(cls, "decode_blocks", lambda self, blocks: good(self, corrupt(blocks)))


@pytest.fixture(scope="module")
def small_pair(original, tmp_path_factory):
    """Layers 0-1 of the Q4_K and TQ2_0 variants (Q5_0, Q4_K / Q4_0, TQ2_0 and F32 tensors)
    and of the F32 original, as small files."""
    d = tmp_path_factory.mktemp("small")
    names = [n for n in original.tensors if n.startswith(("blk.0.", "blk.1."))]
    out = {"F32": write_tensors(original, names, d / "f32.gguf", f32=True)}
    for t in ("Q4_K", "TQ2_0"):
        with GGUFFile(variant(SMOLLM2, t)) as f:
            out[t] = write_tensors(f, names, d / f"{t}.gguf")
    return out


@pytest.mark.parametrize("variant_type,broken,corrupt", [
    ("Q4_K", GGMLType.Q5_0, _q5_0_swapped_nibbles),
    ("Q4_K", GGMLType.Q4_K, _q4_k_no_min),
    ("TQ2_0", GGMLType.TQ2_0, _tq2_0_negated),
], ids=["Q5_0-swapped-nibbles", "Q4_K-no-min", "TQ2_0-negated"])
def test_broken_decoder_is_flagged(small_pair, monkeypatch, variant_type, broken, corrupt):
    fine = check_files(small_pair[variant_type], small_pair["F32"])
    assert not fine.problems
    _break(monkeypatch, broken, corrupt)
    c = check_files(small_pair[variant_type], small_pair["F32"])
    hit = {t.name for t in c.tensors if t.quant_type == broken}
    assert hit and {t.name for t in c.flagged} == hit
    for t in c.flagged:
        print(f"{t.name}: {t.flag}")
    if broken == GGMLType.TQ2_0:
        # the error is only ~2.3x TQ2_0's (already ~0.8): the cosine is what catches it
        max_rel, min_cos = thresholds(broken)
        assert all(t.rel_rms < max_rel and t.cosine < 0 < min_cos for t in c.flagged)
        assert all("cosine" in t.flag for t in c.flagged)
    else:
        assert all(t.rel_rms > FACTOR * t.expected for t in c.flagged)
    summary = {s.ggml_type: s for s in c.by_type}
    assert summary[broken].n_flagged == len(hit)


# ---- mismatches and the command line ------------------------------------------------------------


@pytest.fixture(scope="module")
def mismatched(original, small_pair, tmp_path_factory):
    """(quant, reference, lower): layers 0-1 of the Q4_K variant; an F32 reference with one
    tensor missing, one extra and one of another shape; a reference holding blk.0.ffn_up in
    the original's Q4_1, of lower precision than the variant's Q5_0."""
    d = tmp_path_factory.mktemp("mismatch")
    names = [n for n in original.tensors if n.startswith(("blk.0.", "blk.1."))]
    ref_names = [n for n in names if n != "blk.1.attn_v.weight"] + ["output_norm.weight"]
    k = original.tensors["blk.0.attn_k.weight"]
    ref = write_tensors(original, ref_names, d / "ref.gguf", f32=True,
                        reshape={"blk.0.attn_k.weight": tuple(reversed(k.shape))})
    lower = write_tensors(original, ["blk.0.ffn_up.weight"], d / "lower.gguf")
    return small_pair["Q4_K"], ref, lower


def test_mismatches_are_reported(original, mismatched, tmp_path):
    quant, ref, lower = mismatched
    c = check_files(quant, ref)
    assert c.only_in_quant == ["blk.1.attn_v.weight"]
    assert c.only_in_ref == ["output_norm.weight"]
    k = original.tensors["blk.0.attn_k.weight"]
    assert c.shape_mismatches == [("blk.0.attn_k.weight", tuple(k.shape), tuple(reversed(k.shape)))]
    assert not c.flagged
    text = "\n".join(c.problems)
    assert "blk.1.attn_v.weight: only in the quantized file" in text
    assert "output_norm.weight: only in the reference" in text
    assert ("blk.0.attn_k.weight: shape (192, 576) in the quantized file, (576, 192) in the "
            "reference") in text
    # a Q4_1 reference for a Q5_0 tensor is not of higher precision
    low = check_files(quant, lower)
    assert low.lower_precision_ref == [("blk.0.ffn_up.weight", GGMLType.Q5_0, GGMLType.Q4_1)]
    assert "not of higher precision" in "\n".join(low.problems)


def test_nothing_in_common_is_an_error(mismatched, tmp_path):
    quant, _, _ = mismatched
    with GGUFFile(model_path(SMOLLM2)) as f:
        other = write_tensors(f, ["token_embd.weight"], tmp_path / "embd.gguf")
    with pytest.raises(QuantCheckError, match="no tensor of the same name and shape"):
        check_files(quant, other)


def test_cli_exit_status(small_pair, mismatched, monkeypatch, tmp_path, capsys):
    quant, ref, _ = mismatched
    assert main(["quant-check", str(small_pair["Q4_K"]), str(small_pair["F32"])]) == 0
    out = capsys.readouterr().out
    assert "no problems" in out and "Q5_0" in out and "Q4_K" in out
    assert main(["quant-check", str(quant), str(ref)]) == 1
    assert "only in the reference" in capsys.readouterr().out
    # unusable input: exit 2 and one line on stderr naming the problem
    not_gguf = tmp_path / "not.gguf"
    not_gguf.write_bytes(b"hello world, not a gguf file at all" * 4)
    assert main(["quant-check", str(not_gguf), str(ref)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("deimos: error:") and "not.gguf" in err and err.count("\n") == 1
    assert main(["quant-check", str(tmp_path / "missing.gguf"), str(ref)]) == 2
    assert "missing.gguf" in capsys.readouterr().err
    # a broken decoder: exit 1
    _break(monkeypatch, GGMLType.Q5_0, _q5_0_swapped_nibbles)
    assert main(["quant-check", str(small_pair["Q4_K"]), str(small_pair["F32"]), "--all"]) == 1
    out = capsys.readouterr().out
    assert "every tensor" in out and "flagged" in out
