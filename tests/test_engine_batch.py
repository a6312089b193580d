"""Many sequences at once through the engine (deimos.engine.Engine) on the CPU reference.

Oracles: each sequence decoded alone (greedy): tokens decoded together must equal it, and
where a reduction-order near-tie flips a token the test shows the single run's margin there
(under TIE logits); the block manager's invariants and a pool with every block free again
after the last request; hand-made schedules (a long prompt does not stop a decode; a small
pool preempts and still finishes everything)."""

from __future__ import annotations

import random

import pytest
from testdata import llama_cpp_path, model_path

from deimos.engine import LLM
from deimos.engine.request import Request
from deimos.kernels.sampling import SamplingParams
from deimos.synth import write_model

SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA = "gemma-3-270m-q4_k_m.gguf"
DONOR = "models/ggml-vocab-llama-spm.gguf"
TIE = 1e-3  # nats: a gap this small between the top two tokens may flip with summation order
GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("batch") / "llama-tiny-Q8_0.gguf"
    write_model(path, "llama", "llama-tiny", "Q8_0", llama_cpp_path(DONOR), seed=5)
    return path


def _req(ids, n, **kw) -> Request:
    return Request(list(ids), n, kw.pop("sampling", GREEDY), **kw)


def _alone(llm: LLM, ids: list[int], n: int) -> Request:
    req = _req(ids, n, top_logprobs=2)
    for _ in llm.run(req):
        pass
    return req


def _assert_same_or_tie(alone: Request, together: Request, label: str, tie: float = TIE,
                        names: tuple[str, str] = ("alone", "together"),
                        same_finish: bool = False) -> None:
    """``together``'s tokens are ``alone``'s (run with top_logprobs >= 2) up to the first
    difference, which must be at a near-tie of ``alone`` (top-2 margin < ``tie`` nats); with no
    difference the lengths (and, with ``same_finish``, the finish reasons) agree too."""
    a, b = alone.output_ids, together.output_ids
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            lp = alone.token_logprobs[i]
            margin = lp.top_logprobs[0] - lp.top_logprobs[1]
            assert margin < tie, (f"{label}: token {i} differs ({x} {names[0]}, {y} {names[1]}) "
                                  f"with a margin of {margin:.4f} nats {names[0]}")
            print(f"{label}: token {i} flipped at a near-tie, margin {margin:.2e}")
            return
    assert len(a) == len(b), f"{label}: {len(a)} tokens {names[0]}, {len(b)} {names[1]}"
    assert not same_finish or alone.finish_reason == together.finish_reason, label


@pytest.mark.parametrize("name,n_prompts", [(SMOL, 6), (GEMMA, 3)])
def test_greedy_together_equals_alone_real_models(name, n_prompts):
    llm = LLM(model_path(name), n_ctx=256)
    texts = ["The capital of France is", "def fibonacci(n):", "List three colors:",
             "Once upon a time, in a land far away,", "1, 2, 3, 4,", "Water boils at"][:n_prompts]
    prompts = [llm.encode_raw(t) for t in texts]
    together = [_req(p, 48) for p in prompts]
    llm.run_many(together)
    for t, p, r in zip(texts, prompts, together):
        _assert_same_or_tie(_alone(llm, p, 48), r, f"{name} {t!r}")
    assert llm.engine.blocks.n_used == 0
    llm.engine.blocks.check()


def test_32_concurrent_requests_of_random_lengths(tiny):
    llm = LLM(tiny, n_ctx=512, max_seqs=32)
    rng = random.Random(7)
    v = llm.config.n_vocab
    specs = [([rng.randrange(v) for _ in range(rng.randint(1, 200))], rng.randint(1, 40))
             for _ in range(32)]
    reqs = [_req(p, n) for p, n in specs]
    llm.run_many(reqs)
    assert all(r.finish_reason in ("length", "stop") for r in reqs)
    for (p, n), r in zip(specs[:8], reqs):  # spot-check against decoding alone
        _assert_same_or_tie(_alone(llm, p, n), r, f"prompt of {len(p)}")
    assert llm.engine.blocks.n_used == 0 and not llm.engine.has_work
    llm.engine.blocks.check()


def test_a_small_pool_preempts_and_still_finishes_everything(tiny):
    # 12 sequences growing to ~120 tokens each in a pool of 512 tokens (one context)
    llm = LLM(tiny, n_ctx=512, max_seqs=12, kv_tokens=512, prefix_cache=False)
    rng = random.Random(3)
    v = llm.config.n_vocab
    specs = [([rng.randrange(v) for _ in range(rng.randint(40, 80))], 40) for _ in range(12)]
    reqs = [_req(p, n) for p, n in specs]
    llm.run_many(reqs)
    assert llm.engine.scheduler.preemptions > 0
    assert all(len(r.output_ids) == 40 for r in reqs)
    for (p, n), r in list(zip(specs, reqs))[:4]:
        _assert_same_or_tie(_alone(llm, p, n), r, "preempted")
    assert llm.engine.blocks.n_used == 0
    llm.engine.blocks.check()


def test_prefix_cache_reuses_a_shared_prompt_and_changes_nothing(tiny):
    llm = LLM(tiny, n_ctx=512)
    v = llm.config.n_vocab
    rng = random.Random(11)
    system = [rng.randrange(v) for _ in range(100)]
    a = _req(system + [1, 2, 3], 12)
    b = _req(system + [4, 5], 12)
    llm.run_many([a])
    llm.run_many([b])
    assert a.cached_tokens == 0 and b.cached_tokens == 96  # 6 full blocks of 16
    cold = LLM(tiny, n_ctx=512, prefix_cache=False)
    b2 = _req(system + [4, 5], 12)
    cold.run_many([b2])
    assert b2.cached_tokens == 0 and b2.output_ids == b.output_ids
    st = llm.engine.stats()
    assert st.prefix_hit_tokens == 96 and st.kv_blocks_used == 0 and st.kv_blocks_cached >= 6


def test_a_long_prompt_is_chunked_while_another_stream_decodes(tiny):
    llm = LLM(tiny, n_ctx=512, max_batch_tokens=32)
    eng = llm.engine
    v = llm.config.n_vocab
    streaming = eng.add(_req([5, 6, 7], 100))
    while not streaming.request.output_ids:
        eng.step()
    long_ = eng.add(_req([(i * 7) % v for i in range(300)], 4))
    steps = 0
    while long_.n_computed < 300:
        before = len(streaming.request.output_ids)
        eng.step()
        steps += 1
        assert len(streaming.request.output_ids) == before + 1  # one token every step
    assert steps >= 300 // 32  # the prompt went in chunks within the budget
    while eng.has_work:
        eng.step()
    assert eng.blocks.n_used == 0


def test_cancel_frees_the_blocks_at_once(tiny):
    llm = LLM(tiny, n_ctx=512)
    eng = llm.engine
    seq = eng.add(_req(list(range(1, 90)), 200))
    for _ in range(5):
        eng.step()
    assert eng.blocks.n_used > 0
    eng.cancel(seq)
    assert eng.blocks.n_used == 0 and seq.finished and seq.request.finish_reason == "cancelled"
    assert eng.step() == [] and not eng.has_work
    eng.blocks.check()


def test_sampled_streams_are_reproducible_by_seed_together_or_alone(tiny):
    llm = LLM(tiny, n_ctx=256)
    p = SamplingParams(seed=42)  # llama.cpp's default chain, seeded
    a = _req([1, 2, 3], 24, sampling=p)
    others = [_req([9, 8, 7, i], 24, sampling=SamplingParams(seed=i)) for i in range(5)]
    llm.run_many([a] + others)
    alone = _req([1, 2, 3], 24, sampling=p)
    llm.run_many([alone])
    assert a.output_ids == alone.output_ids


def test_bad_requests_fail_alone(tiny):
    llm = LLM(tiny, n_ctx=64)
    eng = llm.engine
    ok = eng.add(_req([1, 2], 5))
    with pytest.raises(ValueError, match="context holds 64"):
        eng.add(_req(list(range(64)), 5))
    # the first id outside [0, n_vocab) is named, past the uint32 packing's range too
    for ids, bad in (([llm.config.n_vocab], llm.config.n_vocab), ([1, -1, 2], -1),
                     ([2**32, 1], 2**32), ([-(2**40)], -(2**40))):  # fmt: skip
        with pytest.raises(ValueError, match=f"token id {bad} is outside the vocabulary"):
            eng.add(_req(ids, 5))
    for ids, bad in (([1, 2.0], "2.0"), (["7", 1], "'7'")):  # not truncated, not parsed
        with pytest.raises(ValueError, match=f"token id {bad} is not an integer"):
            eng.add(_req(ids, 5))
    while eng.has_work:
        eng.step()
    assert len(ok.request.output_ids) == 5


def _decoding(eng, n: int) -> list:
    """``n`` requests added and stepped until every one decodes (the chain check's input)."""
    seqs = [eng.add(_req([1, 2, 3, 4 + i], 8)) for i in range(n)]
    while any(s.n_computed < len(s.tokens) - 1 or not s.request.output_ids for s in seqs):
        eng.step()
    return seqs


def test_the_chain_check_reads_every_sequence_on_the_cpu(tiny):
    """The GPU's chaining decision (Engine._chain_ok) runs on the CPU too: a decode step of
    chainable requests may chain, and so may one where some rows have a logits processor
    (they ride as passengers) but not all; one about to end may not."""
    from deimos.engine.runner import StepResult

    eng = LLM(tiny, n_ctx=256).engine
    seqs = _decoding(eng, 3)
    assert eng._chain_ok(StepResult(None, seqs))
    seqs[1].request.logits_processors = [lambda ids, x: x]
    assert eng._chain_ok(StepResult(None, seqs))
    for s in seqs:
        s.request.logits_processors = [lambda ids, x: x]
    assert not eng._chain_ok(StepResult(None, seqs))
    for s in seqs:
        s.request.logits_processors = ()
    seqs[2].request.max_tokens = len(seqs[2].request.output_ids) + 1
    assert not eng._chain_ok(StepResult(None, seqs))
    for s in seqs:
        eng.cancel(s)
    assert eng.blocks.n_used == 0


def _grammar(llm: LLM):
    """A JSON grammar's processor for ``llm`` (any object): what the server attaches."""
    from deimos.engine.constrain import GrammarVocab, JsonConstraint
    from deimos.server.processors import Constrained

    vocab = GrammarVocab.from_tokenizer(llm.tokenizer, llm.stop_ids, llm.config.n_vocab)
    return Constrained(JsonConstraint.from_schema(None, vocab), llm.stop_ids)


def test_deferred_grammar_rows_keep_the_chain_on_the_cpu(tiny, tmp_path_factory):
    """With ``defer_rows`` a grammar's row (greedy or top-k <= 256, no logprobs) chains as a
    plain row, even when every row is one and in a hybrid; one the device cannot decide
    (top-k off) or with another processor rides as a passenger as before (in a hybrid: stops
    the chain). A row with penalties over a window of at most 64 tokens is deferred too
    (without, it stops the chain for all), and a row reporting logprobs stays. On by
    default; off, the rows ride as passengers or stop the chain, as before."""
    from hybrid_support import tiny_qwen35

    from deimos.engine.runner import StepResult

    for path in (tiny, tiny_qwen35(tmp_path_factory, "defer_hybrid").path):
        llm = LLM(path, n_ctx=256)  # the default: on
        eng = llm.engine
        seqs = _decoding(eng, 3)
        for s in seqs:
            s.request.logits_processors = [_grammar(llm)]
        assert all(eng._deferred(s) for s in seqs)
        assert eng._chain_ok(StepResult(None, seqs))
        # not deferred (top-k off; penalties over the whole answer): a passenger every other
        # launch, which a hybrid has not
        for other in (SamplingParams(top_k=0, seed=1),
                      SamplingParams(repetition_penalty=1.1, penalty_last_n=-1)):
            seqs[0].request.sampling = other
            assert not eng._deferred(seqs[0])
            assert eng._chain_ok(StepResult(None, seqs)) != eng.hybrid
        seqs[0].request.sampling = GREEDY
        seqs[0].request.logits_processors = [lambda ids, x: x]
        assert not eng._deferred(seqs[0])
        assert eng._chain_ok(StepResult(None, seqs)) != eng.hybrid
        # penalties: a plain row deferred (it stopped the whole chain), over a window the
        # device sampler holds
        seqs[0].request.logits_processors = ()
        seqs[0].request.sampling = SamplingParams(presence_penalty=0.5, seed=3)
        assert eng._deferred(seqs[0]) and eng._chain_ok(StepResult(None, seqs))
        seqs[0].request.sampling = SamplingParams(presence_penalty=0.5, penalty_last_n=-1)
        assert not eng._deferred(seqs[0]) and not eng._chain_ok(StepResult(None, seqs))
        # logprobs: the row stays (its logits copied out), unless it also needs the host
        seqs[0].request.sampling = SamplingParams(seed=4)
        seqs[0].request.top_logprobs = 2
        assert eng._logprob_row(seqs[0]) and eng._chain_ok(StepResult(None, seqs))
        seqs[0].request.sampling = SamplingParams(top_k=0, seed=4)
        assert not eng._logprob_row(seqs[0]) and not eng._chain_ok(StepResult(None, seqs))
        for s in seqs:
            eng.cancel(s)
    llm = LLM(tiny, n_ctx=256, defer_rows=False)
    seqs = _decoding(llm.engine, 2)
    for s in seqs:
        s.request.logits_processors = [_grammar(llm)]
    assert not llm.engine._deferred(seqs[0]) and not llm.engine._chain_ok(StepResult(None, seqs))
    seqs[0].request.logits_processors = ()
    seqs[0].request.sampling = SamplingParams(presence_penalty=0.5, seed=3)
    assert not llm.engine._deferred(seqs[0])
    seqs[0].request.sampling = GREEDY
    seqs[0].request.top_logprobs = 2
    assert not llm.engine._logprob_row(seqs[0])
    for s in seqs:
        llm.engine.cancel(s)


def test_a_hybrids_host_rows_do_not_ride_a_chain(tmp_path_factory):
    """In a hybrid model a passenger's input would advance its recurrent state wrongly: a row
    with a logits processor stops the chain there, as before."""
    from hybrid_support import tiny_qwen35

    from deimos.engine.runner import StepResult

    eng = LLM(tiny_qwen35(tmp_path_factory, "chain_hybrid").path, n_ctx=128).engine
    seqs = _decoding(eng, 2)
    assert eng._chain_ok(StepResult(None, seqs))
    seqs[1].request.logits_processors = [lambda ids, x: x]
    assert not eng._chain_ok(StepResult(None, seqs))
    for s in seqs:
        eng.cancel(s)


def test_the_profile_step_is_a_valid_largest_step(tiny):
    """The load-time profile step (ModelRunner.profile_inputs: max_seqs - 1 decode rows and a
    chunk filling the token budget, on the scratch block) runs on the reference and gives
    finite logits for every row; the pool's blocks stay free."""
    llm = LLM(tiny, n_ctx=96, max_seqs=8, max_batch_tokens=128)
    runner = llm.engine.runner
    x = runner.profile_inputs(128)
    assert x.q_lens == [1] * 7 + [96, 25]  # chunks of at most a context fill the budget
    logits = runner._eager(x)
    assert logits.shape == (9, llm.config.n_vocab) and bool(logits.isfinite().all())
    assert llm.engine.blocks.n_used == 0


def test_the_warm_up_steps_cover_a_first_requests_shapes(tiny):
    """ModelRunner.warm_shapes (run at load on a GPU so a server's first requests compile
    nothing): a whole budget from position 0, its continuation at an odd count and position
    past the prefill graphs, a chunk beside decode rows at an odd total; every position inside
    the context, on the scratch block; they run on the reference with finite logits."""
    llm = LLM(tiny, n_ctx=1500, max_seqs=8, max_batch_tokens=600)
    runner = llm.engine.runner
    shapes = runner.warm_shapes(600)
    assert [(x.q_lens[-1], x.q_starts[-1], x.n_decode) for x in shapes] == [(600, 0, 0), (599, 599, 0), (594, 0, 3)]
    for x in shapes:
        assert int(x.positions.max()) < 1500 and not x.tables.any()
        logits = runner._eager(x)
        assert logits.shape == (len(x.q_lens), llm.config.n_vocab) and bool(logits.isfinite().all())
    assert sum(shapes[2].q_lens) % 2 == 1 and shapes[1].q_lens[0] % 2 == 1
    assert all(int(x.positions.max()) < 1500 for x in runner.warm_shapes(4096))  # a budget past the context
    assert LLM(tiny, n_ctx=96, max_batch_tokens=128).engine.runner.warm_shapes(128) == []  # too short a context
    assert llm.engine.blocks.n_used == 0


def test_the_warm_up_steps_cover_the_decode_attentions_variants(tiny, monkeypatch):
    """Where the ops name the decode row counts whose attention builds another kernel variant
    (TritonOps.eager_decode_rows, over the tables' positions and up to max_seqs - 1 rows), the
    warm-up adds a short chunk beside each (an odd total) other than the 3 rows it has; they
    run on the reference with finite logits."""
    from deimos.kernels.triton.decode_attention import variant_rows

    llm = LLM(tiny, n_ctx=1500, max_seqs=48, max_batch_tokens=600)
    runner, cfg = llm.engine.runner, llm.config
    asked = []

    def rows(s, max_rows):  # TritonOps.eager_decode_rows on this model's heads (the CPU has no TritonOps)
        asked.append((s, max_rows))
        return variant_rows(s, max_rows, cfg.n_head_kv, cfg.head_dim)

    monkeypatch.setattr(runner.model.ops, "eager_decode_rows", rows, raising=False)
    shapes = runner.warm_shapes(600)
    s = runner.max_blocks * runner.block_size
    assert asked == [(s, 47)]
    want = [nd for nd in variant_rows(s, 47, cfg.n_head_kv, cfg.head_dim) if nd != 3]
    assert len(want) >= 3
    assert [x.n_decode for x in shapes[3:]] == want
    assert all(x.q_lens[-1] in (16, 17) for x in shapes[3:])
    for x in shapes[3:]:
        assert sum(x.q_lens) % 2 == 1 and not x.tables.any()
        logits = runner._eager(x)
        assert logits.shape == (len(x.q_lens), llm.config.n_vocab) and bool(logits.isfinite().all())
    assert llm.engine.blocks.n_used == 0


def test_a_hybrid_model_decodes_together_as_alone(tmp_path):
    """qwen35 (Gated DeltaNet + attention) through the engine: each sequence keeps its own
    recurrent state (Sequence.state), so sequences decoded together give each one's tokens
    alone; a small pool preempts and recomputes (from a fresh state or a snapshot)."""
    path = tmp_path / "qwen35-tiny-F32.gguf"
    write_model(path, "qwen35", "qwen35-tiny", "F32", llama_cpp_path(DONOR), seed=2)
    llm = LLM(path, n_ctx=128)
    prompts = [[(7 * i + j) % 200 + 1 for i in range(5 + 11 * j)] for j in range(4)]
    alone = [llm.run_many([_req(p, 12)])[0].output_ids for p in prompts]
    together = llm.run_many([_req(p, 12) for p in prompts])
    assert [r.output_ids for r in together] == alone
    small = LLM(path, n_ctx=128, kv_tokens=64, max_batch_tokens=32)
    got = small.run_many([_req(p, 12) for p in prompts])
    assert [r.output_ids for r in got] == alone
    assert small.engine.scheduler.preemptions > 0
    assert small.engine.blocks.n_used == 0


def test_a_hybrid_models_second_turn_prefills_only_its_new_tokens(tmp_path):
    """State snapshots (issue 16): a sequence keeps its recurrent state at its latest full KV
    block; the next turn (the first turn's tokens and answer, then new ones) restores it and
    prefills only what follows that block: its new tokens and the first turn's last answer
    token (never fed in turn 1) when turn 1's cache ended on a block boundary, else also the
    cache's last partial block. The tokens equal a run without any cache."""
    path = tmp_path / "qwen35-tiny-F32.gguf"
    write_model(path, "qwen35", "qwen35-tiny", "F32", llama_cpp_path(DONOR), seed=2)
    fresh = LLM(path, n_ctx=256, prefix_cache=False)
    for n1, answer in ((21, 12), (22, 12)):  # turn 1 caches 32 tokens (2 blocks), 33
        llm = LLM(path, n_ctx=256)
        p1 = [(5 * i) % 300 + 2 for i in range(n1)]
        t1 = llm.run_many([_req(p1, answer)])[0]
        new = [(11 * i) % 300 + 3 for i in range(10)]
        p2 = p1 + t1.output_ids + new
        t2 = llm.run_many([_req(p2, 8)])[0]
        prefilled = len(p2) - t2.cached_tokens
        tail = (n1 + answer - 1) % 16  # turn 1's cached tokens past its last full block
        assert prefilled == len(new) + 1 + tail, (n1, prefilled, t2.cached_tokens)
        assert t2.output_ids == fresh.run_many([_req(p2, 8)])[0].output_ids
        assert llm.engine.blocks.n_used == 0


def test_a_hybrid_prompt_crossing_a_block_boundary_is_prefilled_in_one_step(tmp_path):
    """A 27-token prompt (blocks of 16) is prefilled in one step that also keeps the state
    after its 16th token (a snapshot row inside the chunk, not a second step), and a second
    prompt sharing those 16 tokens starts from it; both equal uncached runs."""
    path = tmp_path / "qwen35-tiny-F32.gguf"
    write_model(path, "qwen35", "qwen35-tiny", "F32", llama_cpp_path(DONOR), seed=2)
    llm = LLM(path, n_ctx=256)
    fresh = LLM(path, n_ctx=256, prefix_cache=False)
    p1 = [(7 * i) % 300 + 2 for i in range(27)]
    t1 = llm.run_many([_req(p1, 1)])[0]
    assert llm.engine.steps == 1 and llm.engine.blocks.n_states == 1
    p2 = p1[:20] + [9, 8, 7]
    t2 = llm.run_many([_req(p2, 6)])[0]
    assert t1.cached_tokens == 0 and t2.cached_tokens == 16
    assert t1.output_ids == fresh.run_many([_req(p1, 1)])[0].output_ids
    assert t2.output_ids == fresh.run_many([_req(p2, 6)])[0].output_ids


def test_a_hybrid_models_state_snapshots_are_bounded(tmp_path):
    """Each finished sequence leaves a recurrent-state snapshot on its last full block; the
    block manager keeps at most max_states of them (2 x max_seqs), the oldest dropped."""
    path = tmp_path / "qwen35-tiny-F32.gguf"
    write_model(path, "qwen35", "qwen35-tiny", "F32", llama_cpp_path(DONOR), seed=2)
    llm = LLM(path, n_ctx=256, max_seqs=3)
    assert llm.engine.blocks.max_states == 6
    for j in range(12):  # distinct 40-token prompts: each leaves one snapshot
        llm.run_many([_req([(13 * i + 7 * j) % 400 + 1 for i in range(40)], 4)])
    assert llm.engine.blocks.n_states == 6
    assert llm.engine.blocks.n_used == 0


def test_a_hybrid_models_shared_prompt_is_reused_by_later_sessions(tmp_path):
    """Two sessions sharing a 40-token system prompt, one after the other: the second starts
    from the first's snapshot at the prompt's last full block (32 tokens), kept although the
    first session decoded on past it; its tokens equal an uncached run."""
    path = tmp_path / "qwen35-tiny-F32.gguf"
    write_model(path, "qwen35", "qwen35-tiny", "F32", llama_cpp_path(DONOR), seed=2)
    llm = LLM(path, n_ctx=256)
    system = [(3 * i) % 500 + 5 for i in range(40)]
    a = llm.run_many([_req(system + [11, 12, 13], 40)])[0]  # decodes well past the prompt
    b = llm.run_many([_req(system + [21, 22, 23, 24], 6)])[0]
    assert a.cached_tokens == 0 and b.cached_tokens == 32
    fresh = LLM(path, n_ctx=256, prefix_cache=False)
    assert b.output_ids == fresh.run_many([_req(system + [21, 22, 23, 24], 6)])[0].output_ids


@pytest.mark.parametrize("kw, field", [({"dense_weights": "always"}, "dense_weights"),
                                       ({"experts": "bogus"}, "experts"),
                                       ({"expert_cache_gib": -1.0}, "expert_cache_gib")])
def test_placement_arguments_are_checked_before_loading(tiny, kw, field):
    with pytest.raises(ValueError, match=field):
        LLM(tiny, n_ctx=64, **kw)
