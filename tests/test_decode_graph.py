"""Decode as one CUDA graph (deimos.runtime.graph) and GPU memory over many requests.

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
from deimos.runtime.graph import DecodeGraph
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
    """The generator's cache and graph are made once; prefill chunks of every length then
    reuse the allocator's blocks: reserved memory after the 100th request is what it was
    after the 20th."""
    gen = Generator(model, 700, device="cuda")
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
    assert reserved[-1] <= reserved[19]
