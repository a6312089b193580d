"""A step that runs out of device memory (deimos.engine.Engine._out_of_memory): with an offloaded
MoE the expert cache gives a step's room back (ExpertOffload.shed) and the step's sequences are
recomputed from their cached prefixes, so every request still ends with the answer it would
have had; without anything to give back, the step's sequences fail and the engine goes on.

Oracle: the same requests through an engine whose steps never fail (greedy). The out-of-memory
is raised by the real step's entry, ModelRunner.run, at a chosen call (what the caching
allocator raises when another process took the memory). The offloaded engine is the kernel
path on qwen3moe-tiny, the Triton kernels in the interpreter without CUDA, its experts on the
host behind an elastic cache whose free memory the test sets."""

from __future__ import annotations

import pytest
import torch
from kernel_device import DEVICE
from testdata import llama_cpp_path

from deimos.engine.engine import Engine, EngineConfig
from deimos.engine.request import EngineError, Request
from deimos.gguf import GGUFFile
from deimos.kernels.sampling import SamplingParams
from deimos.models import ARCHITECTURES, load_model
from deimos.models.gpu.offload import ExpertOffload
from deimos.models.weights import WeightSource
from deimos.runtime.gpu_memory import FreeMemory
from deimos.synth import write_model

DONOR = "models/ggml-vocab-llama-spm.gguf"
GREEDY = SamplingParams(temperature=0)


def _fail_at(engine: Engine, calls: set[int]) -> list[int]:
    """Make ``engine``'s runner raise an out-of-memory error at those calls of ``run`` (counted
    from 1), as the caching allocator does; returns the list the calls are counted in."""
    real, seen = engine.runner.run, []

    def run(plan):
        seen.append(1)
        if len(seen) in calls:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected by the test)")
        return real(plan)

    engine.runner.run = run
    return seen


def _drive(engine: Engine, reqs: list[Request]) -> list:
    seqs = [engine.add(r) for r in reqs]
    errors = []
    while engine.has_work:
        errors += [o.error for o in engine.step() if o.error is not None]
    assert all(s.finished for s in seqs)
    assert engine.blocks.n_used == 0
    engine.blocks.check()
    return errors


def _requests(n_vocab: int, n: int, lengths: tuple[int, ...] = (6, 19)) -> list[Request]:
    return [Request([(5 * i + 3 + k) % n_vocab for i in range(m)], n, GREEDY)
            for k, m in enumerate(lengths)]


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("oom") / "qwen3moe-tiny-Q8_0.gguf"
    write_model(path, "qwen3moe", "qwen3moe-tiny", "Q8_0", llama_cpp_path(DONOR), seed=13)
    return GGUFFile(path)


def _offloaded(f: GGUFFile) -> tuple[Engine, ExpertOffload]:
    ref = load_model(f)
    ker = ARCHITECTURES[ref.config.arch](ref.config, WeightSource(f, DEVICE, kernels=True,
                                                                  expert_device="cpu"))
    # an elastic cache on a card with room for every expert (E = 4, one chunk of slots); the
    # clock stands still, so a dropped chunk does not grow back during the test
    mem = FreeMemory(lambda: (64 << 30, 64 << 30), clock=lambda: 0.0)
    off = ExpertOffload(ker, f, torch.device(DEVICE), memory=mem)
    off.fix_share(0.0)
    ker.ops.attach_offload(off)
    return Engine(ker, EngineConfig(n_ctx=32, max_seqs=4)), off


def test_an_offloaded_step_out_of_memory_is_recomputed_with_fewer_slots(moe_file):
    n_vocab = load_model(moe_file).config.n_vocab
    clean, _ = _offloaded(moe_file)
    want = _requests(n_vocab, 2, (4, 9))
    assert _drive(clean, want) == []
    engine, off = _offloaded(moe_file)
    assert off.cache.n_slots == 4
    _fail_at(engine, {1})  # the first step: both prompts' chunks
    got = _requests(n_vocab, 2, (4, 9))
    assert _drive(engine, got) == []
    assert engine.memory_recoveries == 1 and engine.scheduler.preemptions >= 1
    assert off.cache.n_slots == 0 and off.cache.nbytes == 0 and off.stats.resizes == 1
    for w, g in zip(want, got):
        # every expert now on the host's path: ggml's products, within ~1e-3 of the device's;
        # the tiny model's top two tokens are far apart at these positions
        assert g.output_ids == w.output_ids and g.finish_reason == w.finish_reason
    # nothing left to give back: the next out-of-memory step fails its sequences, and only them
    _fail_at(engine, {1})  # counted anew
    failed = _requests(n_vocab, 1, (5,))
    errors = _drive(engine, failed)
    assert len(errors) == 1 and "OutOfMemoryError" in str(errors[0])
    assert engine.memory_recoveries == 1
    after = _requests(n_vocab, 1, (5,))
    assert _drive(engine, after) == [] and len(after[0].output_ids) == 1


def test_a_step_out_of_memory_with_nothing_to_give_back_fails_its_sequences_only(tmp_path):
    path = tmp_path / "llama-tiny-Q8_0.gguf"
    write_model(path, "llama", "llama-tiny", "Q8_0", llama_cpp_path(DONOR), seed=5)
    model = load_model(GGUFFile(path))
    engine = Engine(model, EngineConfig(n_ctx=64, max_seqs=4))
    _fail_at(engine, {1})
    failed = _requests(model.config.n_vocab, 4)
    errors = _drive(engine, failed)
    assert len(errors) == 2 and all(isinstance(e, EngineError) and "OutOfMemoryError" in str(e)
                                    for e in errors)
    assert engine.memory_recoveries == 0
    assert all(r.finish_reason is None or not r.output_ids for r in failed)
    after = _requests(model.config.n_vocab, 4)  # the engine serves the next requests
    assert _drive(engine, after) == []
    assert all(len(r.output_ids) == 4 for r in after)


@pytest.mark.gpu
def test_gpu_hybrid_offloaded_step_out_of_memory_is_recomputed(tmp_path):
    """qwen35moe (recurrent states in the state pool, prompt chunks snapshotted at block
    boundaries) with its experts on the host: a step that runs out of memory mid-prompt is
    recomputed from the cached prefix and its state snapshot, and the greedy tokens are the
    clean run's (every miss on the CPU in both) up to where the clean run's top two are a
    near-tie: the recomputed prompt is chunked differently (from the snapshot at 16, not 24),
    so the recurrent state's sums run in another order. Reproduced in the interpreter: the
    long prompt's second token had a top-two gap of 0.022 nats and flipped."""
    from deimos.engine import LLM

    path = write_model(tmp_path / "q8.gguf", "qwen35moe", "qwen35moe-tiny", "Q8_0",
                       llama_cpp_path(DONOR), seed=12)
    prompts = [[(7 * i + k) % 30000 for i in range(m)] for k, m in ((1, 40), (2, 9))]
    got = {}
    for fail in (set(), {2}):  # the second step: the long prompt's second chunk
        llm = LLM(path, n_ctx=128, device="cuda", experts="cpu", max_seqs=2, max_batch_tokens=24,
                  block_size=16)
        llm.offload.fix_share(0.0)
        if llm.offload.cache.n_slots == 0:
            pytest.skip("no room for an expert slot on this card")
        _fail_at(llm.engine, fail)
        reqs = [Request(p, 8, GREEDY, top_logprobs=2) for p in prompts]
        assert _drive(llm.engine, reqs) == []
        assert llm.engine.memory_recoveries == len(fail)
        got[bool(fail)] = reqs
    for clean, again in zip(got[False], got[True]):
        for i, (a, b) in enumerate(zip(clean.output_ids, again.output_ids)):
            if a != b:
                top = clean.token_logprobs[i].top_logprobs
                assert top[0] - top[1] < 0.05, f"token {i}: {a} != {b} with a top-two gap of {top[0] - top[1]:.3f}"
                break
