"""Decode and prefill as CUDA graphs (deimos.runtime.graph) and GPU memory over many requests.

Oracle: the same model's eager steps (the graph replays the same kernels, so logits agree to
float rounding of the same operations, and greedy tokens are identical). All gpu-marked:
CUDA graphs need a GPU. External needs: the llama-spm vocab donor (the tiny synth files are
written here).
"""

from __future__ import annotations

import pytest
import torch
from testdata import llama_cpp_path

from deimos.engine.generator import Generator
from deimos.engine.request import Request
from deimos.gguf import GGUFFile
from deimos.kernels.sampling import SamplingParams
from deimos.models import load_model
from deimos.models.batch import Batch
from deimos.runtime.graph import DecodeGraph, PrefillGraphs
from deimos.runtime.kv_cache import KVCache
from deimos.synth import write_model

pytestmark = pytest.mark.gpu
DONOR = "models/ggml-vocab-llama-spm.gguf"


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("graph") / f"{request.param}.gguf"
    write_model(path, request.param, f"{request.param}-tiny", "Q4_K_M", llama_cpp_path(DONOR), seed=11)
    return load_model(GGUFFile(path), device="cuda")


def _prefill(model, kv, prompt):
    t = torch.tensor(prompt, device="cuda")
    return model.forward(Batch(t, torch.arange(len(prompt), device="cuda"), kv))[0]


def test_graph_replay_matches_eager_steps(model) -> None:
    prompt = list(range(5, 25))
    n = 24
    kv_e = KVCache(model.config, 64, device="cuda")
    kv_g = KVCache(model.config, 64, device="cuda")
    tok = int(torch.argmax(_prefill(model, kv_e, prompt)))
    assert tok == int(torch.argmax(_prefill(model, kv_g, prompt)))
    graph = DecodeGraph(model, kv_g)
    for i in range(n):
        pos = torch.tensor([kv_e.length], device="cuda")
        eager = model.forward(Batch(torch.tensor([tok], device="cuda"), pos, kv_e))[0]
        replayed = graph.step(tok).clone()
        torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-4, msg=f"step {i}")
        tok = int(torch.argmax(eager))
        assert tok == int(torch.argmax(replayed))
    assert graph.replays == n and kv_g.length == kv_e.length == len(prompt) + n


def test_graph_step_allocates_nothing(model) -> None:
    kv = KVCache(model.config, 256, device="cuda")
    _prefill(model, kv, [1, 2, 3])
    graph = DecodeGraph(model, kv)
    graph.step(7)  # captures
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    tok = 7
    for _ in range(100):
        tok = int(torch.argmax(graph.step(tok)))
    assert torch.cuda.memory_allocated() == allocated
    assert torch.cuda.memory_reserved() == reserved
    assert graph.replays == 101 and kv.length == 104


def test_memory_flat_over_a_hundred_requests_of_different_lengths(model) -> None:
    """The generator's cache and graphs are made (and captured: ``warm``) once; prompts of
    every length then replay them: reserved memory after the 100th request is what it was
    after the first."""
    gen = Generator(model, 700, device="cuda")
    gen.warm()
    g = torch.Generator().manual_seed(3)
    reserved = []
    for i in range(100):
        n = int(torch.randint(1, 600, (1,), generator=g))
        prompt = torch.randint(0, model.config.n_vocab, (n,), generator=g).tolist()
        req = Request(prompt, 4, SamplingParams(temperature=0.0))
        assert len(list(gen.run(req))) == 4
        torch.cuda.synchronize()
        reserved.append(torch.cuda.memory_reserved())
    print(f"reserved MB after requests 1, 20, 100: {reserved[0] / 2**20:.1f}, "
          f"{reserved[19] / 2**20:.1f}, {reserved[-1] / 2**20:.1f}")
    assert gen.graph is not None and gen.graph.captured
    assert all(g.captured for g in gen.prefill_graphs.graphs.values())
    assert reserved[-1] <= reserved[0]


def test_prefill_graphs_match_eager_chunks(model) -> None:
    """Chunks of 37 (bucket 64, padded) and 16 (exact bucket) tokens after a 20-token prefix:
    the replayed logits and the cache rows they leave equal eager forwards'."""
    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(0, model.config.n_vocab, (73,), generator=g).tolist()
    kv_e = KVCache(model.config, 200, device="cuda")
    kv_g = KVCache(model.config, 200, device="cuda")
    graphs = PrefillGraphs(model, kv_g)
    for a, b in ((0, 20), (20, 57), (57, 73)):
        chunk = prompt[a:b]
        t = torch.tensor(chunk, device="cuda")
        eager = model.forward(Batch(t, torch.arange(a, b, device="cuda"), kv_e))[0]
        replayed = graphs.run(chunk)
        assert replayed is not None
        # other row counts pick other matmul tiles: agreement to fp16-product rounding
        rel = ((replayed - eager).norm() / eager.norm()).item()
        assert rel < 1e-3, f"chunk {a}:{b}: logits relative RMS error {rel:.2e}"
    assert kv_g.length == kv_e.length == 73
    for layer in (0, len(kv_e.k) - 1):
        for got, want in ((kv_g.k[layer][:73], kv_e.k[layer][:73]), (kv_g.v[layer][:73], kv_e.v[layer][:73])):
            rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
            assert rel < 2e-3, f"layer {layer} cache rows: relative RMS error {rel:.2e}"
    assert graphs.graphs[64].replays == 1 and graphs.graphs[16].replays == 1
    assert graphs.graphs[32].replays == 1  # the 20-token prefix
    # no room for a padded bucket near the end of the cache: the caller goes eager
    small = KVCache(model.config, 70, device="cuda")
    small_graphs = PrefillGraphs(model, small)
    assert small_graphs.run(prompt[:60]) is not None and small.length == 60  # bucket 64 <= 70
    assert small_graphs.run(prompt[:9]) is None and small.length == 60  # 60 + 16 > 70


def test_generator_graphs_match_eager_generator(model) -> None:
    eager = Generator(model, 300, device="cuda", cuda_graph=False)
    graphed = Generator(model, 300, device="cuda")
    assert eager.graph is None and graphed.prefill_graphs is not None
    g = torch.Generator().manual_seed(4)
    for n in (3, 40, 130):
        prompt = torch.randint(0, model.config.n_vocab, (n,), generator=g).tolist()
        a = list(eager.run(Request(prompt, 12, SamplingParams(temperature=0.0))))
        b = list(graphed.run(Request(prompt, 12, SamplingParams(temperature=0.0))))
        assert a == b, f"prompt of {n}: {a} vs {b}"


def test_greedy_chain_stops_and_limits_like_the_eager_loop(model) -> None:
    """Greedy requests run as a chain of replays a step ahead of the host (the graph's own
    argmax feeds the next replay): the same tokens and finish reasons as the eager loop when
    a stop token, max_tokens or the context ends them, and the cache left consistent with
    what the generator records (a follow-up request reusing the prefix agrees too)."""
    greedy = SamplingParams(temperature=0.0)
    eager = Generator(model, 60, device="cuda", cuda_graph=False)
    chained = Generator(model, 60, device="cuda")
    prompt = torch.randint(0, model.config.n_vocab, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    full = list(eager.run(Request(prompt, 30, greedy)))
    stop = full[6]
    cases = [(30, frozenset(), "length"), (30, frozenset({stop}), "stop"), (50, frozenset(), "length"),
             (1, frozenset(), "length"), (2, frozenset(), "length")]
    for max_tokens, stops, reason in cases:
        for gen in (eager, chained):
            gen.reset()
        a, b = Request(prompt, max_tokens, greedy, stops), Request(prompt, max_tokens, greedy, stops)
        got_a, got_b = list(eager.run(a)), list(chained.run(b))
        assert got_a == got_b, f"max_tokens {max_tokens}, stops {set(stops)}"
        assert a.finish_reason == b.finish_reason == reason
        assert chained.kv.length == len(chained.cached) <= 60
        assert chained.cached[: len(prompt) + len(got_b) - 1] == prompt + got_b[:-1]
        follow = prompt + got_b + [5, 6, 7]
        if len(follow) < 60:
            assert list(eager.run(Request(follow, 5, greedy))) == list(chained.run(Request(follow, 5, greedy)))
    # the 50-token request ended at the context: prompt + outputs - 1 rows fed = 60
    assert chained.graph.replays > 0


def test_generator_samples_on_the_device(model, monkeypatch) -> None:
    """top-k/top-p/min-p, penalties and a seeded draw run on the GPU logits (the vocabulary is
    not copied to the host); the same seed gives the same tokens."""
    from deimos.kernels.sampling import Sampler

    seen = []
    sample = Sampler.sample
    monkeypatch.setattr(Sampler, "sample", lambda self, x: (seen.append(x.device.type), sample(self, x))[1])
    gen = Generator(model, 300, device="cuda")
    prompt = torch.randint(0, model.config.n_vocab, (20,), generator=torch.Generator().manual_seed(6)).tolist()
    p = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.05, repetition_penalty=1.1, seed=5)
    a = list(gen.run(Request(prompt, 16, p)))
    gen.reset()  # the same path again (a reused prefix would end the prompt in a decode step:
    b = list(gen.run(Request(prompt, 16, p)))  # other rounding, another draw on flat logits)
    assert a == b and len(a) == 16 and all(0 <= t < model.config.n_vocab for t in a)
    assert set(seen) == {"cuda"}


def test_step_graph_rejects_what_it_cannot_run(model) -> None:
    from deimos.runtime.graph import StepGraph

    kv = KVCache(model.config, 40, device="cuda")
    graph = StepGraph(model, kv, 16)
    with pytest.raises(ValueError, match="17 tokens for a graph of 16"):
        graph.run(list(range(17)))
    with pytest.raises(ValueError, match="0 tokens"):
        graph.run([])
    kv.commit(30)  # 30 + 16 rows > 40: no room for the padded step
    with pytest.raises(ValueError, match="pass the cache"):
        graph.run([1, 2])
    assert kv.length == 30
