"""qwen35's kernel path over the engine's state pool (deimos.runtime.state_pool: per recurrent
layer [n_slots, ...] device tensors, each sequence's slot read on the device), under
TRITON_INTERPRET=1 when there is no GPU.

Oracles: the same model with each sequence's own RecurrentState (the kernel path's per-step
pool: the states stacked, written back after the step) bit for bit; a step without the padding
rows; the run a snapshot was taken from; through the engine, each request alone (greedy) and a
run without the prefix cache. As in test_qwen35_gpu.py the model keeps the reference's float
matrices (``kernels=False, triton_ops=True``): the Triton ops and gated-delta kernels run, the
GEMV kernels (their own tests, minutes in the interpreter) do not. The gpu-marked tests run the
packed-weight model on CUDA, decode steps as CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch
from hybrid_support import tiny_qwen35
from kernel_device import DEVICE

from deimos.engine.engine import Engine, EngineConfig
from deimos.engine.request import Request
from deimos.gguf import GGUFFile
from deimos.kernels.sampling import SamplingParams
from deimos.models import load_model
from deimos.models.batch import Batch, SeqLayout
from deimos.models.deltanet import HybridKV, StateError
from deimos.models.qwen35 import Qwen35Model
from deimos.models.weights import WeightSource
from deimos.runtime.kv_pool import KVPool
from deimos.runtime.state_pool import SCRATCH_SLOT, SlotState, StatePool, StateSnapshot

BS = 16  # KV block size of the tests' pools
GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> GGUFFile:
    return tiny_qwen35(tmp_path_factory, "qwen35_pool")


@pytest.fixture(scope="module")
def model(tiny):
    cfg = load_model(tiny).config
    return Qwen35Model(cfg, WeightSource(tiny, DEVICE, kernels=False, triton_ops=True))


class Seq:
    """One sequence on a shared KV pool (blocks 1 + 8 i .. 8 + 8 i) with its own RecurrentState,
    or a slot of ``store``."""

    def __init__(self, model, i: int, store: StatePool | None = None):
        self.table = torch.arange(1 + 8 * i, 9 + 8 * i, dtype=torch.int32)
        self.state = store.bind() if store is not None else model.new_state()
        self.length = 0


def _kv(model) -> KVPool:
    return KVPool(model.config, 1 + 8 * 4, BS, DEVICE, torch.float32)


def _i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def _batch(kv, parts: list[tuple[Seq | None, list[int]]], store: StatePool | None) -> Batch:
    """The step of (sequence, tokens) parts, one-token parts first; a part without a sequence
    is a graph's padding row (token 0 at position 0, table and state slots scratch), and with
    one the batch brings no state handles (as a graph's step). Logits at every token."""
    nd = 0
    while nd < len(parts) and len(parts[nd][1]) == 1:
        nd += 1
    tokens, positions, slots, starts, cu, tables = [], [], [], [], [0], []
    for s, toks in parts:
        start = s.length if s is not None else 0
        table = s.table if s is not None else torch.zeros(8, dtype=torch.int32)
        pos = list(range(start, start + len(toks)))
        tokens += toks
        positions += pos
        slots += [int(table[p // BS]) * BS + p % BS for p in pos]
        starts.append(start)
        cu.append(cu[-1] + len(toks))
        tables.append(table)
    layout = SeqLayout([len(t) for _, t in parts], starts, nd, torch.tensor(slots, device=DEVICE),
                       torch.stack(tables).to(DEVICE), _i32(starts), _i32(cu))  # fmt: skip
    padded = any(s is None for s, _ in parts)
    if store is None:
        hkv = HybridKV(kv, [s.state for s, _ in parts])
    else:
        ids = [s.state.slot if s is not None else SCRATCH_SLOT for s, _ in parts]
        hkv = HybridKV(kv, [] if padded else [s.state for s, _ in parts], store, _i32(ids))
    t = torch.tensor(tokens, device=DEVICE)
    return Batch(t, torch.tensor(positions, device=DEVICE), hkv, layout, torch.arange(len(t), device=DEVICE))


def _step(model, kv, parts, store: StatePool | None = None) -> torch.Tensor:
    logits = model.step(_batch(kv, parts, store))
    for s, toks in parts:
        if s is not None:
            s.length += len(toks)
    return logits.float().cpu()


def _prompt(n: int, seed: int, vocab: int = 30000) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _scramble(store: StatePool, order: list[int]) -> None:
    """Every slot taken, then given back in ``order``: the next binds get them in that order."""
    held = {st.slot: st for st in (store.bind() for _ in range(store.n_free))}
    for slot in order:
        held.pop(slot).release()
    for st in held.values():
        st.release()


@pytest.mark.parametrize("lens", [[70], [9, 70, 20]], ids=["1seq", "3seqs"])
def test_pool_path_equals_own_states(model, lens):
    """Prompts of ``lens`` tokens in one step (70: two chunks of the prefill kernel), for 3
    sequences a step of 2 decode rows beside a 5-token chunk, then 3 decode steps (greedy):
    over a state pool in slots 5, 2, 4 the logits and final states equal the path with each
    sequence's own RecurrentState (its per-step pool in slots 0, 1, 2), bit for bit."""
    store = StatePool(model.config, 5, DEVICE)
    _scramble(store, [5, 2, 4])
    runs = {}
    for name, pool in (("own", None), ("pool", store)):
        kv = _kv(model)
        seqs = [Seq(model, i, pool) for i in range(len(lens))]
        parts = [(s, _prompt(n, 10 + i)) for i, (s, n) in enumerate(zip(seqs, lens))]
        logits = []
        for k in range(4 + (len(lens) > 1)):
            out = _step(model, kv, parts, pool)
            logits.append(out)
            ends = torch.tensor([len(t) for _, t in parts]).cumsum(0) - 1
            parts = [(s, [int(out[j].argmax())]) for s, j in zip(seqs, ends.tolist())]
            if k == 0 and len(lens) > 1:  # decode rows beside a chunk of the third prompt
                parts = parts[:2] + [(seqs[2], _prompt(5, 20))]
        if pool is None:
            states = [s.state for s in seqs]
        else:
            assert [s.state.slot for s in seqs] == [5, 2, 4][: len(lens)]
            states = [s.state.clone().to_state() for s in seqs]
        runs[name] = (torch.cat(logits), states)
    (want, want_st), (got, got_st) = runs["own"], runs["pool"]
    assert torch.equal(got, want), f"logits differ: max {float((got - want).abs().max()):.2e}"
    for a, b in zip(want_st, got_st):
        assert a.length == b.length
        for i in a.ssm:
            assert torch.equal(a.ssm[i].cpu(), b.ssm[i].cpu()), f"layer {i}: delta-rule states differ"
            assert torch.equal(a.conv[i].cpu(), b.conv[i].cpu()), f"layer {i}: conv inputs differ"


def test_a_snapshot_restored_into_another_slot_continues_the_same(model):
    """A snapshot after 7 tokens (StateSnapshot, device copies), restored into another slot, and
    the same snapshot as a reference-layout RecurrentState restored into a third, continue with
    2 + 1 tokens to the logits of the uninterrupted run; the snapshot is never written."""
    store = StatePool(model.config, 4, DEVICE)
    kv = _kv(model)
    a = Seq(model, 0, store)
    _step(model, kv, [(a, _prompt(7, 1))], store)
    snap = a.state.clone()
    assert isinstance(snap, StateSnapshot) and snap.clone() is snap and snap.length == 7
    kept = (snap.ssm.clone(), snap.conv.clone())
    more = _prompt(2, 2)
    first = torch.cat([_step(model, kv, [(a, more)], store), _step(model, kv, [(a, [5])], store)])
    ref_layout = snap.to_state()
    for i in ref_layout.ssm:  # as the CPU reference holds it: [Hv, Dv, Dk]
        ref_layout.ssm[i] = ref_layout.ssm[i].transpose(-1, -2).contiguous()
    ref_layout.layout = "reference"
    for source in (snap, ref_layout):
        b = Seq(model, 0, None)
        b.state = store.bind(source)
        b.length = 7
        assert b.state.slot != a.state.slot and b.state.length == 7
        again = torch.cat([_step(model, kv, [(b, more)], store), _step(model, kv, [(b, [5])], store)])
        assert torch.equal(again, first)
        b.state.release()
    assert torch.equal(snap.ssm, kept[0]) and torch.equal(snap.conv, kept[1])
    a.state.release()
    assert store.n_held == 0
    store.check()


def test_padding_rows_touch_only_the_scratch_slot(model):
    """A decode step of 2 live rows padded to 4 as a graph pads (token 0 at position 0, scratch
    table and state slot, no state handles): the live rows' logits and slots equal the step
    without padding (within the float32 noise of 4-row matrix products against 2-row ones:
    about 1e-7 relative); every other slot is unchanged bit for bit, and the scratch slot took
    the padding's writes."""
    store = StatePool(model.config, 5, DEVICE)
    kv = _kv(model)
    a, b = Seq(model, 0, store), Seq(model, 1, store)
    pre = _step(model, kv, [(a, _prompt(11, 3)), (b, _prompt(4, 4))], store)
    toks = [int(pre[10].argmax()), int(pre[14].argmax())]
    snaps = [a.state.clone(), b.state.clone()]
    before = (store._ssm.clone(), store._conv.clone())
    plain = _step(model, kv, [(a, [toks[0]]), (b, [toks[1]])], store)
    after = (store._ssm.clone(), store._conv.clone())
    for s, snap in zip((a, b), snaps):  # back to before the step
        store.load(s.state.slot, snap)
        s.length -= 1
        s.state.length -= 1
    padded = _step(model, kv, [(a, [toks[0]]), (b, [toks[1]]), (None, [0]), (None, [0])], store)
    rel = float((padded[:2] - plain).norm() / plain.norm())
    assert rel < 1e-5, f"live rows with padding: relative RMS error {rel:.2e}"
    live = [a.state.slot, b.state.slot]
    idle = [i for i in range(1, store.n_slots) if i not in live]
    for t, t0, t1 in ((store._ssm, before[0], after[0]), (store._conv, before[1], after[1])):
        assert torch.equal(t[:, idle], t0[:, idle]), "a slot no row names changed"
        err = float((t[:, live] - t1[:, live]).norm() / t1[:, live].norm())
        assert err < 1e-5, f"live slots with padding: relative RMS error {err:.2e}"
        assert not torch.equal(t[:, SCRATCH_SLOT], t0[:, SCRATCH_SLOT]), "padding never ran"


def test_a_pool_step_checks_its_slots_and_handles(model):
    """The step names what is wrong: slots of another length or dtype, a handle at another
    position, a released handle's snapshot; the CPU reference refuses a pool."""
    store = StatePool(model.config, 2, DEVICE)
    kv = _kv(model)
    a = Seq(model, 0, store)
    good = _batch(kv, [(a, [1, 2])], store)
    good.kv.slots = _i32([1, 1])
    with pytest.raises(StateError, match="slots int32"):
        model.step(good)
    a.state.length = 3
    with pytest.raises(StateError, match="starts at position 0"):
        model.step(_batch(kv, [(a, [1, 2])], store))
    a.state.release()
    with pytest.raises(StateError, match="released"):
        a.state.clone()
    assert isinstance(a.state, SlotState) and store.n_held == 0


def _engine(model, **kw) -> Engine:
    return Engine(model, EngineConfig(n_ctx=kw.pop("n_ctx", 64), **kw))


def _run(engine: Engine, reqs: list[Request]) -> list[list[int]]:
    seqs = [engine.add(r) for r in reqs]
    while engine.has_work:
        engine.step()
    return [s.request.output_ids for s in seqs]


def test_engine_slots_are_recycled_and_outputs_equal_alone(model):
    """7 requests through an engine of 3 slots and a KV pool that forces preemption, then a
    second turn restoring a prefix-cache snapshot: every request's tokens equal it run alone
    without the cache (greedy), the second turn prefills only past its snapshot, and every slot
    is free at the end (preempted and finished sequences gave theirs back)."""
    prompts = [[(7 * i + 3 * j) % 300 + 1 for i in range(4 + 9 * j)] for j in range(6)]
    fresh = _engine(model, max_seqs=1, prefix_cache=False)
    alone = [_run(fresh, [Request(p, 6, GREEDY)])[0] for p in prompts]
    eng = _engine(model, max_seqs=3, kv_tokens=64, max_batch_tokens=24)
    # 3 sequence slots, the scratch slot and 3 snapshot slots (min(SNAP_SLOTS, max_seqs))
    assert eng.states is not None and eng.states.n_slots == 7 and len(eng.states.snap_slots) == 3
    assert _run(eng, [Request(p, 6, GREEDY) for p in prompts]) == alone
    assert eng.scheduler.preemptions > 0
    assert eng.states.n_held == 0 and eng.states.n_free == 3
    second = prompts[5] + alone[5] + [17, 18, 19]
    req = Request(second, 4, GREEDY)
    assert _run(eng, [req]) == _run(fresh, [Request(second, 4, GREEDY)])
    assert req.cached_tokens > 0, "the second turn did not start from a snapshot"
    assert eng.states.n_held == 0 and eng.blocks.n_used == 0
    eng.states.check()
    assert fresh.states.n_held == 0


@pytest.mark.gpu
def test_gpu_decode_step_replays_as_a_graph_with_eager_logits(tiny):
    """The packed-weight model on CUDA through the engine's runner: two sequences prefilled,
    then one decode step replayed as the B=2 CUDA graph and, from the same states (snapshots
    restored) and cache, run eagerly: the same logits bit for bit."""
    from deimos.engine.runner import step_inputs
    from deimos.engine.scheduler import StepPlan

    m = load_model(tiny, device="cuda")
    assert m.graph_safe
    eng = _engine(m, n_ctx=128, max_seqs=4)
    seqs = [eng.add(Request(_prompt(n, n), 8, GREEDY)) for n in (21, 40)]
    while not all(s.decoding for s in seqs):
        eng.step()
    runner = eng.runner
    snaps = [s.state.clone() for s in seqs]
    plan = StepPlan(decode=list(seqs))
    res = runner.run(plan)
    assert res.graph is not None and res.graph.n_seqs == 2, "the decode step did not replay a graph"
    graph = res.logits[:2].clone()
    for s, snap in zip(seqs, snaps):
        eng.states.load(s.state.slot, snap)
        s.state.length = snap.length
    eager = runner._eager(step_inputs(plan, runner.block_size, runner.max_blocks))
    assert torch.equal(graph, eager[:2]), f"max diff {float((graph - eager[:2]).abs().max()):.2e}"


@pytest.mark.gpu
def test_gpu_engine_with_graphs_equals_eager_and_frees_every_slot(tiny):
    """5 requests on 3 slots with decode graphs and without: the same greedy tokens, decode
    graphs replayed, every slot free at the end."""
    m = load_model(tiny, device="cuda")
    prompts = [_prompt(5 + 13 * j, j) for j in range(5)]
    outs = {}
    for graphs in (True, False):
        eng = _engine(m, n_ctx=128, max_seqs=3, cuda_graphs=graphs)
        outs[graphs] = _run(eng, [Request(p, 12, GREEDY) for p in prompts])
        replays = sum(g.replays for g in eng.runner.decode_graphs.values())
        assert (replays > 0) == graphs
        assert eng.states.n_held == 0
        eng.states.check()
    assert outs[True] == outs[False]


@pytest.mark.gpu
def test_gpu_prefill_graphs_equal_eager(tiny):
    """Requests one at a time, prompts of 5, 40 and 600 tokens (padded chunks of 16 and 64, the
    40 with a snapshot row at 32; the 600 eager: past the largest graph) then a second turn of
    the last one (its snapshot from the prefix cache, only the new tokens prefilled): on the
    padded prefill graphs the same greedy tokens as eager steps, the graphs replayed (3 times),
    every slot free at the end. The padding rows advance no state: else the tokens after a
    padded chunk would differ."""
    m = load_model(tiny, device="cuda")
    prompts = [_prompt(n, 40 + n) for n in (5, 40, 600)]
    outs = {}
    for graphs in (True, False):
        eng = _engine(m, n_ctx=1024, max_seqs=3, cuda_graphs=graphs)
        got = [_run(eng, [Request(p, 10, GREEDY)])[0] for p in prompts]
        turn = prompts[2] + got[2] + _prompt(7, 99)
        got.append(_run(eng, [Request(turn, 10, GREEDY)])[0])
        outs[graphs] = got
        pre = sum(g.replays for g in eng.runner.prefill_graphs.values())
        assert (pre >= 3) == graphs, f"{pre} prefill replays"
        assert eng.states.n_held == 0
        eng.states.check()
    assert outs[True] == outs[False]


def _snapshot_row_and_reuse(model, p1: list[int], p2: list[int], cached: int, n_ctx: int = 64):
    """``p1`` prefilled in one step (1 token out) keeping one snapshot, then ``p2`` starting
    from it with ``cached`` tokens; both equal an engine without the prefix cache. Returns the
    prefill graphs' replays of ``p1``'s step."""
    eng = _engine(model, n_ctx=n_ctx, max_seqs=2)
    fresh = _engine(model, n_ctx=n_ctx, max_seqs=1, prefix_cache=False)
    got1 = _run(eng, [Request(p1, 1, GREEDY)])
    assert eng.steps == 1 and eng.blocks.n_states == 1
    replays = sum(g.replays for g in eng.runner.prefill_graphs.values())
    req = Request(p2, 5, GREEDY)
    got2 = _run(eng, [req])
    assert req.cached_tokens == cached
    assert got1 == _run(fresh, [Request(p1, 1, GREEDY)])
    assert got2 == _run(fresh, [Request(p2, 5, GREEDY)])
    eng.states.check()
    return replays


def test_engine_snapshot_row_inside_a_prefill_step(model):
    """On the kernel path a 27-token prompt is prefilled in one step whose kernels also store
    the state after its 16th token into a snapshot slot (copied out onto block 0's cache
    entry); a prompt sharing those 16 tokens starts from that copy; both equal uncached runs."""
    p1 = [(7 * i) % 300 + 2 for i in range(27)]
    _snapshot_row_and_reuse(model, p1, p1[:20] + [9, 8, 7], 16)


def test_snapshot_rows_are_checked(model, tiny):
    """A snapshot row at or past its sequence's rows (the CPU reference), a kernel-path
    snapshot tensor of the wrong shape, more snapshots than the pool has slots, a negative
    slot count: each a clear error."""
    with pytest.raises(ValueError, match="n_snap"):
        StatePool(model.config, 2, DEVICE, n_snap=-1)
    ref = load_model(tiny)  # the CPU reference
    kv = _kv(model)
    bad = _batch(kv, [(Seq(ref, 0), [1, 2, 3])], None)
    bad.kv.snap_at, bad.kv.snaps = [3], [None]
    with pytest.raises(StateError, match="snap_at"):
        ref.step(bad)
    store = StatePool(model.config, 2, DEVICE, n_snap=1)
    bad = _batch(kv, [(Seq(model, 0, store), [1, 2, 3])], store)
    bad.kv.snap = _i32([1, store.snap_slots[0]])  # [2], not [1, 2]
    with pytest.raises(StateError, match="HybridKV.snap"):
        model.step(bad)
    from deimos.engine.runner import StepInputs

    eng = _engine(model, max_seqs=1)
    x = StepInputs(*([None] * 9), snap_at=[16, 16])
    with pytest.raises(StateError, match="snapshot slots"):
        eng.runner._snap_rows(x)


@pytest.mark.gpu
def test_gpu_prefill_graph_takes_a_snapshot_row(tiny):
    """A 40-token prompt on the prefill graphs: one replay, which also stores the state after
    its 32nd token (the graph's snapshot row, read from the device); a prompt sharing those 32
    tokens starts from it. Both equal an engine without the prefix cache."""
    p1 = _prompt(40, 3)
    replays = _snapshot_row_and_reuse(load_model(tiny, device="cuda"), p1, p1[:35] + _prompt(6, 5),
                                      32, n_ctx=256)
    assert replays == 1
