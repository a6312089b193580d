"""Real models re-quantized to other formats, against llama.cpp on the very same bytes.

tools/requantize.py rebuilds each variant (SmolLM2, gemma3) with ggml's own quantizer (the
fetched libggml-base.so); its sha256 must equal the one recorded when llama.cpp ran it
(tools/make_requant_reference.py), so the references below are about these bytes. Oracles:
- llama-quantize's own per-tensor types (``--dry-run`` on the source model): requantize takes
  them from deimos.synth.mix, which must agree on real models too;
- llama.cpp on the variant's F32 twin (ggml's dequantization, no activation quantization):
  Deimos' logits from the quantized file to float32 noise (gemma with ggml's f16 GELU table
  emulated, as in test_model_vs_llama_cpp);
- llama.cpp on the variant itself: greedy text identical, or every divergence explained as in
  test_model_vs_llama_cpp (llama.cpp's top two within 0.1, or its F32 twin picks our token).
Most SmolLM2 rows (576) and all gemma3 rows but ffn_down's (640) are not a multiple of 256, so
a k-/i-quant/ternary target holds the 32-block fallback llama-quantize picks for them.
Gemma's forward passes are slow (262k-token vocabulary): its references have 4 prompts of 24
tokens, and each case costs one pass when the variant's greedy tokens equal its twin's.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import pytest
import torch
from requant_support import GEMMA3, SMOLLM2, variant
from test_model_vs_llama_cpp import forced_logits, ggml_cpu_geglu, top_errors
from testdata import reference

from deimos.gguf import GGUFFile
from deimos.models import load_model

# (model, requantize TYPE with "-pure" for --pure); the references say why each is there
VARIANTS = [(SMOLLM2, t) for t in ("Q8_0", "Q6_K", "Q4_K", "IQ4_XS-pure", "TQ2_0", "TQ1_0",
                                   "Q4_K_M")]
VARIANTS += [(GEMMA3, t) for t in ("Q8_0", "Q6_K", "Q4_K_M")]
# max |logit error| vs llama.cpp on the F32 twin, measured: SmolLM2 2-3e-5 (TQ1_0/TQ2_0 1.2e-3),
# gemma3 4.7-5.7e-3 (its own twin: 1.1e-2 on more and longer prompts; ~4e-4 of its logits:
# four norms a layer and the sqrt(n_embd) scale amplify float32 noise)
TWIN_TOLERANCE = {SMOLLM2: 2e-3, GEMMA3: 1.5e-2}


def _sha256(path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class Case(NamedTuple):
    """What the tests read of Deimos' logits on one reference case (full gemma logits would
    be 1 MB a token)."""

    twin_errors: torch.Tensor  # top_errors on the twin's top-8, [steps, 8]
    twin_argmax: list[int]  # our argmax following the twin's tokens
    quant_argmax: list[int]  # our argmax following the variant's tokens


def _id(v: tuple[str, str]) -> str:
    return f"{'smollm2' if v[0] == SMOLLM2 else 'gemma3'}-{v[1]}"


@pytest.fixture(scope="module", params=VARIANTS, ids=_id)
def run(request):
    """(model, reference, file, {case id: Case}) for one variant."""
    model_name, vid = request.param
    ref = reference(f"requant-{model_name.split('.')[0]}-{vid}.json")
    path = variant(model_name, vid)
    got = _sha256(path)
    if got != ref["variant"]["sha256"]:
        pytest.fail(f"tools/requantize.py built {path.name} with sha256 {got}, but llama.cpp ran "
                    f"{ref['variant']['sha256']}: the quantizer, the types or the writer changed")
    model = load_model(GGUFFile(path))
    twin = {c["id"]: c for c in ref["f32_twin"]["cases"]}
    cases = {}
    with pytest.MonkeyPatch.context() as mp:
        if model.config.activation == "gelu_tanh":
            mp.setattr("deimos.models.ops.gated_act", ggml_cpu_geglu)
        for case in ref["cases"]:
            t = twin[case["id"]]
            lt = forced_logits(model, t["prompt_tokens"] + t["tokens"], len(t["prompt_tokens"]))
            # the same sequence (the common case) needs one forward pass
            lq = lt if case["tokens"] == t["tokens"] else forced_logits(
                model, case["prompt_tokens"] + case["tokens"], len(case["prompt_tokens"]))
            cases[case["id"]] = Case(top_errors(lt, t["top"]), lt.argmax(-1).tolist(),
                                     lq.argmax(-1).tolist())
    return model_name, ref, path, cases


def _first_divergence(argmax: list[int], case: dict) -> int | None:
    # test_model_vs_llama_cpp.first_divergence on the argmax instead of the logits
    return next((i for i, t in enumerate(case["tokens"]) if argmax[i] != t), None)


def test_requantized_types_are_llama_quantize_types(run):
    _, ref, path, _ = run
    with GGUFFile(path) as f:
        got = {name: i.ggml_type.name for name, i in f.tensors.items()}
    want = ref["llama_quantize"]["types"]
    wrong = {n: (got.get(n), t) for n, t in want.items() if got.get(n) != t}
    assert not wrong, f"(requantize, {ref['llama_quantize']['command']}): {wrong}"
    assert set(got) == set(want)
    assert dict(Counter(got.values())) == ref["variant"]["tensor_types"]


def test_requantized_equal_llama_cpp_on_their_f32_twin(run):
    model_name, ref, path, cases = run
    worst = 0.0
    for case in ref["f32_twin"]["cases"]:
        c = cases[case["id"]]
        worst = max(worst, float(c.twin_errors.max()))
        at = _first_divergence(c.twin_argmax, case)
        if at is not None:
            (_, a), (_, b) = case["top"][at][:2]
            assert a - b < 0.01, f"{case['id']}: token {at} differs, llama.cpp's top two {a} vs {b}"
    print(f"{path.name}: F32 twin, max |logit error| on llama.cpp's top-8 = {worst:.2e}")
    assert worst < TWIN_TOLERANCE[model_name]


def test_requantized_greedy_vs_llama_cpp(run, capsys):
    _, ref, path, cases = run
    twin = {c["id"]: c["tokens"] for c in ref["f32_twin"]["cases"]}
    rows = []
    for case in ref["cases"]:
        ours = cases[case["id"]].quant_argmax
        at = _first_divergence(ours, case)
        if at is None:
            rows.append((case["id"], None, None, None))
            continue
        (_, a), (_, b) = case["top"][at][:2]
        t = twin[case["id"]]
        explained = t[:at] == case["tokens"][:at] and len(t) > at and t[at] == ours[at]
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
