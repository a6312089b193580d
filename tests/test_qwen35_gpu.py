"""qwen35 on the kernel path (deimos.models.gpu.deltanet_ops: the Triton gated delta rule, the
Triton ops' attention and norms) against the CPU reference, under TRITON_INTERPRET=1 when there
is no GPU.

Oracle: the float32 CPU reference model of the same tiny synth file (itself checked against
llama.cpp in test_qwen35.py). Not gpu-marked tests keep the reference's matrices
(``kernels=False, triton_ops=True``: the GEMV kernels have their own tests and take minutes in
the interpreter), so a difference is the recurrent block's or the ops'; the block test runs
the GPU linears too. The gpu-marked test is the whole model with packed weights on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from hybrid_support import tiny_qwen35
from kernel_device import DEVICE

from deimos.gguf import GGUFFile
from deimos.models import load_model
from deimos.models.batch import Batch, SeqLayout
from deimos.models.deltanet import HybridKV, RecurrentState
from deimos.models.qwen35 import Qwen35Model
from deimos.models.weights import WeightSource
from deimos.runtime.kv_pool import KVPool

BS = 16  # KV block size of the tests' pools
REL = 1e-2  # relative RMS error of the logits
TIE = 0.1  # reference top-2 gap under which a greedy pick may differ


def _rel(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.double().cpu(), got.double().cpu()
    return ((got - ref).norm() / ref.norm()).item()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> GGUFFile:
    return tiny_qwen35(tmp_path_factory, "qwen35_gpu")


@pytest.fixture(scope="module")
def models(tiny):
    ref = load_model(tiny)
    ops = Qwen35Model(ref.config, WeightSource(tiny, DEVICE, kernels=False, triton_ops=True))
    return ref, ops


class Seq:
    """One sequence on a shared pool: blocks 1 + i * 8 .. of a pool of 8 blocks a sequence."""

    def __init__(self, model, i: int, device: str):
        self.table = torch.arange(1 + 8 * i, 9 + 8 * i, dtype=torch.int32)
        self.state = model.new_state()
        self.length = 0


def _pool(model, device: str) -> KVPool:
    return KVPool(model.config, 1 + 8 * 2, BS, device, torch.float32)


def _step(model, pool, parts: list[tuple[Seq, list[int]]], device: str) -> torch.Tensor:
    """One step of (sequence, tokens) parts (one-token parts first: the decode rows); logits
    at every token [T, V]."""
    nd = 0
    while nd < len(parts) and len(parts[nd][1]) == 1:
        nd += 1
    tokens, positions, slots, starts, cu = [], [], [], [], [0]
    for s, toks in parts:
        pos = list(range(s.length, s.length + len(toks)))
        tokens += toks
        positions += pos
        slots += [int(s.table[p // BS]) * BS + p % BS for p in pos]
        starts.append(s.length)
        cu.append(cu[-1] + len(toks))
    i32 = {"dtype": torch.int32, "device": device}
    layout = SeqLayout([len(t) for _, t in parts], starts, nd, torch.tensor(slots, device=device),
                       torch.stack([s.table for s, _ in parts]).to(device),
                       torch.tensor(starts, **i32), torch.tensor(cu, **i32))  # fmt: skip
    t = torch.tensor(tokens, device=device)
    kv = HybridKV(pool, [s.state for s, _ in parts])
    logits = model.step(Batch(t, torch.tensor(positions, device=device), kv, layout, torch.arange(len(t), device=device)))
    for s, toks in parts:
        s.length += len(toks)
    return logits.float().cpu()


def _prompt(model, n: int, seed: int) -> list[int]:
    return torch.randint(0, model.config.n_vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(model, device: str, prompt: list[int], forced: list[int] | None = None):
    """The prompt in one step, then 3 decode steps (greedy, or the ``forced`` tokens): logits
    at every position [len(prompt) + 3, V], the tokens fed, the final state."""
    pool, s = _pool(model, device), Seq(model, 0, device)
    logits = [_step(model, pool, [(s, prompt)], device)]
    fed = []
    for i in range(3):
        fed.append(forced[i] if forced is not None else int(logits[-1][-1].argmax()))
        logits.append(_step(model, pool, [(s, [fed[-1]])], device))
    return torch.cat(logits), fed, s.state


def _compare(ref, model, device: str, label: str) -> None:
    """``model`` on the reference's greedy path: logits within REL, and its greedy pick at the
    last prompt position and each decode step the reference's unless the reference's top two
    are within TIE."""
    prompt = _prompt(ref, 65, 5)
    ref_logits, tokens, _ = _run(ref, "cpu", prompt)
    got_logits, _, state = _run(model, device, prompt, tokens)
    rel = _rel(ref_logits, got_logits)
    print(f"{label}: 65 + 3 tokens, logits rel RMS {rel:.2e}, greedy {tokens}")
    assert rel < REL, f"{label}: logits relative RMS error {rel:.2e}"
    top2 = ref_logits[64:].topk(2, dim=1).values
    picks = zip(ref_logits[64:].argmax(1).tolist(), got_logits[64:].argmax(1).tolist())
    for i, (want, got) in enumerate(picks):
        gap = float(top2[i, 0] - top2[i, 1])
        assert got == want or gap < TIE, f"{label}: step {i} picks {got}, reference {want}, gap {gap:.3f}"
    assert state.length == 68 and state.layout == "kernel"


def test_prefill_65_then_decode_equals_reference(models):
    """65 prompt tokens in one step (two chunks of the prefill kernel: 64 + 1), then 3 greedy
    decode steps (the decode kernel, the carried conv inputs): logits at every position and
    the greedy picks against the reference, on the reference's path."""
    ref, ops = models
    _compare(ref, ops, DEVICE, "qwen35-tiny Q8_0, Triton ops")


def test_two_sequences_in_one_step_equal_each_alone(models):
    """Two prompts of 9 and 20 tokens in one step (the varlen prefill over two slots), then a
    step with A's decode row before B's 3-token chunk (both kernels in one step): each
    sequence's logits equal it run alone (the oracle: the same model, one sequence a step)."""
    _, ops = models
    a_prompt, b_prompt, b_more = _prompt(ops, 9, 1), _prompt(ops, 20, 2), _prompt(ops, 3, 3)
    pool = _pool(ops, DEVICE)
    a, b = Seq(ops, 0, DEVICE), Seq(ops, 1, DEVICE)
    both = _step(ops, pool, [(a, a_prompt), (b, b_prompt)], DEVICE)
    a_tok = int(both[8].argmax())
    mixed = _step(ops, pool, [(a, [a_tok]), (b, b_more)], DEVICE)
    for i, (prompt, more, got) in enumerate(((a_prompt, [a_tok], torch.cat([both[:9], mixed[:1]])),
                                             (b_prompt, b_more, torch.cat([both[9:], mixed[1:]])))):  # fmt: skip
        pool, s = _pool(ops, DEVICE), Seq(ops, i, DEVICE)
        alone = torch.cat([_step(ops, pool, [(s, prompt)], DEVICE), _step(ops, pool, [(s, more)], DEVICE)])
        rel = _rel(alone, got)
        # float32 throughout; another batch shape sums in another order (H200: 1.4e-5)
        assert rel < 1e-4, f"sequence {'ab'[i]}: together vs alone, relative RMS error {rel:.2e}"


def test_reference_layout_state_is_adopted_and_snapshot_restores(models):
    """A state made as the engine makes it today (RecurrentState.zeros: reference layout, CPU)
    is converted at the first step; a clone taken after 7 tokens and restored continues to the
    same logits as the uninterrupted run."""
    _, ops = models
    prompt, more = _prompt(ops, 7, 4), _prompt(ops, 2, 6)
    pool, s = _pool(ops, DEVICE), Seq(ops, 0, DEVICE)
    s.state = RecurrentState.zeros(ops.config)
    _step(ops, pool, [(s, prompt)], DEVICE)
    assert s.state.layout == "kernel"
    snap = s.state.clone()
    first = _step(ops, pool, [(s, more)], DEVICE)
    s.state, s.length = snap, 7
    again = _step(ops, pool, [(s, more)], DEVICE)
    torch.testing.assert_close(again, first, rtol=0, atol=0)


def block_rows(block, model, device: str, x: torch.Tensor, reference: bool = False) -> torch.Tensor:
    """A recurrent block alone on x [66, D]: 65 rows in one step, then one decode row, from a
    fresh state (``reference``: the reference's layout); its outputs [66, D] on the host."""
    pool, s = _pool(model, device), Seq(model, 0, device)
    if reference:
        s.state = RecurrentState.zeros(model.config)
    ys = []
    for rows, nd in ((slice(0, 65), 0), (slice(65, 66), 1)):
        n = rows.stop - rows.start
        i32 = {"dtype": torch.int32, "device": device}
        layout = SeqLayout([n], [s.length], nd, torch.zeros(n, dtype=torch.long, device=device),
                           s.table[None].to(device), torch.tensor([s.length], **i32),
                           torch.tensor([0, n], **i32))  # fmt: skip
        batch = Batch(torch.zeros(n, dtype=torch.long, device=device),
                      torch.arange(s.length, s.length + n, device=device), pool, layout)
        ys.append(block(x[rows].to(device), batch, [s.state]).float().cpu())
        s.length += n
    return torch.cat(ys)


def test_block_with_gpu_linears_equals_reference(tiny, models):
    """Layer 0 (Gated DeltaNet) alone with the packed-weight linears (kernels=True): 65 tokens
    then one decode row, against the reference block."""
    ref, _ = models
    w = WeightSource(tiny, DEVICE, kernels=True)
    gpu = Qwen35Model(ref.config, w)
    blk_ref, blk = ref.layers[0].mixer, gpu.layers[0].mixer
    x = torch.randn(66, ref.config.n_embd, generator=torch.Generator().manual_seed(9))
    outs = {"ref": block_rows(blk_ref, ref, "cpu", x, reference=True), "gpu": block_rows(blk, gpu, DEVICE, x)}
    rel = _rel(outs["ref"], outs["gpu"])
    print(f"layer 0 with GPU linears: rel RMS {rel:.2e}")
    assert rel < REL, f"block output relative RMS error {rel:.2e}"


def test_gated_attention_with_gpu_linears_equals_reference(tiny, models):
    """Layer 3 (gated full attention) alone with the packed-weight linears (kernels=True): 65
    tokens then one decode row (its output gate also quantized for the output projection's
    GEMV: kernels.triton.output_gate), against the reference block."""
    ref, _ = models
    gpu = Qwen35Model(ref.config, WeightSource(tiny, DEVICE, kernels=True))
    x = torch.randn(66, ref.config.n_embd, generator=torch.Generator().manual_seed(10))
    outs = {}
    for name, model, device in (("ref", ref, "cpu"), ("gpu", gpu, DEVICE)):
        pool, s = _pool(model, device), Seq(model, 0, device)
        ys = []
        for rows, nd in ((slice(0, 65), 0), (slice(65, 66), 1)):
            n = rows.stop - rows.start
            pos = list(range(s.length, s.length + n))
            slots = torch.tensor([int(s.table[p // BS]) * BS + p % BS for p in pos], device=device)
            i32 = {"dtype": torch.int32, "device": device}
            layout = SeqLayout([n], [s.length], nd, slots, s.table[None].to(device),
                               torch.tensor([s.length], **i32), torch.tensor([0, n], **i32))  # fmt: skip
            batch = Batch(torch.zeros(n, dtype=torch.long, device=device),
                          torch.tensor(pos, device=device), pool, layout)
            ys.append(model.layers[3].mixer(x[rows].to(device), model.ops.begin(batch)).float().cpu())
            s.length += n
        outs[name] = torch.cat(ys)
    assert not model.config.is_recurrent(3)
    rel = _rel(outs["ref"], outs["gpu"])
    print(f"layer 3 with GPU linears: rel RMS {rel:.2e}")
    assert rel < REL, f"attention output relative RMS error {rel:.2e}"
    assert _rel(outs["ref"][65:], outs["gpu"][65:]) < REL, "the decode row differs"


@pytest.mark.gpu
def test_gpu_whole_model_equals_reference(tiny):
    """The whole model with packed weights on CUDA: 65 + 3 tokens as above."""
    _compare(load_model(tiny), load_model(tiny, device="cuda"), "cuda", "qwen35-tiny Q8_0, GPU")
