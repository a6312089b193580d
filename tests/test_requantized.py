"""Real models re-quantized to other formats, against llama.cpp on the very same bytes.

tools/requantize.py rebuilds each variant of SmolLM2 with ggml's own quantizer (the fetched
libggml-base.so); its sha256 must equal the one recorded when llama.cpp ran it
(tools/make_requant_reference.py), so the references below are about these bytes. Oracles:
- llama.cpp on the variant's F32 twin (ggml's dequantization, no activation quantization):
  Deimos' logits from the quantized file to float32 noise;
- llama.cpp on the variant itself: greedy text identical, or every divergence explained as in
  test_model_vs_llama_cpp (llama.cpp's top two within 0.1, or its F32 twin picks our token).
Most SmolLM2 rows (576) are not a multiple of 256, so a k-/i-quant/ternary target holds the
32-block fallback llama-quantize picks for them and its own type on ffn_down (1536).
"""

from __future__ import annotations

from collections import Counter

import pytest
from requant_support import SMOLLM2, variant
from test_model_vs_llama_cpp import first_divergence, forced_logits, top_errors
from testdata import reference

from deimos.gguf import GGUFFile
from deimos.models import load_model

TYPES = ("Q8_0", "Q6_K", "Q4_K", "IQ4_XS", "TQ2_0", "TQ1_0")


def _sha256(path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@pytest.fixture(scope="module", params=TYPES)
def run(request):
    """(reference, file, {case id: (twin logits, variant logits)}) for one variant."""
    ref = reference(f"requant-{SMOLLM2.split('.')[0]}-{request.param}.json")
    path = variant(SMOLLM2, request.param)
    got = _sha256(path)
    if got != ref["variant"]["sha256"]:
        pytest.fail(f"tools/requantize.py built {path.name} with sha256 {got}, but llama.cpp ran "
                    f"{ref['variant']['sha256']}: the quantizer or the writer changed")
    model = load_model(GGUFFile(path))
    logits = {}
    twin = {c["id"]: c for c in ref["f32_twin"]["cases"]}
    for case in ref["cases"]:
        t = twin[case["id"]]
        n = len(t["prompt_tokens"])
        lt = forced_logits(model, t["prompt_tokens"] + t["tokens"], n)
        # the same sequence (the common case) needs one forward pass
        lq = lt if case["tokens"] == t["tokens"] else forced_logits(
            model, case["prompt_tokens"] + case["tokens"], len(case["prompt_tokens"]))
        logits[case["id"]] = (lt, lq)
    return ref, path, logits


def test_requantized_tensor_types_are_recorded(run):
    ref, path, _ = run
    with GGUFFile(path) as f:
        got = Counter(i.ggml_type.name for i in f.tensors.values())
    assert dict(got) == ref["variant"]["tensor_types"]


def test_requantized_equal_llama_cpp_on_their_f32_twin(run):
    ref, path, logits = run
    worst = 0.0
    for case in ref["f32_twin"]["cases"]:
        lt, _ = logits[case["id"]]
        worst = max(worst, float(top_errors(lt, case["top"]).max()))
        at = first_divergence(lt, case)
        if at is not None:
            (_, a), (_, b) = case["top"][at][:2]
            assert a - b < 0.01, f"{case['id']}: token {at} differs, llama.cpp's top two {a} vs {b}"
    print(f"{path.name}: F32 twin, max |logit error| on llama.cpp's top-8 = {worst:.2e}")
    assert worst < 2e-3  # SmolLM2's own F32 twin: 4e-5


def test_requantized_greedy_vs_llama_cpp(run, capsys):
    ref, path, logits = run
    twin = {c["id"]: c["tokens"] for c in ref["f32_twin"]["cases"]}
    rows = []
    for case in ref["cases"]:
        _, lq = logits[case["id"]]
        at = first_divergence(lq, case)
        if at is None:
            rows.append((case["id"], None, None, None))
            continue
        (_, a), (_, b) = case["top"][at][:2]
        ours = int(lq[at].argmax())
        t = twin[case["id"]]
        explained = t[:at] == case["tokens"][:at] and len(t) > at and t[at] == ours
        rows.append((case["id"], at, a - b, explained))
    with capsys.disabled():
        print(f"\n{path.name}: greedy vs llama.cpp on the requantized file")
        for cid, at, gap, explained in rows:
            if at is None:
                print(f"  {cid:10s} identical")
            else:
                why = "llama.cpp's F32 twin picks our token" if explained else "unexplained"
                print(f"  {cid:10s} differs at token {at}: "
                      f"llama.cpp's top two {gap:.3f} apart; {why}")
    bad = [r for r in rows if r[1] is not None and not (r[2] < 0.1 or r[3])]
    assert not bad, bad
