"""Routed experts on the host behind a GPU cache of slots (deimos.models.gpu.offload): the cache
never changes the answer, and it follows the card's free memory.

Oracle: deimos.models.moe.moe_reference on the CPU reference model's block of the same file.
Not gpu-marked: qwen3moe-tiny blocks with the kernels under TRITON_INTERPRET=1 (the "device"
and the host are both the CPU there), with 0 slots (every expert on the CPU path), some slots
and every expert resident, before and after promotions; the elastic size with a test-owned
free-memory value and clock. gpu-marked: whole files on the GPU, greedy tokens equal with 0,
some and all slots.
"""

from __future__ import annotations

import logging
import numpy as np
import pytest
import torch

from kernel_device import DEVICE  # noqa: I001  (first: sets TRITON_INTERPRET)

from testdata import llama_cpp_path  # noqa: E402

from deimos.gguf import GGUFFile  # noqa: E402
from deimos.models import ARCHITECTURES, load_model  # noqa: E402
from deimos.models.gpu.offload import ExpertOffload  # noqa: E402
from deimos.models.moe import moe_reference  # noqa: E402
from deimos.models.weights import WeightSource  # noqa: E402
from deimos.runtime.gpu_memory import FreeMemory  # noqa: E402
from deimos.synth import write_model  # noqa: E402

DONOR = "models/ggml-vocab-llama-spm.gguf"


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("offload") / "qwen3moe-tiny-Q8_0.gguf"
    write_model(path, "qwen3moe", "qwen3moe-tiny", "Q8_0", llama_cpp_path(DONOR), seed=13)
    return GGUFFile(path)


@pytest.fixture(scope="module")
def models(moe_file):
    ref = load_model(moe_file)
    ker = ARCHITECTURES[ref.config.arch](ref.config, WeightSource(moe_file, DEVICE, kernels=True,
                                                                  expert_device="cpu"))
    return ref, ker


def test_misses_on_the_exact_fallback_are_announced(moe_file, models, caplog):
    """Without ggml's kernels for the misses (ggml-python not installed, or no kernel for a
    format) the offload says so once at load, with the package that gives them; a cache of
    every expert (no misses) or ggml's kernels say nothing."""
    from deimos.runtime.cpu_experts import CpuExperts, LayerExperts

    _, ker = models
    blocks = [layer.moe for layer in ker.layers if getattr(layer, "moe", None) is not None]
    layers = [LayerExperts.from_gguf(moe_file, b.layer) for b in blocks]
    e = blocks[0].n_expert
    cases = [(CpuExperts(layers, backend="exact"), 0, True), (CpuExperts(layers, backend="exact"), e, False)]
    try:
        cases.append((CpuExperts(layers, backend="ggml"), 0, False))
    except ValueError:  # ggml-python is not installed: the two cases above still run
        pass
    for cpu, slots, warned in cases:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="deimos"):
            ExpertOffload(ker, moe_file, torch.device(DEVICE), n_slots=slots, cpu=cpu)
        said = [r.getMessage() for r in caplog.records if "exact fallback" in r.getMessage()]
        assert bool(said) == warned, (cpu.backend(0), slots, said)
        if warned:
            assert "deimos-llm[cpu-experts]" in said[0] and f"{len(blocks)} MoE layers" in said[0]


def _x(t: int, d: int, seed: int) -> torch.Tensor:
    return torch.randn(t, d, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("slots", [0, 2, 4])
def test_the_cache_never_changes_the_answer(moe_file, models, slots):
    ref, ker = models
    off = ExpertOffload(ker, moe_file, torch.device(DEVICE), n_slots=slots)
    assert off.cache.n_slots == slots
    layer = 2
    block, ref_block = ker.layers[layer].moe, ref.layers[layer].moe
    for step, t in enumerate((1, 3, 1, 3)):  # promotions happen between the steps
        x = _x(t, ref.config.n_embd, 10 * slots + step)
        want = moe_reference(x, ref_block)
        got = off.moe(x.to(DEVICE), block).cpu()
        rel = ((got - want).norm() / want.norm()).item()
        assert rel < 2e-2, f"{slots} slots, step {step}: relative error {rel:.2e}"
        off.between_steps()
    lay = off.cache.layers[off.index[layer]]
    assert lay.hits + lay.misses == 8 * block.n_expert_used
    if slots == 0:
        assert lay.hits == 0 and off.stats.cpu_experts == 8 * block.n_expert_used
    else:  # misses were promoted: later steps hit
        assert lay.hits > 0 and len(lay.resident) > 0
    if slots == 4:
        assert off.stats.cpu_experts < 8 * block.n_expert_used


class _Box:
    """The host side of a HostMailbox (numpy arrays and the decided / answered marks) for a
    captured step's answer without a GPU."""

    def __init__(self, n_layer: int, k: int, d: int, n_expert: int, seed: int):
        rng = np.random.default_rng(seed)
        self.np_ids = np.stack([rng.permutation(n_expert)[:k] for _ in range(n_layer)]).astype(np.int32)[:, None]
        self.np_weights = rng.random((n_layer, 1, k), dtype=np.float32)
        self.np_x = rng.standard_normal((n_layer, 1, d), dtype=np.float32)
        self.np_out = np.full((n_layer, 1, d), np.nan, dtype=np.float32)  # poisoned: all rewritten
        self.np_table = np.full((n_layer, n_expert), 7, dtype=np.int32)
        self.marks: list[tuple[str, int]] = []

    def decide(self, i: int) -> None:
        self.marks.append(("decided", i))

    def answer(self, i: int) -> None:
        self.marks.append(("answered", i))


@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("slots", [0, 3])
def test_a_token_layer_is_answered_as_the_rows_path_answers_it(moe_file, models, slots, share):
    """A captured one-token step's host side (ExpertOffload._answer_token) splits a layer's
    misses between the device and the CPU and sums the CPU's share exactly as the general
    path does (token_path False): the same answer rows bit for bit, the same table of the
    device's share, the same statistics and cache counts; decided before answered."""
    _, ker = models
    runs = []
    for token_path in (True, False):
        off = ExpertOffload(ker, moe_file, torch.device(DEVICE), n_slots=slots)
        for lay in off.cache.layers:  # the same residents for both paths: experts 0..slots-1
            lay.slot_of_host[:slots] = np.arange(slots)
        with pytest.raises(ValueError, match="outside"):
            off.fix_share(1.5)
        off.token_path = token_path
        off.fix_share(share)
        block = off.blocks[0]
        box = _Box(len(off.blocks), block.n_expert_used, ker.config.n_embd, off.n_expert, seed=21)
        box.np_ids[0, 0, :2] = [0, off.n_expert - 1]  # a resident and the last expert
        off.mailbox = box
        off._promo_ok = off.cache.batch_ready()  # serve_step's start of a step
        missed = [off._answer(i, 1, promote=True) for i in range(len(off.blocks))]
        # a layer's promotion is claimed, not started: the step's copies start after its last layer
        assert not any(lay.pending for lay in off.cache.layers)
        assert len(off._promos) == (sum(m > 0 for m in missed) if slots else 0)
        runs.append((box, missed, off.stats, [(lay.hits, lay.misses) for lay in off.cache.layers],
                     list(off._promos)))
        off.cache.start_batch(off._promos, off.stream)
        for i, e, s in off._promos:
            assert off.cache.layers[i].pending[s][0] == e
    (a, missed_a, stats_a, counts_a, promos_a), (b, missed_b, stats_b, counts_b, promos_b) = runs
    assert promos_a == promos_b
    assert np.array_equal(a.np_out, b.np_out) and not np.isnan(a.np_out).any()
    assert np.array_equal(a.np_table, b.np_table) and a.marks == b.marks
    assert a.marks[:2] == [("decided", 0), ("answered", 0)]
    assert missed_a == missed_b and stats_a == stats_b and counts_a == counts_b
    if slots == 0:
        k = ker.layers[0].moe.n_expert_used if hasattr(ker.layers[0], "moe") else None
        assert stats_a.cpu_experts + stats_a.host_read_experts == sum(missed_a) == k * len(missed_a)
    if share == 0:
        assert (a.np_table == -1).all()
    else:
        assert stats_a.host_read_experts > 0


@pytest.mark.parametrize("slots", [0, 2])
def test_a_long_step_streams_its_misses_to_the_device(moe_file, models, slots):
    """A prompt chunk (STREAM_TOKENS or more tokens): the missed experts are copied to the
    device for the step and computed there, none on the CPU, the same answer."""
    from deimos.models.gpu.offload import STREAM_TOKENS

    ref, ker = models
    off = ExpertOffload(ker, moe_file, torch.device(DEVICE), n_slots=slots)
    x = _x(STREAM_TOKENS + 3, ref.config.n_embd, 7)
    want = moe_reference(x, ref.layers[0].moe)
    got = off.moe(x.to(DEVICE), ker.layers[0].moe).cpu()
    assert ((got - want).norm() / want.norm()).item() < 2e-2
    assert off.stats.cpu_experts == 0 and off.stats.streamed_experts > 0


def test_without_room_to_stage_the_kernels_read_the_host_copy(moe_file, models, monkeypatch):
    """A prompt chunk whose staging stacks cannot be allocated: its missed experts are read by
    the kernels from the (pinned) host copy through a one-chunk address table, the same
    answer, none computed on the CPU."""
    from deimos.models.gpu.offload import STREAM_TOKENS

    ref, ker = models
    off = ExpertOffload(ker, moe_file, torch.device(DEVICE), n_slots=0)

    def no_room(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("test: no room for the staging stacks")

    monkeypatch.setattr(off.stager, "stage", no_room)
    x = _x(STREAM_TOKENS + 2, ref.config.n_embd, 6)
    want = moe_reference(x, ref.layers[1].moe)
    got = off.moe(x.to(DEVICE), ker.layers[1].moe).cpu()
    assert ((got - want).norm() / want.norm()).item() < 2e-2
    assert off.stats.host_read_experts > 0 and off.stats.cpu_experts == 0
    # one token through the decode GEMVs on the same table: a captured step's device share
    import numpy as np

    from deimos.kernels.triton.moe_route import moe_combine
    from deimos.models.gpu.moe_ops import route

    block = ker.layers[1].moe
    x1 = _x(1, ref.config.n_embd, 7)
    weights, ids = route(x1.to(DEVICE), block)
    chosen = np.unique(ids.cpu().numpy()).astype(np.int64)
    got1 = moe_combine(off._host_read(x1.to(DEVICE), block, off.index[block.layer], ids, chosen), weights)
    want1 = moe_reference(x1, ref.layers[1].moe)
    assert ((got1.cpu() - want1).norm() / want1.norm()).item() < 2e-2


def test_a_long_step_fills_the_free_slots_with_its_misses(moe_file, models):
    """A prompt chunk's missed experts go into the cache's free slots (no eviction), computed
    there: the answer is the same, the cache is full after it, and the next token hits."""
    from deimos.models.gpu.offload import STREAM_TOKENS

    ref, ker = models
    off = ExpertOffload(ker, moe_file, torch.device(DEVICE), n_slots=4)
    lay = off.cache.layers[0]
    assert len(lay.resident) == 0
    x = _x(STREAM_TOKENS + 5, ref.config.n_embd, 8)
    want = moe_reference(x, ref.layers[0].moe)
    got = off.moe(x.to(DEVICE), ker.layers[0].moe).cpu()
    assert ((got - want).norm() / want.norm()).item() < 2e-2
    assert off.stats.filled_experts == len(lay.resident) == 4 and off.stats.streamed_experts == 0
    x1 = _x(1, ref.config.n_embd, 9)
    misses = lay.misses
    got1 = off.moe(x1.to(DEVICE), ker.layers[0].moe).cpu()
    want1 = moe_reference(x1, ref.layers[0].moe)
    assert ((got1 - want1).norm() / want1.norm()).item() < 2e-2
    assert off.stats.cpu_experts == 0 and lay.misses == misses  # every expert resident: no miss


def test_staging_runs_are_the_consecutive_ids():
    import numpy as np

    from deimos.runtime.expert_stream import runs

    assert runs(np.array([0, 1, 2, 5, 7, 8], dtype=np.int64)) == [(0, 3, 0), (5, 1, 3), (7, 2, 4)]
    assert runs(np.array([3], dtype=np.int64)) == [(3, 1, 0)] and runs(np.array([], dtype=np.int64)) == []


def test_a_long_step_stages_each_layer_a_layer_ahead(tmp_path):
    """A prompt chunk through MoE layers 2 and 3, then the last, of a Q4_K_M file (its layers'
    down projections Q4_K or Q6_K: one byte ring carved per layer): each layer staged once,
    the next layer's staging made while the layer before runs (none past the last), every
    answer the reference's; the routing is recorded for the cache's policy at the next
    between_steps, which also drops the staging of a layer the step never ran (layer 4)."""
    from deimos.models.gpu.offload import STREAM_TOKENS

    path = tmp_path / "qwen3moe-tiny-Q4_K_M.gguf"
    write_model(path, "qwen3moe", "qwen3moe-tiny", "Q4_K_M", llama_cpp_path(DONOR), seed=5)
    f = GGUFFile(path)
    ref = load_model(f)
    ker = ARCHITECTURES[ref.config.arch](ref.config, WeightSource(f, DEVICE, kernels=True, expert_device="cpu"))
    off = ExpertOffload(ker, f, torch.device(DEVICE), n_slots=1)
    n = len(off.blocks)
    downs = [off.cache.layers[i].host.parts["down"][0].name for i in (2, 3, n - 1)]
    assert downs == ["Q4_K", "Q6_K", "Q6_K"]
    staged_for = []
    stage = off.stager.stage
    off.stager.stage = lambda lay, fill=True: staged_for.append(off.cache.layers.index(lay)) or stage(lay, fill)
    t = STREAM_TOKENS + 1
    for i, after in ((2, [3]), (3, [4]), (n - 1, [4])):
        block = off.blocks[i]
        x = _x(t, ref.config.n_embd, 40 + i)
        want = moe_reference(x, ref.layers[block.layer].moe)
        got = off.moe(x.to(DEVICE), block).cpu()
        assert ((got - want).norm() / want.norm()).item() < 2e-2, f"layer {block.layer}"
        assert sorted(off._staged) == after
    assert staged_for == [2, 3, 4, n - 1]
    # both ring buffers made at their most at once (never regrown): what the sizing keeps free
    from deimos.runtime.expert_stream import RING, ExpertStager

    assert all(b is not None for b in off.stager.buffers)
    assert off.stager.nbytes == off.stage_bytes == ExpertStager.peak_bytes(off.cache.layers)
    most = max(off.cache.layers[i].host.expert_nbytes for i in (2, 3, n - 1)) * off.n_expert
    assert RING * most <= off.stage_bytes < RING * (most + (8 << 20) + 4096)
    assert off.stats.filled_experts == 3 and off.stats.streamed_experts == 3 * (off.n_expert - 1)  # layers run
    assert off.stats.cpu_experts == 0
    layers = off.cache.layers
    assert all(lay.hits + lay.misses == 0 for lay in layers)  # recorded after the step
    off.between_steps()
    k = off.blocks[0].n_expert_used
    assert [lay.hits + lay.misses for lay in layers] == [t * k if i in (2, 3, n - 1) else 0 for i in range(n)]
    assert not off._staged and len(layers[4].resident) == 1  # its free slot was filled


def test_the_cache_follows_free_memory(moe_file, models):
    ref, ker = models
    state = {"free": 0, "t": 0.0}
    total = 64 << 30
    mem = FreeMemory(lambda: (state["free"], total), clock=lambda: state["t"])
    off = ExpertOffload(ker, moe_file, torch.device(DEVICE), memory=mem)
    assert off.cache.n_slots == 0  # nothing free: every expert on the CPU
    # the staging ring's most is kept free with the step's bytes (a prompt chunk's experts)
    assert off.stage_bytes > 0 and off.sizer.step_bytes == off.stage_bytes
    off.set_step_bytes(1 << 20)
    assert off.sizer.step_bytes == (1 << 20) + off.stage_bytes
    slot = off.cache.slot_nbytes
    state["free"] = off.sizer.headroom + off.sizer.band + 40 * slot  # room for every expert
    state["t"] += 0.2  # past the reader's 100 ms: the new value is read
    off.between_steps()
    assert off.cache.n_slots == 0  # growth waits until the room has lasted a second
    state["t"] += 0.5
    off.between_steps()
    assert off.cache.n_slots == 0
    state["t"] += 0.6
    off.between_steps()
    assert off.cache.n_slots == 4  # E = 4: all
    block = ker.layers[1].moe
    x = _x(1, ref.config.n_embd, 3)
    before = off.moe(x.to(DEVICE), block).cpu()
    state["free"] = 0  # another process took the card
    state["t"] += 0.2
    off.between_steps()
    assert off.cache.n_slots == 0 and off.cache.nbytes == 0
    after = off.moe(x.to(DEVICE), block).cpu()
    want = moe_reference(x, ref.layers[1].moe)
    for got in (before, after):
        assert ((got - want).norm() / want.norm()).item() < 2e-2
    assert off.stats.resizes == 2
    n = off.numbers()
    assert n["expert_slots"] == 0 and 0 <= n["expert_hit_rate"] <= 1 and n["cpu_experts_per_token"] > 0
    # a prompt chunk's staging buffers, once held, count as used: only the rest is kept free
    from deimos.models.gpu.offload import STREAM_TOKENS

    off.set_step_bytes(0)
    off.moe(_x(STREAM_TOKENS + 1, ref.config.n_embd, 4).to(DEVICE), block)
    held = off.stager.nbytes
    assert held > 0
    off.between_steps()
    assert off.sizer.step_bytes == off.stage_bytes - held


def test_decode_steps_let_the_cache_grow_into_what_prompt_chunks_keep_free(moe_file, models):
    """A long step (a prompt chunk) keeps its activations and the staging ring free; a short
    one (decode) keeps only a decode's activations: at the first short step the ring goes back
    and the cache takes that room at once (it is the process's own: no growth's wait), as far
    as the card's free memory allows; the next long step takes it back at once. The card's
    free memory here is a fixed amount less what the offload itself holds."""
    from deimos.models.gpu.offload import STREAM_TOKENS
    from deimos.runtime.gpu_memory import headroom

    ref, ker = models
    state = {"t": 0.0, "off": None, "base": 0}

    def free() -> tuple[int, int]:
        off = state["off"]
        held = 0 if off is None else off.cache.nbytes + off.stager.nbytes
        return state["base"] - held, 64 << 30

    probe = ExpertOffload(ker, moe_file, torch.device(DEVICE), n_slots=4)
    chunk, stage, short = probe.cache.nbytes, probe.stage_bytes, probe._short_bytes
    h = headroom(1 << 30)  # a card this small: the headroom's least (512 MiB)
    band = max(probe.cache.slot_nbytes * probe.cache.slots_per_chunk, 256 << 20)
    # every expert fits beside a decode's activations, not beside a prompt chunk's
    state["base"] = h + band + short + chunk + chunk // 2
    step = band + short + 2 * chunk
    mem = FreeMemory(free, clock=lambda: state["t"])
    off = ExpertOffload(ker, moe_file, torch.device(DEVICE), memory=mem)
    state["off"] = off
    off.set_step_bytes(step)
    assert off.sizer.headroom == h + off.sizer.step_bytes and off.sizer.band == band and stage > 0
    off.between_steps(STREAM_TOKENS)  # a prompt chunk: its room kept free
    assert off.cache.n_slots == 0
    block = ker.layers[1].moe
    off.moe(_x(STREAM_TOKENS + 1, ref.config.n_embd, 4).to(DEVICE), block)
    assert off.stager.nbytes > 0  # the ring's buffers, held
    state["t"] = 0.05  # within the reader's 100 ms: only a reading marked stale is read again
    off.between_steps(1)  # decode: the ring goes back, the cache takes the room at once
    assert off.stager.nbytes == 0 and off.cache.n_slots == 4
    # and its new slots are filled at once with the most used experts (all four here: E = 4)
    off.cache.poll(wait=True)
    assert all(sorted(lay.resident.tolist()) == [0, 1, 2, 3] for lay in off.cache.layers)
    assert off.stats.filled_experts == 4 * len(off.cache.layers)
    before = off.moe(_x(1, ref.config.n_embd, 3).to(DEVICE), block).cpu()
    off.between_steps(1)
    assert off.cache.n_slots == 4 and off.stats.resizes == 1  # one growth, nothing more
    state["t"] = 0.1
    off.between_steps(STREAM_TOKENS)  # the next prompt chunk takes its room back at once
    assert off.cache.n_slots == 0 and off.cache.nbytes == 0
    after = off.moe(_x(1, ref.config.n_embd, 3).to(DEVICE), block).cpu()
    want = moe_reference(_x(1, ref.config.n_embd, 3), ref.layers[1].moe)
    for got in (before, after):
        assert ((got - want).norm() / want.norm()).item() < 2e-2
    state["base"] -= chunk  # another process took a chunk's worth meanwhile
    state["t"] = 0.3
    off.between_steps(1)  # the room is taken only where the card has it
    assert off.cache.n_slots == 0
    state["base"] += chunk  # and gave it back: growing into it waits its second
    state["t"] = 0.5
    off.between_steps(1)
    assert off.cache.n_slots == 0
    state["t"] = 1.6
    off.between_steps(1)
    assert off.cache.n_slots == 4
    state["t"] = 1.8
    off.between_steps()  # a step of unknown length is sized as a long one
    assert off.cache.n_slots == 0


TIE = 0.1  # reference top-2 logprob gap under which int8 activations may flip a token


@pytest.mark.gpu
def test_gpu_greedy_tokens_with_none_some_and_all_slots(moe_file):
    from deimos.engine import LLM
    from deimos.engine.request import Request
    from deimos.kernels.sampling import SamplingParams

    greedy = SamplingParams(temperature=0)
    prompt = torch.randint(0, 30000, (21,), generator=torch.Generator().manual_seed(4)).tolist()
    ref = LLM(moe_file.path, n_ctx=128)
    want = ref.run_many([Request(prompt, 16, greedy, top_logprobs=2)])[0]
    got = {}
    for gib in (0.0, 0.006, 1.0):  # no slot, about two, every expert
        llm = LLM(moe_file.path, n_ctx=128, device="cuda", experts="cpu", expert_cache_gib=gib)
        assert llm.offload is not None
        got[gib] = llm.run_many([Request(prompt, 16, greedy)])[0].output_ids
        print(gib, llm.offload.numbers(), got[gib])
    for gib, ids in got.items():
        same_up_to_a_tie(want, ids, f"{gib} GiB")


def same_up_to_a_tie(want, ids: list[int], who: str) -> None:
    """The reference's tokens, up to its first near-tie (the reference's margin shown)."""
    for i, (a, b) in enumerate(zip(want.output_ids, ids)):
        if a != b:
            lp = want.token_logprobs[i]
            gap = lp.top_logprobs[0] - lp.top_logprobs[1]
            assert gap < TIE, f"{who}: step {i} gives {b}, the reference {a} (gap {gap:.3f})"
            break


@pytest.mark.gpu
@pytest.mark.parametrize("gib", [0.0, 0.006])
def test_gpu_decode_graphs_answer_as_the_eager_steps(moe_file, gib, monkeypatch):
    """Decode steps captured as graphs (the host answering each layer through the mailbox
    after the launch) give the eager steps' tokens exactly, one sequence and three at once
    (a bucket of 4: a padding row), with misses computed on the CPU in both. With a cache the
    two differ in which experts are resident (promotions land at other points), so the CPU's
    misses dot two activation planes here, the hits' precision: with the engine's one
    (llama.cpp's arithmetic, ~1% an expert) a near-tie may go either way."""
    from deimos.engine import LLM
    from deimos.engine.request import Request
    from deimos.kernels.sampling import SamplingParams
    from deimos.models.gpu import offload

    monkeypatch.setattr(offload, "CPU_PLANES", 2)

    greedy = SamplingParams(temperature=0)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 30000, (n,), generator=g).tolist() for n in (13, 5, 22)]
    got = {}
    for graphs in (False, True):
        llm = LLM(moe_file.path, n_ctx=128, device="cuda", experts="cpu", expert_cache_gib=gib,
                  max_seqs=4, cuda_graphs=graphs)
        assert 0 < llm.offload.gpu_share < 1  # calibrated at load
        llm.offload.fix_share(0.0)  # every miss on the CPU, as the eager steps
        one = llm.run_many([Request(prompts[0], 12, greedy)])[0].output_ids
        many = [r.output_ids for r in llm.run_many([Request(p, 12, greedy) for p in prompts])]
        replays = sum(gr.replays for gr in llm.engine.runner.decode_graphs.values())
        assert (replays > 0) == graphs
        assert llm.offload.stats.cpu_experts > 0
        got[graphs] = (one, many)
    assert got[True] == got[False]


@pytest.mark.gpu
def test_gpu_misses_read_from_host_memory_by_the_device(moe_file):
    """A captured step's misses read by the device's kernels from the pinned host copy (every
    miss: gpu_share 1) give the CPU reference's tokens up to a near-tie, none on the CPU."""
    from deimos.engine import LLM
    from deimos.engine.request import Request
    from deimos.kernels.sampling import SamplingParams

    greedy = SamplingParams(temperature=0)
    prompt = torch.randint(0, 30000, (17,), generator=torch.Generator().manual_seed(5)).tolist()
    want = LLM(moe_file.path, n_ctx=128).run_many([Request(prompt, 16, greedy, top_logprobs=2)])[0]
    llm = LLM(moe_file.path, n_ctx=128, device="cuda", experts="cpu", expert_cache_gib=0.0, max_seqs=1)
    llm.offload.fix_share(1.0)  # the tuner dropped: it would move the share
    s = llm.offload.stats
    before = s.cpu_experts  # the graphs' eager warm-up
    ids = llm.run_many([Request(prompt, 16, greedy)])[0].output_ids
    # the prompt (STREAM_TOKENS or more) streamed, every decode miss read by the device
    assert s.host_read_experts > 0 and s.cpu_experts == before
    same_up_to_a_tie(want, ids, "every miss read by the device")


@pytest.mark.gpu
def test_gpu_a_chained_greedy_decode_still_resizes_the_cache(moe_file):
    """A greedy answer decodes as one chain of steps (each launched from the last one's tokens
    on the device); the expert cache's between-steps work runs before each of them: memory
    taken by another process mid-answer shrinks the cache before the answer ends (session
    39: an H100 squeeze kept every slot while free memory sat below the headroom)."""
    from deimos.bench.run import run_to_end
    from deimos.engine import LLM
    from deimos.engine.request import Request
    from deimos.kernels.sampling import SamplingParams

    llm = LLM(moe_file.path, n_ctx=128, device="cuda", experts="cpu", max_seqs=1)
    off = llm.offload
    assert off.sizer is not None and off.cache.n_slots > 0
    total = torch.cuda.mem_get_info()[1]
    card = {"free": total, "now": 0.0}
    off.sizer.memory = FreeMemory(lambda: (card["free"], total), lambda: card["now"])
    chained = []
    run = llm.engine.runner.run_chained
    llm.engine.runner.run_chained = lambda seqs: chained.append(1) or run(seqs)
    slots = []

    def after_step():
        card["now"] += 0.2
        if len(slots) == 4:
            card["free"] = 0  # another process took the card
        slots.append(off.cache.n_slots)

    prompt = torch.randint(0, 30000, (9,), generator=torch.Generator().manual_seed(2)).tolist()
    made = run_to_end(llm.engine, Request(prompt, 24, SamplingParams(temperature=0)), after_step)
    assert made == 24 and len(chained) > 10, "the answer's steps were chained"
    assert slots[3] > 0 and slots[-1] == 0, slots


def test_device_count_ends_both_sides_first():
    """device_count is the brute-force argmin of the slower side's cost (the larger count on a
    tie) for every miss count and a grid of shares, never more than rounding's error from
    share * m; the edges and the cases rounding got wrong."""
    from deimos.models.gpu.offload import device_count

    for m in range(70):
        for share in np.linspace(0, 1, 41):
            costs = [max(n * (1 - share), (m - n) * share) for n in range(m + 1)]
            best = min(range(m + 1), key=lambda n: (costs[n], -n))
            got = device_count(m, float(share))
            assert costs[got] == costs[best], (m, share, got, best)
            assert abs(got - share * m) <= 1
    assert device_count(7, 0.24) == 1 and device_count(3, 0.24) == 0  # rounding: 2 and 1
    assert device_count(8, 0.0) == 0 and device_count(8, 1.0) == 8 and device_count(0, 0.5) == 0
    assert device_count(1, 0.5) == 1  # a tie: the device's
    assert device_count(8, -0.1) == 0 and device_count(8, 1.5) == 8
