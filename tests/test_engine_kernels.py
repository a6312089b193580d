"""The engine on the kernel path (deimos.models.gpu: paged attention, the batched GEMM, the
mixed decode + prefill steps; on a GPU also the CUDA graphs per batch bucket, the sampling in
the graph and decode steps chained a step ahead) against the engine on the CPU reference.

Oracle: the float32 reference engine, greedy, the same requests together; a token may differ
only where the reference's top two are within TIE (the kernel path rounds activations and
weights to fp16 or to its 15-bit integer planes). On a GPU, the sampling in the graph against
the host's exact sampler on the same logits with the same draws (a no-op logits processor
sends a request down the host path). Without CUDA the kernels run in Triton's interpreter on a
tiny model (slow: few tokens)."""

from __future__ import annotations

import pytest
import torch
from kernel_device import DEVICE, INTERPRETED
from testdata import llama_cpp_path

from deimos.engine.constrain import GrammarVocab, JsonConstraint
from deimos.engine.engine import Engine, EngineConfig
from deimos.engine.request import Request
from deimos.gguf import GGUFFile
from deimos.kernels.sampling import SamplingParams
from deimos.models import ARCHITECTURES, load_model
from deimos.models.weights import WeightSource
from deimos.server.processors import Constrained
from deimos.synth import write_model
from deimos.tokenizer import Tokenizer

DONOR = "models/ggml-vocab-llama-spm.gguf"
TIE = 0.05
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["name", "n"]}
GREEDY = SamplingParams(temperature=0)
N_TOKENS = 4 if INTERPRETED else 24


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("engine_kernels")
    out = {}
    for preset, typ in (("llama-tiny", "Q8_0"), ("qwen3-tiny", "Q8_0"), ("llama-tiny-k", "Q4_K_M")):
        path = d / f"{preset}-{typ}.gguf"
        write_model(path, preset.split("-")[0], preset, typ, llama_cpp_path(DONOR), seed=9)
        out[(preset, typ)] = GGUFFile(path)
    return out


def _engines(f: GGUFFile, **cfg):
    ref = load_model(f)
    ker = ARCHITECTURES[ref.config.arch](ref.config, WeightSource(f, DEVICE, kernels=True))
    c = EngineConfig(**{"n_ctx": 128, "max_seqs": 8, **cfg})
    return Engine(ref, c), Engine(ker, c)


def _run(engine: Engine, reqs: list[Request]) -> None:
    seqs = [engine.add(r) for r in reqs]
    while engine.has_work:
        for out in engine.step():
            assert out.error is None, out.error
    assert all(s.finished for s in seqs)
    assert engine.blocks.n_used == 0
    engine.blocks.check()


def _prompts(n_vocab: int) -> list[list[int]]:
    return [[(7 * i + 3) % n_vocab for i in range(n)] for n in (5, 17, 33, 1, 70)]


@pytest.mark.parametrize("key", [("llama-tiny", "Q8_0"), ("qwen3-tiny", "Q8_0"),
                                 ("llama-tiny-k", "Q4_K_M")], ids=lambda k: "-".join(k))
def test_kernel_engine_greedy_matches_reference(files, key):
    if INTERPRETED and key != ("llama-tiny", "Q8_0"):
        pytest.skip("the interpreter runs one model (slow)")
    ref, ker = _engines(files[key])
    ker.warm()
    prompts = _prompts(ref.n_vocab)
    want = [Request(p, N_TOKENS, GREEDY, top_logprobs=2) for p in prompts]
    got = [Request(p, N_TOKENS, GREEDY) for p in prompts]
    _run(ref, want)
    _run(ker, got)
    for w, g in zip(want, got):
        for i, (a, b) in enumerate(zip(w.output_ids, g.output_ids)):
            if a != b:
                lp = w.token_logprobs[i]
                margin = lp.top_logprobs[0] - lp.top_logprobs[1]
                assert margin < TIE, f"token {i}: {a} vs {b}, reference margin {margin:.4f}"
                break
        assert len(w.output_ids) == len(g.output_ids)


@pytest.mark.gpu
def test_graphs_device_sampling_and_chains_on_the_gpu(files):
    """Graphs are used (decode buckets, prefill buckets), the device sampler's choices equal
    the host sampler's on the same logits and draws, and decode steps were chained."""
    _, ker = _engines(files[("llama-tiny-k", "Q4_K_M")], max_seqs=16)
    ker.warm()
    prompts = _prompts(ker.n_vocab) * 2
    params = [SamplingParams(seed=i) for i in range(len(prompts))]  # llama.cpp's default chain
    device = [Request(p, 32, s) for p, s in zip(prompts, params)]
    _run(ker, device)
    runner = ker.runner
    assert sum(g.replays for g in runner.decode_graphs.values()) > 0
    chained_before = ker.steps
    host = [Request(p, 32, s, logits_processors=[lambda ids, x: x]) for p, s in zip(prompts, params)]
    _run(ker, host)  # the same draws, sampled on the host from the same (bitwise) logits
    for d, h in zip(device, host):
        assert d.output_ids == h.output_ids
    # one stream alone chains its decode steps: more steps than host round trips
    solo = Request(prompts[2], 64, GREEDY)  # 33 tokens: one prefill chunk alone, a graph
    _run(ker, [solo])
    assert ker.steps > chained_before
    assert sum(g.replays for g in runner.prefill_graphs.values()) > 0


@pytest.mark.gpu
def test_host_rows_ride_the_chain_as_passengers_on_the_gpu(files):
    """Rows whose choice is the host's (a logits processor) beside device-sampled rows: the
    decode steps stay chained, each host row riding every other launch as a passenger (its
    input not chosen yet) and fed its host-chosen token the launch after; every answer equals
    the same request's with no processor (same seeds: a passenger takes no draw; same logits:
    the passenger's key and value are rewritten before anything reads them)."""
    _, ker = _engines(files[("llama-tiny-k", "Q4_K_M")], max_seqs=16)
    ker.warm()
    prompts = _prompts(ker.n_vocab) * 2
    params = [SamplingParams(seed=10 + i) if i % 3 else GREEDY for i in range(len(prompts))]
    want = [Request(p, 24, s) for p, s in zip(prompts, params)]
    _run(ker, want)
    assert ker.passenger_rows == 0
    got = [Request(p, 24, s, logits_processors=[lambda ids, x: x] if i % 2 else ())
           for i, (p, s) in enumerate(zip(prompts, params))]
    _run(ker, got)
    assert ker.passenger_rows > 0
    for w, g in zip(want, got):
        assert w.output_ids == g.output_ids


class _Counted(Constrained):
    """A grammar processor counting its host calls (the device masks its rows instead)."""

    calls = 0

    def __call__(self, output_ids, logits):
        type(self).calls += 1
        return super().__call__(output_ids, logits)


class _HostOnly:
    """A grammar processor without ``mask_words``: its rows are chosen on the host."""

    def __init__(self, inner: Constrained) -> None:
        self.inner = inner

    def __call__(self, output_ids, logits):
        return self.inner(output_ids, logits)


@pytest.mark.gpu
@pytest.mark.parametrize("defer", [False, True], ids=["passengers", "deferred"])
def test_grammar_rows_are_masked_and_sampled_on_the_gpu(files, defer):
    """A JSON grammar's rows masked on the device (``mask_words``, read by sample_rows) and
    sampled there with the others give the tokens the host gives when it masks and samples
    them (same seeds, greedy and sampled, beside plain rows): chained as passengers, or with
    ``defer_rows`` chosen after each chained launch (``BatchSampler.resample``: no
    passengers); the device path never calls the processor on the host."""
    f = files[("llama-tiny-k", "Q4_K_M")]
    _, ker = _engines(f, max_seqs=16, defer_rows=defer)
    ker.warm()
    tok = Tokenizer.from_gguf(f)
    vocab = GrammarVocab.from_tokenizer(tok, tok.eog_ids, ker.n_vocab)
    prompts = _prompts(ker.n_vocab) * 2
    params = [SamplingParams(seed=20 + i) if i % 3 else GREEDY for i in range(len(prompts))]

    def grammar():
        return JsonConstraint.from_schema(SCHEMA, vocab)

    runs = []
    for device in (True, False):
        reqs = []
        for i, (p, s) in enumerate(zip(prompts, params)):
            procs = ()
            if i % 2:
                c = _Counted(grammar(), tok.eog_ids)
                procs = [c] if device else [_HostOnly(c)]
            reqs.append(Request(p, 24, s, tok.eog_ids, logits_processors=procs))
        _Counted.calls = 0
        _run(ker, reqs)
        runs.append([r.output_ids for r in reqs])
        if device:
            assert _Counted.calls == 0
            assert (ker.passenger_rows == 0) == defer
            assert (ker.sampler._resampler is not None) == defer
        else:
            assert _Counted.calls > 0
    assert runs[0] == runs[1]
    for i, out in enumerate(runs[0]):
        if i % 2:  # a prefix of an object of the schema: the grammar took every token
            c = grammar()
            for t in out:
                if t not in tok.eog_ids:
                    c.advance(t)


def _without_and_with_defer(f: GGUFFile, requests, record):
    """The same requests (``requests(n_vocab)``) on an engine without ``defer_rows`` and on
    one with it: what ``record`` takes of each request, each way, and the two engines."""
    runs, engines = [], []
    for defer in (False, True):
        _, ker = _engines(f, max_seqs=16, defer_rows=defer)
        ker.warm()
        reqs = requests(ker.n_vocab)
        _run(ker, reqs)
        runs.append([record(r) for r in reqs])
        engines.append(ker)
    return runs, engines


@pytest.mark.gpu
def test_penalized_rows_deferred_keep_the_chain_on_the_gpu(files):
    """With ``defer_rows``, rows with penalties (which stop the chain for every row without
    it) are sampled after each chained launch (``BatchSampler.resample``): the same tokens as
    the engine without it (same seeds: one draw a token either way)."""

    def requests(n_vocab):
        params = [SamplingParams(seed=30 + i, presence_penalty=0.7, frequency_penalty=0.3,
                                 repetition_penalty=1.2) if i % 2 else SamplingParams(seed=30 + i)
                  for i in range(10)]
        return [Request(p, 24, s) for p, s in zip(_prompts(n_vocab) * 2, params)]

    runs, (off, on) = _without_and_with_defer(files[("llama-tiny-k", "Q4_K_M")], requests,
                                              lambda r: r.output_ids)
    assert off.sampler._resampler is None and on.sampler._resampler is not None
    assert runs[0] == runs[1]


@pytest.mark.gpu
def test_logprob_rows_in_a_chain_on_the_gpu(files):
    """With ``defer_rows``, rows reporting logprobs stay in the chain, their logits copied out
    before the next launch (``BatchSampler.hold``): the tokens of the engine whose chain they
    stop, bit for bit, and its logprobs: the same ids, the values to float32's rounding (the
    held row's log-softmax runs on the host's copy, the unchained row's on the device)."""

    def requests(n_vocab):
        return [Request(p, 24, SamplingParams(seed=50 + i), top_logprobs=3 if i % 3 == 0 else None)
                for i, p in enumerate(_prompts(n_vocab) * 2)]

    runs, (off, on) = _without_and_with_defer(files[("llama-tiny-k", "Q4_K_M")], requests,
                                              lambda r: (r.output_ids, r.token_logprobs))
    assert not off.sampler._held and on.sampler._held
    assert [ids for ids, _ in runs[0]] == [ids for ids, _ in runs[1]]
    n = 0
    for (_, want), (_, got) in zip(runs[0], runs[1]):
        assert len(want) == len(got)
        for w, g in zip(want, got):
            assert (g.token, g.top_ids) == (w.token, w.top_ids)
            assert g.logprob == pytest.approx(w.logprob, abs=1e-5)
            assert g.top_logprobs == pytest.approx(w.top_logprobs, abs=1e-5)
            n += 1
    assert n >= 4  # the four logprob requests reported their tokens


@pytest.mark.gpu
def test_mixed_steps_and_preemption_on_the_gpu(files):
    ref, ker = _engines(files[("llama-tiny-k", "Q4_K_M")], max_seqs=8, max_batch_tokens=64,
                        kv_tokens=256)
    prompts = [[(5 * i + j) % ref.n_vocab for i in range(40 + 9 * j)] for j in range(8)]
    want = [Request(p, 40, GREEDY, top_logprobs=2) for p in prompts]
    got = [Request(p, 40, GREEDY) for p in prompts]
    _run(ref, want)
    _run(ker, got)
    assert ker.scheduler.preemptions > 0
    for w, g in zip(want, got):
        for i, (a, b) in enumerate(zip(w.output_ids, g.output_ids)):
            if a != b:
                lp = w.token_logprobs[i]
                assert lp.top_logprobs[0] - lp.top_logprobs[1] < TIE
                break
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_a_padded_prefill_graph_reads_no_stale_key(files):
    """A prompt chunk replayed on a padded prefill graph (33 tokens on the 64-token graph, and
    a 1-token chunk after a 32-token cache hit on the 16-token one) over a KV pool poisoned with
    NaN: its attention reads only keys the cache holds (not the slots after the chunk's real
    rows, which the step never writes), so the tokens equal the eager engine's."""
    f = files[("llama-tiny-k", "Q4_K_M")]
    ref = load_model(f)
    runs = {}
    for graphs in (True, False):
        ker = ARCHITECTURES[ref.config.arch](ref.config, WeightSource(f, DEVICE, kernels=True))
        eng = Engine(ker, EngineConfig(n_ctx=128, max_seqs=4, cuda_graphs=graphs))
        eng.warm()
        for t in (*eng.pool.k, *eng.pool.v):
            t.fill_(float("nan"))
        prompt = _prompts(ref.config.n_vocab)[2]  # 33 tokens
        reqs = [Request(prompt, 8, GREEDY), Request(prompt, 8, GREEDY)]  # the second: 32 cached
        for r in reqs:
            _run(eng, [r])
        assert reqs[1].cached_tokens == 32
        if graphs:
            assert sum(g.replays for g in eng.runner.prefill_graphs.values()) >= 2
        runs[graphs] = [r.output_ids for r in reqs]
    assert runs[True] == runs[False]
