"""Speculative decoding with the model's MTP layers (deimos.engine.mtp_draft) on the CPU reference.

Oracles: the same model without speculation (greedy tokens equal, or different only at a
near-tie); for every proposal the engine asked for, the drafts computed from scratch the way
tests/test_mtp.py checks against llama.cpp's draft-mtp driver (the main model over the
sequence's computed tokens on a fresh cache, the MTP head's catch-up on all of them with the
hidden rows shifted by one, then greedy draft steps): the drafter's incremental state (its
catch-up across steps, rejected drafts, restored recurrent states, a prefix served from the
cache) must give the same tokens.
"""

from __future__ import annotations

import pytest
import torch
from hybrid_support import rebuild
from test_speculate import GREEDY, REPEATING, _all_free, _plain, _same_or_tie, _spec_engine

from deimos.engine import LLM
from deimos.engine.request import Request
from deimos.engine.speculate import SpecConfig
from deimos.models.deltanet import HybridKV, RecurrentState
from deimos.runtime.kv_cache import KVCache

PRESETS = ("qwen35-tiny-mtp", "qwen3next-tiny-mtp")

pytestmark = pytest.mark.usefixtures("module_one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("mtp-draft")
    return {p: rebuild(p, tmp) for p in PRESETS}


@pytest.fixture(scope="module")
def gpu_paths(tmp_path_factory) -> dict:
    """The same models in Q8_0: the GPU path holds routed experts only in quantized layouts
    (qwen3next's are MoE; the reference files are F32)."""
    tmp = tmp_path_factory.mktemp("mtp-draft-q8")
    return {p: rebuild(p, tmp, "Q8_0") for p in PRESETS}


def _from_scratch(model, tokens: list[int], k: int) -> list[int]:
    """k greedy MTP drafts after ``tokens`` (its last one not yet run by the main model)."""
    n = len(tokens) - 1
    h = _main_hidden(model, tokens[:-1])
    with torch.inference_mode():
        state = model.mtp.new_state(n + k + 1)
        model.mtp.forward(state, torch.tensor(tokens[:-1]), torch.cat((torch.zeros_like(h[:1]), h[:-1])))
        tok, hid, out = tokens[-1], h[-1], []
        for _ in range(k):
            d = model.mtp.draft(hid, tok, state)
            tok, hid = int(d.logits.argmax()), d.hidden
            out.append(tok)
    return out


def _main_hidden(model, tokens: list[int]) -> torch.Tensor:
    """The main model's post-norm hidden rows [n, D] of ``tokens`` on a fresh cache."""
    n = len(tokens)
    kv, st = KVCache(model.config, n), RecurrentState.zeros(model.config)
    b = kv.batch(torch.tensor(tokens), torch.tensor([n - 1]))
    b.kv = HybridKV(b.kv, [st])
    with torch.inference_mode():
        return model.step(b, hidden_at=torch.arange(n))[1]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS difference of a from b (any devices)."""
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


def _recording(engine) -> list[tuple[list[int], int, list[int]]]:
    """Every proposal the drafter makes: (the sequence's tokens, k, the drafts)."""
    got = []
    propose = engine.drafter.propose

    def wrapped(seq, k):  # instrumentation: the real drafter runs
        drafts = propose(seq, k)
        got.append((list(seq.tokens), k, list(drafts)))
        return drafts

    engine.drafter.propose = wrapped
    return got


def _run(engine, reqs) -> None:
    for r in reqs:
        engine.add(r)
    while engine.has_work:
        for out in engine.step():
            assert out.error is None, out.error


@pytest.mark.parametrize("preset", PRESETS)
def test_mtp_drafts_are_the_heads_and_change_nothing(paths, preset):
    """Two prompts decoded together with MTP drafts, then the first prompt again (its prefix
    from the cache: the drafter computes that prefix's hidden rows itself): greedy tokens equal
    a plain run's; every proposal equals the from-scratch drafts; drafts were verified and
    rejected (the recurrent state restored: the random weights' head guesses wrong); every
    block is free at the end."""
    llm = LLM(paths[preset], n_ctx=256, max_seqs=4)
    engine = _spec_engine(llm, n_ctx=256, spec=SpecConfig("mtp", k_max=4))
    assert engine.runner.want_hidden
    got = _recording(engine)
    prompts = [llm.encode_raw(t) for t in REPEATING]
    plains = [_plain(llm, p, 32) for p in prompts]
    reqs = [Request(list(p), 32, GREEDY, top_logprobs=2) for p in prompts]
    _run(engine, reqs)
    n_first = len(got)
    again = Request(list(prompts[0]), 32, GREEDY, top_logprobs=2)
    _run(engine, [again])
    assert len(got) > n_first  # it drafted on the cached prefix's hidden rows
    assert again.cached_tokens > 0  # the prefix came from the cache
    for plain, req in zip(plains + plains[:1], reqs + [again]):
        _same_or_tie(plain, req, preset)
    st = engine.stats()
    print(f"{preset}: {len(got)} proposals, {st.spec_accepted} of {st.spec_drafted} drafts "
          f"accepted in {st.spec_verify_steps} verify steps")
    # random weights: the head's guesses are mostly wrong (its drafts are checked below)
    assert st.spec_drafted > st.spec_accepted and st.spec_verify_steps > 0
    assert len(got) >= 10
    for tokens, k, drafts in got:
        assert len(drafts) == k
        assert drafts == _from_scratch(llm.model, tokens, k), f"{preset}: at {len(tokens)} tokens"
    _all_free(engine)


@pytest.mark.parametrize("preset", PRESETS)
def test_mtp_drafts_survive_preemption(paths, preset):
    """Four sequences with MTP drafts in a pool too small for all of them: the newest are
    preempted between verifications (blocks, recurrent state and the drafter's catch-up state
    dropped) and recomputed. Every proposal still equals the from-scratch drafts, greedy tokens
    equal a plain run's, and every block is free at the end."""
    llm = LLM(paths[preset], n_ctx=128, max_seqs=4)
    prompts = [llm.encode_raw(t)[:40] for t in (*REPEATING, *REPEATING)]
    prompts[2], prompts[3] = prompts[2][3:], prompts[3][2:]  # four distinct prompts
    plains = [_plain(llm, p, 32) for p in prompts]
    # the four want ~4 x 72 / 16 ~ 20 blocks at their ends: 10 preempt the newest
    engine = _spec_engine(llm, n_ctx=128, spec=SpecConfig("mtp", k_max=4), kv_tokens=10 * 16,
                          prefix_cache=False)
    got = _recording(engine)
    reqs = [Request(list(p), 32, GREEDY, top_logprobs=2) for p in prompts]
    _run(engine, reqs)
    for plain, req in zip(plains, reqs):
        _same_or_tie(plain, req, preset)
    st = engine.stats()
    print(f"{preset}: {st.preemptions} preemptions, {len(got)} proposals, {st.spec_accepted} of "
          f"{st.spec_drafted} drafts accepted in {st.spec_verify_steps} verify steps")
    assert st.preemptions > 0 and st.spec_verify_steps > 0 and len(got) >= 10
    for tokens, k, drafts in got:
        assert drafts == _from_scratch(llm.model, tokens, k), f"{preset}: at {len(tokens)} tokens"
    _all_free(engine)


def test_mtp_needs_the_layers(paths):
    """A file without MTP layers: a named error, before any memory is taken."""
    from testdata import llama_cpp_path

    from deimos.synth import write_model

    path = paths[PRESETS[0]].parent / "qwen35-tiny-F32.gguf"
    write_model(path, "qwen35", "qwen35-tiny", "F32", llama_cpp_path("models/ggml-vocab-llama-spm.gguf"), seed=2)
    with pytest.raises(ValueError, match="speculative method mtp needs MTP .nextn. layers"):
        LLM(path, n_ctx=64, speculative="mtp")


@pytest.mark.gpu
@pytest.mark.parametrize("preset", PRESETS)
def test_gpu_mtp_head_matches_the_reference_and_drafting_changes_nothing(gpu_paths, preset):
    """The kernel path builds the MTP layers on first use (``load_mtp``) and runs them eagerly:
    the same rows (the CPU reference's tokens and post-norm hidden rows) give the CPU head's
    logits within 1e-2 relative RMS (float16 state and activations), a catch-up and two draft
    steps alike. Then MTP speculation on the GPU: greedy tokens equal a plain GPU run's (or
    differ at a near-tie), drafts verified, every block free at the end."""
    from deimos.gguf import GGUFFile
    from deimos.models import load_model

    cpu = load_model(GGUFFile(gpu_paths[preset]))
    gpu = load_model(GGUFFile(gpu_paths[preset]), device="cuda")
    assert cpu.mtp is not None and gpu.mtp is None  # not built until asked
    head = gpu.load_mtp()
    assert head is gpu.load_mtp() and gpu.mtp is head
    tokens = LLM(gpu_paths[preset], n_ctx=64).encode_raw(REPEATING[0])[:24]
    n = len(tokens) - 1
    h = _main_hidden(cpu, tokens[:-1])
    rows = torch.cat((torch.zeros_like(h[:1]), h[:-1]))
    rel = _rel
    states = [cpu.mtp.new_state(n + 4), head.new_state(n + 4)]
    assert states[1].k[0].dtype == torch.float16 and states[1].k[0].is_cuda
    with torch.inference_mode():
        outs = [m.forward(s, torch.tensor(tokens[:-1], device=m.device), rows.to(m.device),
                          logits_at=torch.arange(n, device=m.device))
                for m, s in zip((cpu.mtp, head), states)]
        assert rel(outs[1].logits, outs[0].logits) < 1e-2
        assert rel(outs[1].hidden, outs[0].hidden) < 1e-2
        tok, hid = [tokens[-1]] * 2, [h[-1], h[-1].cuda()]
        for _ in range(2):
            d = [m.draft(x, t, s) for m, x, t, s in zip((cpu.mtp, head), hid, tok, states)]
            assert rel(d[1].logits, d[0].logits) < 1e-2
            tok = [int(d[0].logits.argmax())] * 2  # the reference's draft into both
            hid = [d[0].hidden, d[0].hidden.cuda()]
    assert states[1].length == n + 2

    plain_llm = LLM(gpu_paths[preset], n_ctx=256, max_seqs=4, device="cuda")
    spec_llm = LLM(gpu_paths[preset], n_ctx=256, max_seqs=4, device="cuda", speculative="mtp", spec_k=4)
    assert spec_llm.engine.runner.want_hidden
    prompts = [spec_llm.encode_raw(t) for t in REPEATING]
    plains = [_plain(plain_llm, p, 32) for p in prompts]
    reqs = [Request(list(p), 32, GREEDY, top_logprobs=2) for p in prompts]
    spec_llm.run_many(reqs)
    for plain, req in zip(plains, reqs):
        _same_or_tie(plain, req, preset, tie=0.05)  # float16: verify rows vs one-row decode kernels
    s = spec_llm.engine.stats()
    print(f"{preset} on the GPU: {s.spec_accepted} of {s.spec_drafted} drafts accepted in "
          f"{s.spec_verify_steps} verify steps")
    assert s.spec_drafted > 0 and s.spec_verify_steps > 0
    _all_free(spec_llm.engine)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test above runs it on CUDA")
def test_the_kernel_path_builds_its_mtp_head_on_first_use(paths):
    """The kernel path (its linears, ops and attention kernels; Triton's interpreter here, so a
    few rows only) leaves the MTP layers out until ``load_mtp`` builds them; then a catch-up and
    a draft step give the CPU reference head's logits within 1e-2 relative RMS and its draft."""
    from kernel_device import DEVICE, INTERPRETED  # noqa: F401  (TRITON_INTERPRET set first)

    from deimos.gguf import GGUFFile
    from deimos.models import ARCHITECTURES, load_model
    from deimos.models.weights import WeightSource

    f = GGUFFile(paths[PRESETS[0]])
    cpu = load_model(f)
    ker = ARCHITECTURES[cpu.config.arch](cpu.config, WeightSource(f, DEVICE, kernels=True))
    assert ker.mtp is None
    head = ker.load_mtp()
    assert ker.load_mtp() is head and head.blocks[0].block.mixer.layer == 0
    tokens = [5, 12, 19, 26, 33, 40]
    n = len(tokens) - 1
    h = _main_hidden(cpu, tokens[:-1])
    rows = torch.cat((torch.zeros_like(h[:1]), h[:-1]))
    with torch.inference_mode():
        states = [cpu.mtp.new_state(n + 2), head.new_state(n + 2)]
        outs = [m.forward(s, torch.tensor(tokens[:-1]), rows, logits_at=torch.arange(n))
                for m, s in zip((cpu.mtp, head), states)]
        drafts = [m.draft(h[-1], tokens[-1], s) for m, s in zip((cpu.mtp, head), states)]

    assert _rel(outs[1].logits, outs[0].logits) < 1e-2
    assert _rel(drafts[1].logits, drafts[0].logits) < 1e-2
    assert int(drafts[1].logits.argmax()) == int(drafts[0].logits.argmax())
    assert [s.length for s in states] == [n + 1, n + 1]
