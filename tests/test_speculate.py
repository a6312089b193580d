"""Speculative decoding (deimos.engine.speculate) on the CPU reference.

Oracles: the same model without speculation (greedy tokens equal, or different only where the
plain run's top two logits are within TIE: a verification's k + 1 rows sum in another order than
a one-row decode); a brute-force scan for the n-gram lookup; a plain prefill's keys and values for
every block the prefix cache sealed; for the rejection sampler, the sampler's distribution
written out independently here (penalties, top-k, temperature) and a chi-square test with a
fixed seed, which two wrong rules fail on the same draws.
"""

from __future__ import annotations

import math
import random
import time

import pytest
import torch
from test_engine_batch import TIE, _assert_same_or_tie
from testdata import llama_cpp_path, model_path

from deimos.engine import LLM
from deimos.engine.engine import Engine, EngineConfig, EngineStats
from deimos.engine.llm import speculation
from deimos.engine.request import Request
from deimos.engine.runner import StepResult
from deimos.engine.sampling import BatchSampler, accept_draft, target_distribution
from deimos.engine.sequence import Sequence
from deimos.engine.speculate import NgramDrafter, NgramIndex, SpecConfig, SpecState
from deimos.kernels.sampling import Sampler, SamplingParams, draw_uniform
from deimos.synth import write_model

SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA = "gemma-3-270m-q4_k_m.gguf"
DONOR = "models/ggml-vocab-llama-spm.gguf"
GREEDY = SamplingParams(temperature=0)
CODE = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
        "def mul(a, b):\n    return a * b\n\n\ndef div(a, b):\n    return a / b\n")
# prompts whose answers copy what they read: the n-gram drafts get accepted
REPEATING = ["Here is a file:\n" + CODE + "\nThe same file again, unchanged:\n" + CODE[:30],
             "Copy: " + "the cat sat on the mat. " * 3]
PLAIN = ["The capital of France is", "List three colors:"]


# ---- helpers ---------------------------------------------------------------------------


def _spec_engine(llm: LLM, n_ctx: int = 512, **kw) -> Engine:
    """An engine with n-gram speculation on ``llm``'s model (its own pool)."""
    kw.setdefault("spec", SpecConfig())
    return Engine(llm.model, EngineConfig(n_ctx=n_ctx, max_seqs=kw.pop("max_seqs", 4), **kw))


def _run(engine: Engine, reqs: list[Request]) -> tuple[list[Sequence], dict[int, list[list[int]]]]:
    """Every request to the end; per sequence, the tokens each step gave it."""
    seqs = [engine.add(r) for r in reqs]
    steps: dict[int, list[list[int]]] = {s.id: [] for s in seqs}
    while engine.has_work:
        got: dict[int, list[int]] = {}
        for out in engine.step():
            if out.error is not None:
                raise out.error
            got.setdefault(out.seq.id, []).append(out.token)
        for sid, tokens in got.items():
            steps[sid].append(tokens)
    return seqs, steps


def _plain(llm: LLM, ids: list[int], n: int, **kw) -> Request:
    req = Request(list(ids), n, GREEDY, top_logprobs=2, **kw)
    llm.run_many([req])
    return req


def _same_or_tie(plain: Request, spec: Request, label: str, tie: float = TIE) -> None:
    _assert_same_or_tie(plain, spec, label, tie, ("plain", "speculative"), same_finish=True)


def _all_free(engine: Engine) -> None:
    assert engine.blocks.n_used == 0 and not engine.has_work
    engine.blocks.check()


@pytest.fixture(scope="module")
def smol():
    return LLM(model_path(SMOL), n_ctx=512, max_seqs=4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec") / "llama-tiny-Q8_0.gguf"
    write_model(path, "llama", "llama-tiny", "Q8_0", llama_cpp_path(DONOR), seed=5)
    return path


# ---- the n-gram drafter ------------------------------------------------------------------


def _brute(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The lookup by a scan: the longest n (n_max..n_min) whose last n tokens occurred earlier,
    its latest earlier end e, then k tokens from e (continuing from the proposal itself)."""
    L = len(tokens)
    for n in range(n_max, n_min - 1, -1):
        if n >= L:
            continue
        tail = tokens[L - n :]
        for e in range(L - 1, n - 1, -1):
            if tokens[e - n : e] == tail:
                ext = list(tokens)
                for i in range(k):
                    ext.append(ext[e + i])
                return ext[L:]
    return []


def test_ngram_lookup_on_hand_made_tokens():
    idx = NgramIndex(2, 3)
    assert idx.lookup([1, 2, 3, 4], 3) == []  # nothing occurred before
    assert idx.lookup([5], 3) == []  # too short for any n-gram
    # (1, 2) last occurred before the end at 6..7: its followers; the older one at 0..1 loses
    assert NgramIndex(2, 3).lookup([1, 2, 3, 9, 1, 2, 4, 8, 5, 1, 2], 3) == [4, 8, 5]
    # the longest n wins: (7, 1, 2) occurred once, early; (1, 2) later with other followers
    assert NgramIndex(2, 3).lookup([7, 1, 2, 6, 1, 2, 4, 0, 7, 1, 2], 2) == [6, 1]
    # past the end of the tokens the proposal continues from itself: a repeating span repeats
    assert NgramIndex(2, 2).lookup([7, 8, 7, 8], 5) == [7, 8, 7, 8, 7]
    assert NgramIndex(1, 1).lookup([3, 3], 4) == [3, 3, 3, 3]
    # fewer than k when k is small; the drafter keeps its index in the sequence's SpecState
    seq = Sequence(0, Request([4, 5, 6, 4, 5], 8, GREEDY), [4, 5, 6, 4, 5])
    seq.spec = SpecState(4)
    drafter = NgramDrafter(2, 4)
    assert drafter.propose(seq, 1) == [6]
    assert isinstance(seq.spec.drafter, NgramIndex)
    seq.tokens += [6, 9]
    assert drafter.propose(seq, 3) == []  # (6, 9) and (9,)-grams never occurred
    seq.tokens += [4, 5]
    assert drafter.propose(seq, 3) == [6, 9, 4]


def test_ngram_index_grows_as_a_brute_force_scan_says():
    rng = random.Random(12)
    for trial in range(40):
        n_min = rng.randint(1, 3)
        n_max = n_min + rng.randint(0, 3)
        vocab = rng.randint(2, 6)  # few ids: many repeats
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 8))]
        idx = NgramIndex(n_min, n_max)
        for _ in range(30):
            k = rng.randint(1, 8)
            assert idx.lookup(tokens, k) == _brute(tokens, k, n_min, n_max), (trial, tokens)
            tokens += [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]


def test_ngram_index_on_a_30k_token_sequence():
    """An agent's long prompt: the index is built once (every token indexed once, by zip),
    then each decode step indexes only the new tokens."""
    rng = random.Random(3)
    chunk = [rng.randrange(50_000) for _ in range(400)]  # a file read into the prompt
    tokens = [rng.randrange(50_000) for _ in range(30_000)]
    tokens[12_000:12_400] = chunk
    tokens += chunk[:10]  # the answer starts re-emitting it
    idx = NgramIndex(2, 4)
    t0 = time.perf_counter()
    assert idx.lookup(tokens, 6) == chunk[10:16]
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(10, 300):  # 290 decode steps, one accepted token each
        tokens.append(chunk[i])
        assert idx.lookup(tokens, 6) == chunk[i + 1 : i + 7]
    steps = time.perf_counter() - t0
    print(f"30k-token index: {first * 1e3:.0f} ms to build, {steps / 290 * 1e6:.0f} us a step")
    assert sum(len(t) for t in idx.ends) <= 3 * len(tokens)
    assert first < 5.0 and steps / 290 < 0.01  # generous: a shared CPU; the real cost is ms/us


# ---- settings and the adaptive k ---------------------------------------------------------


def test_the_settings_are_checked():
    with pytest.raises(ValueError, match="one of ngram"):
        SpecConfig("magic")
    with pytest.raises(ValueError, match="k_max must be an integer in 1..16"):
        SpecConfig(k_max=0)
    with pytest.raises(ValueError, match="ngram_min"):
        SpecConfig(ngram_min=4, ngram_max=2)
    with pytest.raises(ValueError, match="spec_k and draft_model need speculative"):
        speculation(None, 4)
    with pytest.raises(ValueError, match="SpecConfig"):
        EngineConfig(n_ctx=64, spec="ngram")
    assert speculation("ngram", 3) == SpecConfig("ngram", k_max=3) and speculation(None, None) is None


def test_k_adapts_to_the_acceptance():
    st = SpecState(4)
    st.verified(4, 4, 10, k_max=6)  # all accepted: one more
    st.verified(5, 5, 16, k_max=6)
    st.verified(6, 6, 23, k_max=6)
    assert st.k == 6 and st.wanted(23) == 6  # capped at k_max
    st.verified(6, 2, 26, k_max=6)  # a partial run: one more than it accepted
    assert st.k == 3
    st.verified(3, 0, 27, k_max=6)
    assert st.k == 1 and st.wanted(27) == 1
    st.verified(1, 0, 28, k_max=6)  # at zero: plain decoding for 4 tokens, then a probe of one
    assert [st.wanted(n) for n in (28, 31, 32)] == [0, 0, 1]
    st.verified(1, 0, 32, k_max=6)  # the probe failed: twice as long
    assert st.wanted(39) == 0 and st.wanted(40) == 1
    st.verified(1, 1, 41, k_max=6)  # accepted: growing again, the backoff reset
    assert st.k == 2 and st.backoff == 4
    st.found(0, 41)  # the drafter had nothing: wait 1, then 2, 4 ... tokens
    st.found(0, 42)
    assert st.wanted(43) == 0 and st.wanted(44) == 2
    st.found(3, 44)
    assert st.miss_skip == 1


# ---- the rejection sampler ---------------------------------------------------------------


def _chi2_sf(x: float, df: int) -> float:
    """P(X > x) for X chi-square with df degrees of freedom (closed forms, any df)."""
    if df % 2:
        sf, k = math.erfc(math.sqrt(x / 2)), 1
    else:
        sf, k = math.exp(-x / 2), 2
    while k < df:
        sf += math.exp((k / 2) * math.log(x / 2) - x / 2 - math.lgamma(k / 2 + 1)) if x > 0 else 0
        k += 2
    return sf


def _chi2(counts: dict[int, int], p: dict[int, float], n: int) -> tuple[float, int]:
    assert all(t in p and p[t] > 0 for t in counts), "a token the distribution does not allow"
    stat = sum((counts.get(t, 0) - n * q) ** 2 / (n * q) for t, q in p.items() if q > 0)
    return stat, sum(q > 0 for q in p.values()) - 1


LOGITS = [2.0, 1.1, 0.3, 2.4, -0.5, 1.7, 0.9, -1.2, 0.0, 1.3, 0.6]
SEEN = [3, 3, 0, 5]  # the history the penalties count


def _oracle() -> dict[int, float]:
    """llama.cpp's chain written out: repetition penalty 1.3 and presence 0.2 on SEEN, the top 7,
    softmax at temperature 0.8."""
    x = list(LOGITS)
    for t in set(SEEN):
        c = SEEN.count(t)
        x[t] = x[t] / 1.3 if x[t] > 0 else x[t] * 1.3
        x[t] -= 0.2 * (c > 0)
    keep = sorted(range(len(x)), key=lambda i: -x[i])[:7]
    z = sum(math.exp(x[i] / 0.8) for i in keep)
    return {i: (math.exp(x[i] / 0.8) / z if i in keep else 0.0) for i in range(len(x))}


PARAMS = SamplingParams(temperature=0.8, top_k=7, top_p=1.0, min_p=0.0, repetition_penalty=1.3,
                        presence_penalty=0.2, seed=2024)


def test_the_chi_square_tail_is_right():
    assert abs(_chi2_sf(20.515, 5) - 1e-3) < 2e-6  # the table's 0.1% points
    assert abs(_chi2_sf(13.816, 2) - 1e-3) < 2e-6
    assert abs(_chi2_sf(3.841, 1) - 0.05) < 1e-4


@pytest.mark.parametrize("draft", [5, 0, 4], ids=["likely-draft", "penalized-draft", "draft-cut-by-top-k"])
def test_the_rejection_sampler_gives_the_plain_distribution(draft):
    """Many seeded verifications of one row with a fixed draft: the emitted token's counts fit
    the plain sampler's distribution p (chi-square, p-value > 1e-3 with the fixed seed); the
    same draws under two wrong rules (always accept the draft; on a rejection draw from p
    without removing the draft) fail it (p-value < 1e-12)."""
    p = _oracle()
    assert p[4] == 0.0 and p[5] > 0.1 and 0.05 < p[0] < 0.3
    row = torch.tensor(LOGITS, dtype=torch.float32)
    req = Request([1], 10, PARAMS)
    req.sampler = Sampler(PARAMS, len(LOGITS))
    for t in SEEN:
        req.sampler.accept(t)
    seq = Sequence(0, req, [1])
    # the plain sampler's own distribution is the oracle's (so the oracle is the right one)
    ids, probs = target_distribution(req.sampler, row)
    assert {int(i): float(q) for i, q in zip(ids, probs)} == pytest.approx({i: q for i, q in p.items() if q})
    sampler = BatchSampler(len(LOGITS), torch.device("cpu"), 4)
    n = 8000
    right: dict[int, int] = {}
    accepted = 0
    for _ in range(n):
        token, ok = sampler.verify(seq, row, draft)
        right[token] = right.get(token, 0) + 1
        accepted += ok
    stat, df = _chi2(right, p, n)
    print(f"draft {draft}: accepted {accepted / n:.3f} (p = {p[draft]:.3f}), chi2 {stat:.1f} "
          f"df {df}, p-value {_chi2_sf(stat, df):.3g}")
    assert _chi2_sf(stat, df) > 1e-3
    assert abs(accepted / n - p[draft]) < 4 * math.sqrt(p[draft] * (1 - p[draft]) / n) + 1e-9
    # the wrong rules on the same kind of draws (the request's stream, seeded)
    ids_l, probs_l = ids.tolist(), probs.tolist()

    def draw_from(weights, u):
        cum, total = 0.0, sum(weights)
        for i, w in zip(ids_l, weights):
            cum += w
            if u * total < cum:
                return i
        return ids_l[-1]

    counter = 0

    def u():
        nonlocal counter
        counter += 1
        return draw_uniform(99, counter)

    always = {draft: n}
    not_removed: dict[int, int] = {}
    for _ in range(n):
        t = draft if u() < p[draft] else draw_from(probs_l, u())
        not_removed[t] = not_removed.get(t, 0) + 1
    if p[draft] > 0:
        for wrong in (always, not_removed):
            stat, df = _chi2(wrong, p, n)
            assert _chi2_sf(stat, df) < 1e-12, wrong
    else:  # a draft p does not allow: both wrong rules emit it, which p forbids
        with pytest.raises(AssertionError, match="does not allow"):
            _chi2(always, p, n)
        assert accepted == 0


def test_accept_draft_edges():
    ids = torch.tensor([4, 7, 9])
    # all the mass on the draft: accepted whatever u
    assert accept_draft(ids, torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64), 7, 0.999, lambda: 0.5) == (7, True)
    # a rejection never returns the draft
    probs = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    for r in (0.0, 0.3, 0.999):
        token, ok = accept_draft(ids, probs, 7, 0.6, lambda r=r: r)
        assert not ok and token in (4, 9)
    with pytest.raises(ValueError, match="equal non-empty"):
        accept_draft(ids, probs[:2], 7, 0.1, lambda: 0.1)


# ---- the engine --------------------------------------------------------------------------


@pytest.mark.parametrize("name", [SMOL, GEMMA])
def test_greedy_output_is_the_same_with_and_without_speculation(name, smol):
    llm = smol if name == SMOL else LLM(model_path(name), n_ctx=512, max_seqs=4)
    engine = _spec_engine(llm)
    for text in REPEATING:
        ids = llm.encode_raw(text)
        plain = _plain(llm, ids, 40)
        spec = Request(list(ids), 40, GREEDY, top_logprobs=2)
        _, steps = _run(engine, [spec])
        _same_or_tie(plain, spec, f"{name} {text[:20]!r}")
        assert len(spec.token_logprobs) == len(spec.output_ids)
        for a, b in zip(plain.token_logprobs, spec.token_logprobs):
            if a.token != b.token:
                break
            assert abs(a.logprob - b.logprob) < 1e-3
        runs = [len(s) for s in next(iter(steps.values()))]
        print(f"{name} {text[:20]!r}: tokens per step {runs}")
        assert max(runs) > 1
    st = engine.stats()
    print(f"{name}: {st.spec_accepted} of {st.spec_drafted} drafts accepted in "
          f"{st.spec_verify_steps} verify steps; {st.tokens_chosen / st.token_rows:.2f} tokens a step")
    assert st.spec_accepted > 0 and st.spec_verify_steps > 0
    assert st.tokens_chosen == 2 * 40 > st.token_rows
    _all_free(engine)


def test_sequences_with_and_without_drafts_together_equal_each_alone(smol):
    """Two copying prompts and two that get no drafts, decoded together: some steps verify
    drafts beside plain decodes; every sequence's tokens equal a plain run of it alone."""
    engine = _spec_engine(smol)
    prompts = [smol.encode_raw(t) for t in REPEATING + PLAIN]
    mixed = []
    run = engine.runner.run

    def recording(plan):  # the steps' shapes (instrumentation: the real runner runs)
        mixed.append(bool(plan.verify) and bool(plan.decode))
        return run(plan)

    engine.runner.run = recording
    reqs = [Request(list(p), 32, GREEDY) for p in prompts]
    _run(engine, reqs)
    assert any(mixed), "no step verified drafts beside a plain decode"
    assert engine.stats().spec_accepted > 0
    for text, p, r in zip(REPEATING + PLAIN, prompts, reqs):
        _same_or_tie(_plain(smol, p, 32), r, f"together {text[:20]!r}")
    _all_free(engine)


class FutureDrafter:
    """A drafter that knows the answer (a plain run's tokens): its first ``right`` drafts are
    the answer's next tokens (all: every draft is accepted), the rest wrong ones."""

    def __init__(self, prompt: list[int], answer: list[int], right: int = 99) -> None:
        self.n_prompt = len(prompt)
        self.answer = answer
        self.right = right

    def propose(self, seq: Sequence, k: int) -> list[int]:
        n = len(seq.tokens) - self.n_prompt
        drafts = self.answer[n : n + k]
        return drafts[: self.right] + [(t + 1) % 1000 for t in drafts[self.right :]]


@pytest.mark.parametrize("drafts", ["ngram", "two-right-four-wrong"])
def test_rollback_frees_blocks_and_the_cache_seals_only_accepted_keys(smol, drafts):
    """After every step: the cache holds exactly the sequence's tokens but its last, its table
    no block past its next position (blocks taken for rejected drafts went back: it happens),
    its sealed blocks only computed tokens. At the end every block is free, and every block
    the prefix cache sealed holds the keys and values a plain prefill of the same tokens
    computes (a rejected draft's keys in one would differ by O(1))."""
    engine = _spec_engine(smol)
    ids = smol.encode_raw(REPEATING[0])
    if drafts != "ngram":  # 6 drafts a step, 4 of them rejected: drafts cross many boundaries
        d = FutureDrafter(ids, _plain(smol, ids, 72).output_ids, right=2)
        engine.scheduler.propose = lambda seq, room: d.propose(seq, min(room, 6))
    req = Request(list(ids), 72, GREEDY)
    seq = engine.add(req)
    bs = engine.blocks.block_size
    given_back = 0
    tables = []
    run = engine.runner.run

    def recording(plan):  # the table as the step ran (instrumentation: the real runner runs)
        tables.append(len(seq.table))
        return run(plan)

    engine.runner.run = recording
    while engine.has_work:
        engine.step()
        grown = tables[-1]
        if not seq.finished and seq.n_computed >= len(ids):
            assert seq.n_computed == len(seq.tokens) - 1
            assert len(seq.table) <= engine.blocks.blocks_for(len(seq.tokens))
            assert seq.n_sealed * bs <= seq.n_computed
            given_back += grown > len(seq.table)
    st = engine.stats()
    assert st.spec_accepted > 0 and st.spec_drafted > st.spec_accepted  # rejections happened
    if drafts != "ngram":
        assert given_back > 0 and st.spec_accepted == 2 * st.spec_verify_steps
    _all_free(engine)
    full = seq.tokens  # prompt + answer; the last answer token was never fed
    cached = engine.blocks.match(full)
    assert len(cached) * bs >= len(ids) + 32, "blocks written while verifying were not sealed"
    _plain(smol, full, 1)  # a plain engine's keys and values of the same tokens
    ref = smol.engine.blocks.match(full)
    assert len(ref) >= len(cached)
    worst = 0.0
    for mine, theirs in zip(cached, ref):
        for layer in range(len(engine.pool.k)):
            for a, b in ((engine.pool.k, smol.engine.pool.k), (engine.pool.v, smol.engine.pool.v)):
                x = a[layer][mine * bs : (mine + 1) * bs]
                y = b[layer][theirs * bs : (theirs + 1) * bs]
                worst = max(worst, float((x - y).abs().max() / y.abs().max()))
    print(f"{drafts}: sealed blocks {len(cached)}, worst relative difference {worst:.2e}, "
          f"blocks given back {given_back} times")
    assert worst < 1e-3


def test_a_stop_token_ends_an_accepted_run_at_its_token(smol):
    engine = _spec_engine(smol, prefix_cache=False)  # the same steps every run
    ids = smol.encode_raw(REPEATING[1])
    full = Request(list(ids), 40, GREEDY)
    _, steps = _run(engine, [full])
    (runs,) = steps.values()
    out = full.output_ids
    # the second token of a run of at least three (an accepted draft), not in the answer before
    stop_at, i = None, 0
    for run in runs:
        if stop_at is None and len(run) >= 3 and run[1] not in out[: i + 1]:
            stop_at = i + 1
        i += len(run)
    assert stop_at is not None, f"no run of three new tokens: {runs}"
    stopped = Request(list(ids), 40, GREEDY, stop_ids=frozenset({out[stop_at]}))
    _, s = _run(engine, [stopped])
    assert stopped.output_ids == out[: stop_at + 1] and stopped.finish_reason == "stop"
    assert len(next(iter(s.values()))[-1]) == 2  # the stop came right after one accepted draft
    _all_free(engine)


def test_max_tokens_and_a_stop_token_inside_a_run_of_accepted_drafts(smol):
    """Drafts the engine's cap (max_tokens) does not shorten: runs of 6 accepted drafts, with
    max_tokens or a stop token in the middle of one: the output ends at that token."""
    ids = smol.encode_raw(REPEATING[1])
    plain = _plain(smol, ids, 24)
    out = plain.output_ids
    for kind in ("length", "stop"):
        engine = _spec_engine(smol, prefix_cache=False)
        drafter = FutureDrafter(ids, out)
        engine.scheduler.propose = lambda seq, room, d=drafter: d.propose(seq, min(room, 6))
        if kind == "length":  # the steps give out[0], out[1..7], out[8..14]: end at out[11]
            end, req = 11, Request(list(ids), 12, GREEDY)
        else:  # a token new to the answer inside out[1..7]
            end = next(j for j in range(2, 7) if out[j] not in out[:j])
            req = Request(list(ids), 24, GREEDY, stop_ids=frozenset({out[end]}))
        _, steps = _run(engine, [req])
        (runs,) = steps.values()
        assert req.output_ids == out[: end + 1] and req.finish_reason == kind, kind
        assert [len(r) for r in runs[:-1]] == [1, 7][: len(runs) - 1]
        assert 2 <= len(runs[-1]) < 7  # the run was cut inside
        _all_free(engine)


def test_a_full_context_ends_inside_a_run(smol):
    ids = smol.encode_raw(REPEATING[1])
    n_ctx = len(ids) + 21
    engine = _spec_engine(smol, n_ctx=n_ctx, prefix_cache=False)
    spec = Request(list(ids), 100, GREEDY)
    seqs, _ = _run(engine, [spec])
    plain_engine = Engine(smol.model, EngineConfig(n_ctx=n_ctx, max_seqs=2, prefix_cache=False))
    plain = Request(list(ids), 100, GREEDY)
    _run(plain_engine, [plain])
    assert spec.output_ids == plain.output_ids and spec.finish_reason == "length"
    assert len(seqs[0].tokens) - 1 == n_ctx and engine.stats().spec_accepted > 0
    _all_free(engine)


def test_greedy_with_penalties_counts_the_drafts_accepted_before_each_row(smol):
    """Penalties (a window of 16 tokens that slides inside a run; frequency counts): each row's
    choice sees the drafts accepted before it, so the tokens equal a plain run's."""
    engine = _spec_engine(smol, prefix_cache=False)
    ids = smol.encode_raw(REPEATING[1])
    for p in (SamplingParams(temperature=0, repetition_penalty=1.1, penalty_last_n=16),
              SamplingParams(temperature=0, frequency_penalty=0.1)):
        before = engine.stats().spec_accepted
        plain = Request(list(ids), 32, p)
        smol.run_many([plain])
        spec = Request(list(ids), 32, p)
        _run(engine, [spec])
        assert spec.output_ids == plain.output_ids, p
        assert engine.stats().spec_accepted > before
    _all_free(engine)


def test_sampled_speculation_is_seeded_and_accepts(smol):
    engine = _spec_engine(smol, prefix_cache=False)
    ids = smol.encode_raw(REPEATING[1])
    p = SamplingParams(temperature=0.4, top_k=20, seed=11)
    a = Request(list(ids), 32, p)
    b = Request(list(ids), 32, p)
    _run(engine, [a])
    _run(engine, [b])
    assert a.output_ids == b.output_ids and a.finish_reason in ("length", "stop")
    st = engine.stats()
    assert st.spec_accepted > 0
    _all_free(engine)


# ---- a draft model ------------------------------------------------------------------------


def test_a_draft_model_drafts_greedily_and_changes_nothing(tiny, tmp_path):
    """Two random-weight llama-tiny files over one vocabulary as draft models of the first:
    itself (its drafts are its own greedy tokens: nearly all accepted) and another seed (few or
    none accepted); three sequences together give the plain tokens. After rejections, the
    draft cache proposes what the draft model alone says after the sequence's tokens (rolled
    back past the rejected drafts); every draft block is free at the end."""
    other = tmp_path / "llama-tiny-Q8_0-seed6.gguf"
    write_model(other, "llama", "llama-tiny", "Q8_0", llama_cpp_path(DONOR), seed=6)
    plain = LLM(tiny, n_ctx=256, max_seqs=4)
    prompts = [list(range(100, 130)), [5, 6, 7], list(range(200, 260))]
    want = [_plain(plain, p, 30) for p in prompts]
    for draft in (tiny, other):
        llm = LLM(tiny, n_ctx=256, max_seqs=4, speculative="draft", draft_model=draft)
        reqs = [Request(list(p), 30, GREEDY) for p in prompts]
        llm.run_many(reqs)
        for w, r in zip(want, reqs):
            _same_or_tie(w, r, f"draft {draft.name}")
        st = llm.engine.stats()
        print(f"draft {draft.name}: {st.spec_accepted} of {st.spec_drafted} accepted")
        assert st.spec_drafted > 0
        if draft == tiny:
            assert st.spec_accepted >= 0.9 * st.spec_drafted
        drafter = llm.engine.drafter
        assert drafter.blocks.n_used == 0 and llm.engine.blocks.n_used == 0
        drafter.blocks.check()
    # mid-run, after rejections: the draft cache against the draft model alone
    alone = LLM(other, n_ctx=256, max_seqs=2)
    eng = llm.engine
    seq = eng.add(Request(list(prompts[2]), 40, GREEDY))
    while len(seq.request.output_ids) < 20:
        eng.step()
    now = eng.stats()
    assert now.spec_drafted - st.spec_drafted > now.spec_accepted - st.spec_accepted  # rejections
    assert eng.drafter.propose(seq, 4) == _plain(alone, seq.tokens, 4).output_ids
    eng.cancel(seq)
    assert eng.drafter.blocks.n_used == 0 and seq.spec.drafter is None


def test_a_draft_model_needs_the_vocabulary(tiny):
    with pytest.raises(ValueError, match="does not share .* vocabulary"):
        LLM(tiny, n_ctx=64, speculative="draft", draft_model=model_path(SMOL))
    with pytest.raises(ValueError, match="needs a draft_model"):
        SpecConfig("draft")
    with pytest.raises(ValueError, match="only it takes one"):
        SpecConfig("ngram", draft_model="x.gguf")


# ---- plumbing ------------------------------------------------------------------------------


def test_the_llm_flags_reach_the_engine_and_the_chain_check_leaves_drafters_out(tiny):
    llm = LLM(tiny, n_ctx=256, speculative="ngram", spec_k=3)
    eng = llm.engine
    assert eng.cfg.spec == SpecConfig("ngram", k_max=3)
    seqs = [eng.add(Request([1, 2, 3, 4 + i], 8, GREEDY)) for i in range(2)]
    while any(not s.request.output_ids for s in seqs):
        eng.step()
    assert not eng._chain_ok(StepResult(None, seqs))  # they draft at their next step
    for s in seqs:
        s.spec.resume_at = 100
    assert eng._chain_ok(StepResult(None, seqs))  # none drafts: the plain chained decode
    for s in seqs:
        eng.cancel(s)
    _all_free(eng)
    with pytest.raises(ValueError, match="speculative .* or spec, not both"):
        LLM(tiny, n_ctx=64, speculative="ngram", spec=SpecConfig())


def _hybrid_rollback(path, right: int, tie: float = TIE, **llm_kw) -> None:
    """Two prompts decoded together with drafts that are a plain run's next tokens then wrong
    ones (FutureDrafter, 6 at most a verification): greedy tokens equal the plain run's (or
    differ at a near-tie); after every step each state holds exactly the tokens the cache
    holds; a rejection restored a state (none when every draft is right); every block is free
    at the end."""
    llm = LLM(path, n_ctx=256, max_seqs=4, **llm_kw)
    engine = _spec_engine(llm, n_ctx=256)
    prompts = [llm.encode_raw(t) for t in REPEATING]
    plains = [_plain(llm, p, 48) for p in prompts]
    ds = [FutureDrafter(p, r.output_ids, right=right) for p, r in zip(prompts, plains)]
    engine.scheduler.propose = lambda seq, room: ds[seq.id % 2].propose(seq, min(room, 6))
    reqs = [Request(list(p), 48, GREEDY, top_logprobs=2) for p in prompts]
    seqs = [engine.add(r) for r in reqs]
    assert [s.id % 2 for s in seqs] == [0, 1]
    restored = 0
    restore = engine.runner.restore_state

    def counting(seq, snap):  # instrumentation: the real restore runs
        nonlocal restored
        restored += 1
        restore(seq, snap)

    engine.runner.restore_state = counting
    while engine.has_work:
        for out in engine.step():
            assert out.error is None, out.error
        for s in seqs:
            if not s.finished and s.state is not None:
                assert s.state.length == s.n_computed
    st = engine.stats()
    print(f"{path.name} right={right}: {st.spec_accepted} of {st.spec_drafted} drafts accepted, "
          f"{restored} states restored")
    if right < 6:
        assert st.spec_accepted > 0 and restored > 0
    else:  # every draft accepted: nothing to restore (the state stands after the last draft)
        assert st.spec_accepted == st.spec_drafted > 0 and restored == 0
    for text, plain, req in zip(REPEATING, plains, reqs):
        _same_or_tie(plain, req, f"{path.name} right={right} {text[:20]!r}", tie=tie)
    _all_free(engine)


@pytest.mark.parametrize(("arch", "right"), [("qwen35", 2), ("qwen35", 99), ("qwen3next", 2)],
                         ids=["qwen35-two-right-four-wrong", "qwen35-all-right", "qwen3next-two-right"])
def test_a_hybrid_model_rolls_its_recurrent_state_back(tmp_path, arch, right):
    """qwen35 and qwen3next (Gated DeltaNet layers and full attention) on the CPU reference: a
    verification advances the recurrent state over every draft, so a rejection restores the
    state saved before it and feeds the accepted tokens again (``_hybrid_rollback``)."""
    path = tmp_path / f"{arch}-tiny-F32.gguf"
    write_model(path, arch, f"{arch}-tiny", "F32", llama_cpp_path(DONOR), seed=2)
    _hybrid_rollback(path, right)


def test_the_cli_flags_make_the_serve_config():
    from deimos.cli import build_parser, engine_options, serve_config

    parse = build_parser().parse_args
    cfg = serve_config(parse(["serve", "m", "--device", "cpu", "--speculative", "ngram",
                              "--spec-k", "5"]))
    assert cfg.engine_options() == {"speculative": "ngram", "spec_k": 5}
    cfg = serve_config(parse(["serve", "m", "--device", "cpu", "--speculative", "draft",
                              "--draft-model", "small.gguf"]))
    assert cfg.engine_options() == {"speculative": "draft", "draft_model": "small.gguf"}
    args = parse(["run", "m", "hi", "--device", "cpu", "--speculative", "ngram"])
    assert engine_options(args, "cpu") == {"speculative": "ngram"}
    for flags, problem in ((["--speculative", "magic"], "--speculative must be one of ngram"),
                           (["--spec-k", "3"], "--spec-k needs --speculative"),
                           (["--draft-model", "d.gguf"], "--draft-model needs --speculative"),
                           (["--speculative", "draft"], "--speculative draft needs --draft-model"),
                           (["--speculative", "ngram", "--spec-k", "17"], "--spec-k must be")):
        with pytest.raises(ValueError, match=problem):
            engine_options(parse(["run", "m", "hi", *flags]), "cpu")


def _worker_answer(worker, req: Request, stops: tuple[str, ...] = ()) -> tuple[str, object]:
    """One job through the server's engine worker: its streamed text and its end event."""
    import asyncio

    from deimos.server.worker import Done, Failed, Job, Piece

    async def go():
        job = Job(id="t", request=req, stops=stops, loop=asyncio.get_running_loop())
        worker.submit(job)
        text = []
        while True:
            ev = await asyncio.wait_for(job.events.get(), 60)
            if isinstance(ev, Piece):
                text.append(ev.text)
            elif isinstance(ev, (Done, Failed)):
                return "".join(text), ev

    return asyncio.run(go())


def test_the_server_streams_every_token_of_a_step_that_chose_several(smol):
    """A verification step chooses several tokens, all recorded (and the request finished)
    before the worker delivers the first: the streamed text must still hold each of them,
    up to max_tokens, up to a stop token (not shown), up to a stop string; the usage counts
    what was delivered. Oracle: a plain run's tokens, decoded whole. The cases end inside a
    run of accepted drafts (asserted, from the same engine's steps)."""
    from deimos.server.metrics import Metrics
    from deimos.server.worker import EngineWorker

    ids = smol.encode_raw(REPEATING[1])
    out = _plain(smol, ids, 40).output_ids
    tok = smol.tokenizer
    spec = LLM(smol.path, n_ctx=512, max_seqs=4, speculative="ngram", prefix_cache=False)
    _, steps = _run(spec.engine, [Request(list(ids), 40, GREEDY)])
    (runs,) = steps.values()
    ends, at = [], 0
    for run in runs:  # answers of n tokens whose last step chose n - at > 1 of them
        ends += [n for n in range(at + 2, at + len(run) + 1)]
        at += len(run)
    assert len(ends) >= 6, f"too few accepted drafts to test with: {runs}"
    worker = EngineWorker(spec, Metrics())
    worker.start()
    try:
        for n in ends[:6]:
            text, done = _worker_answer(worker, Request(list(ids), n, GREEDY))
            assert text == tok.decode(out[:n]), f"max_tokens {n}"
            assert done.finish_reason == "length" and done.completion_tokens == n
            # a stop token in the same place: its text not shown, the ones before it all are
            stop = Request(list(ids), 40, GREEDY, stop_ids=frozenset({out[n - 1]}))
            if out[n - 1] not in out[: n - 1]:
                text, done = _worker_answer(worker, stop)
                assert text == tok.decode(out[: n - 1]) and done.finish_reason == "stop"
                assert done.completion_tokens == n
        # a stop string ending inside a run: the text up to it, the tokens up to the one
        # that completed it (the step's later tokens are not counted)
        n = ends[2]
        whole = tok.decode(out[:n])
        cut = tok.decode(out[: n - 1])
        needle = whole[len(cut) - 3:]
        assert needle and whole.find(needle) == len(cut) - 3, "the stop string occurs earlier"
        text, done = _worker_answer(worker, Request(list(ids), 40, GREEDY), stops=(needle,))
        assert text == whole[: len(cut) - 3] and done.finish_reason == "stop"
        assert done.completion_tokens == n
    finally:
        worker.stop()
    _all_free(spec.engine)
    # the Python API's stream too: a stop token inside a run, the tokens before it all shown
    n = next(n for n in ends if out[n - 1] not in out[: n - 1])
    req = Request(list(ids), 40, GREEDY, stop_ids=frozenset({out[n - 1]}))
    assert "".join(spec.stream_ids(req)) == tok.decode(out[: n - 1])
    assert req.finish_reason == "stop" and req.output_ids == out[:n]


def test_metrics_and_the_dashboard_show_the_acceptance():
    from deimos.server.dashboard import Dashboard
    from deimos.server.metrics import Metrics, engine_numbers

    st = EngineStats(running=1, waiting=0, kv_blocks_used=4, kv_blocks_free=60, kv_blocks_cached=0,
                     block_size=16, prefix_hit_tokens=0, prefix_query_tokens=10, preemptions=0,
                     spec_drafted=40, spec_accepted=30, spec_verify_steps=9, token_rows=20,
                     tokens_chosen=50)
    e = engine_numbers(st)
    assert e["spec_acceptance_rate"] == 0.75 and e["tokens_per_step"] == 2.5
    m = Metrics({"model_weights": 1, "kv_cache": 1})
    m.set_engine(st)
    text = m.prometheus().decode()
    for line in ("deimos_spec_acceptance_rate 0.75", "deimos_tokens_per_step 2.5",
                 "deimos_spec_drafted_tokens_total 40.0", "deimos_spec_accepted_tokens_total 30.0",
                 "deimos_spec_verify_steps_total 9.0"):
        assert line in text, line
    import io

    from rich.console import Console

    console = Console(record=True, width=140, file=io.StringIO())
    console.print(Dashboard(m, title="t").render())
    shown = console.export_text()
    assert "75.0% accepted" in shown and "2.50 tokens a step" in shown


@pytest.mark.gpu
def test_gpu_speculation_keeps_the_greedy_tokens():
    """On a GPU (not run on the CPU machine): decode graphs and chained steps for sequences
    without drafts, eager verifications (the kernel path's varlen attention over k + 1 rows)
    beside them, a lone sequence's verifications on the verify graphs: each sequence gets the plain GPU run's greedy tokens, alone or together (or
    differs at a near-tie: fp16 sums in another order), drafts are accepted, and a seeded
    sampled run repeats itself; every block is free at the end."""
    path = model_path(SMOL)
    plain = LLM(path, device="cuda", n_ctx=512, max_seqs=4)
    spec = LLM(path, device="cuda", n_ctx=512, max_seqs=4, speculative="ngram")
    prompts = [plain.encode_raw(t) for t in REPEATING + PLAIN]
    want = [_plain(plain, p, 40) for p in prompts]
    alone = [Request(list(p), 40, GREEDY) for p in prompts]
    for r in alone:
        spec.run_many([r])
    together = [Request(list(p), 40, GREEDY) for p in prompts]
    spec.run_many(together)
    for w, a, t in zip(want, alone, together):
        _same_or_tie(w, a, "gpu alone", tie=0.05)
        _same_or_tie(w, t, "gpu together", tie=0.05)
    assert spec.engine.stats().spec_accepted > 0
    verify = spec.engine.runner.verify_graphs
    assert verify and sum(g.replays for g in verify.values()) > 0  # the lone verifications
    p = SamplingParams(temperature=0.5, seed=3)
    a, b = Request(list(prompts[1]), 32, p), Request(list(prompts[1]), 32, p)
    spec.run_many([a])
    spec.run_many([b])
    assert a.output_ids == b.output_ids
    assert spec.engine.blocks.n_used == 0
    spec.engine.blocks.check()


@pytest.mark.gpu
@pytest.mark.parametrize("right", [2, 99])
def test_gpu_hybrid_speculation_restores_state_pool_slots(tmp_path, right):
    """On a GPU (not run on the CPU machine): the kernel path keeps a hybrid's states in the
    state pool; a rejection writes the saved copy back into the sequence's slot
    (``_hybrid_rollback``, fp16 sums: a wider near-tie)."""
    path = tmp_path / "qwen35-tiny-Q8_0.gguf"
    write_model(path, "qwen35", "qwen35-tiny", "Q8_0", llama_cpp_path(DONOR), seed=2)
    _hybrid_rollback(path, right, tie=0.05, device="cuda")


# ---- preemption while speculating ---------------------------------------------------------


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sequences_preempted_while_speculating_give_the_plain_tokens(tiny, method):
    """Four sequences in a pool too small for all of them: the newest are preempted (their
    blocks dropped, recomputed later) between verifications, and a draft model's per-sequence
    cache with them. n-gram drafts on the real SmolLM2 (answers that copy their prompts), the
    draft model on llama-tiny drafting for itself. Every answer is the plain run's (or differs
    at a near-tie), drafts were verified, and no block of either pool is left."""
    path = model_path(SMOL) if method == "ngram" else tiny
    plain = LLM(path, n_ctx=256, max_seqs=4)
    texts = [*REPEATING, "Copy: " + "a b c d e f g. " * 4,
             "Here is a list:\n1, 2, 3, 4, 5, 6, 7\nThe same list again:\n1, 2"]
    prompts = [plain.encode_raw(t)[:90] for t in texts]
    want = [_plain(plain, p, 48) for p in prompts]
    kw = {"draft_model": tiny} if method == "draft" else {}
    # the four want ~24 blocks of 16 at their ends: 17 make the newest wait or be preempted
    llm = LLM(path, n_ctx=256, max_seqs=4, kv_tokens=17 * 16, prefix_cache=False,
              speculative=method, **kw)
    reqs = [Request(list(p), 48, GREEDY, top_logprobs=2) for p in prompts]
    llm.run_many(reqs)
    for i, (w, r) in enumerate(zip(want, reqs)):
        _same_or_tie(w, r, f"{method} sequence {i}")
    st = llm.engine.stats()
    print(f"{method}: {st.preemptions} preemptions, {st.spec_accepted} of {st.spec_drafted} "
          f"drafts accepted in {st.spec_verify_steps} verify steps")
    assert st.preemptions > 0 and st.spec_verify_steps > 0 and st.spec_accepted > 0
    _all_free(llm.engine)
    if method == "draft":
        assert llm.engine.drafter.blocks.n_used == 0
        llm.engine.drafter.blocks.check()
