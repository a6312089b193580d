"""The routed-expert step on the GPU kernels (deimos.models.gpu.moe_ops.moe_step: router, top-k,
the experts' GEMVs or grouped GEMMs, the combine) against the float32 reference block.

Oracle: deimos.models.moe.moe_reference on the CPU reference model's block of the same file
(exact float32 over deimos.quant's dequantization). Not gpu-marked: one block of qwen3moe-tiny
under TRITON_INTERPRET=1 when there is no GPU (a token through moe_gemv, several through
moe_align + moe_gemm); gpu-marked: whole qwen3moe-tiny files against the reference
(``compare_whole_moe``, which tests/test_gpu_model.py's ``_compare_whole`` hands MoE files to).

Why a whole MoE model is compared differently from a dense one (measured on qwen3moe-tiny,
seed 11, the 37-token prefill, under the interpreter): each MoE block alone is within
4-7e-4 of the reference on the kernel model's own inputs, at every layer and token, and the
kernels' routing equals the reference's on those inputs; yet the prefill logits differ by
2.8e-2 (Q8_0) and 7.2e-2 (Q4_K_M; the H200: 2.8e-2, 7.6e-2), because of the routing:
- a flip: the ~1e-3 relative difference of a token's hidden state moves the router's logits
  by up to 0.02-0.2 in the late layers, and where the reference's k-th and (k+1)-th logits
  are closer than that the token takes another expert (Q8_0: position 21 at layer 7, gap
  0.009; Q4_K_M: position 28 at layer 6, gap 0.048, and on the decode path position 47 at
  layer 0, gap 0.0002): that token's logits differ by 16-44%;
- the weights: a sharp router (logits of std ~4) turns the same small difference into a
  weight difference of up to 6e-2 (position 36 of Q8_0: 5% off without any flip). With the
  reference's expert ids forced and the kernels' weights the error is 1.1e-2 / 8.4e-3; with
  the reference's ids and weights forced, 2.5e-3 / 2.0e-3, every position under 4.5e-3
  (decode along the greedy path: 1.7e-3 / 8.5e-4).
The reference itself moves as much: 1e-3 relative noise on its MoE inputs gives 0.9-4.1e-2
(Q8_0, six draws).
So the whole-model check forces the reference's routing (ids and weights) into the kernel
model for the dense-model tolerances, and checks the kernels' own routing separately: at
every call it must equal the reference's routing of the same input, and along the kernels'
own path a token may take other experts than the reference's only where the reference's
router gap was small (the flips are printed with their gaps), at few positions.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from kernel_device import DEVICE  # noqa: I001  (first: sets TRITON_INTERPRET)

from testdata import llama_cpp_path  # noqa: E402

from deimos.gguf import GGUFFile  # noqa: E402
from deimos.models import ARCHITECTURES, load_model  # noqa: E402
from deimos.models.gpu import moe_ops  # noqa: E402
from deimos.models.gpu.moe_ops import ResidentSlots, moe_step  # noqa: E402
from deimos.models.moe import moe_reference, route  # noqa: E402
from deimos.models.weights import WeightSource  # noqa: E402
from deimos.runtime.kv_cache import KVCache  # noqa: E402
from deimos.synth import write_model  # noqa: E402

DONOR = "models/ggml-vocab-llama-spm.gguf"


@pytest.fixture(scope="module", params=["Q8_0", "Q4_K_M"])
def moe_file(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / f"qwen3moe-tiny-{request.param}.gguf"
    write_model(path, "qwen3moe", "qwen3moe-tiny", request.param, llama_cpp_path(DONOR), seed=11)
    return GGUFFile(path)


def _blocks(f: GGUFFile, layer: int):
    ref = load_model(f)
    ker = ARCHITECTURES[ref.config.arch](ref.config, WeightSource(f, DEVICE, kernels=True))
    return ref.layers[layer].moe, ker.layers[layer].moe


@pytest.mark.parametrize("tokens", [1, 5])
def test_moe_step_matches_the_reference_block(moe_file, tokens):
    ref_block, ker_block = _blocks(moe_file, 1)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, ref_block.router.shape[1], generator=g)
    want = moe_reference(x, ref_block)
    slots = ResidentSlots()(ker_block.n_expert, torch.device(DEVICE))
    got = moe_step(x.to(DEVICE), ker_block, slots).cpu()
    assert got.shape == want.shape and got.dtype == torch.float32
    rel = ((got - want).norm() / want.norm()).item()
    # int8 activations at one token (gemv_q8), fp16 activations for several (moe_gemm)
    assert rel < 2e-2, f"relative error {rel:.2e}"


def test_an_expert_off_the_device_contributes_nothing(moe_file):
    """slot -1 for every expert: the step's output is 0 (the CPU's share is added by the caller)."""
    _, ker_block = _blocks(moe_file, 0)
    x = torch.randn(3, ker_block.router.shape[1], generator=torch.Generator().manual_seed(2)).to(DEVICE)
    none = torch.full((ker_block.n_expert,), -1, dtype=torch.int32, device=DEVICE)
    for t in (1, 3):
        assert bool((moe_step(x[:t], ker_block, none) == 0).all())


@pytest.mark.gpu
def test_gpu_whole_qwen3moe_tiny(moe_file):
    compare_whole_moe(moe_file, f"qwen3moe-tiny {Path(moe_file.path).name}")


# ---- whole MoE models: the reference's routing forced, then the kernels' own routing ----------

LOCAL_GAP = 1e-3  # router-logit gap under which the same input may route differently: float32
                  # products in another order differ by ~1e-6
ROUTE_WEIGHT = 1e-4  # the kernels' weights against the reference's for the same input and experts
POSITION_REL = 2e-2  # each position's logits, reference routing forced (measured at most 4.5e-3;
                     # a bug in some tokens' tile shows there before it moves the total)
FLIP_GAP = 0.25  # reference gap under which the kernels' own path may take other experts: the
                 # router logits of that path's inputs differ by up to 0.24 (median 0.003-0.02
                 # a layer); the flips seen had gaps 0.0002-0.048, a typical gap is 2-4
MAX_FLIPS = 5  # positions of the 52 (prompt and decode path) allowed to flip (seen: 1, 2)
UNFORCED_REL = 5e-2  # logits of the positions that did not flip, on the kernels' own routing
                     # (measured 9.9e-3 / 1.4e-2: the weights' sensitivity and the flipped
                     # positions' keys, see the module docstring)


class Routed(NamedTuple):
    """One MoE block's call: its layer, input ``x`` [T, D] and routing (weights [T, k],
    expert ids [T, k], by descending weight), float32 / int64 on the CPU."""

    layer: int
    x: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor


class Flip(NamedTuple):
    position: int
    layer: int
    gap: float  # the reference's k-th minus (k+1)-th router logit
    margin: float  # the same in probabilities
    x_rel: float  # the kernel model's block input against the reference's
    ref_ids: list[int]
    got_ids: list[int]

    def __str__(self) -> str:
        return (f"position {self.position} layer {self.layer}: reference experts {self.ref_ids}, "
                f"kernels {self.got_ids}; reference gap {self.gap:.4f} (probabilities "
                f"{self.margin:.1e}), block input off by {self.x_rel:.1e}")


def _gaps(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> the k-th minus (k+1)-th largest logit and probability [T]."""
    s = logits.sort(-1, descending=True).values
    p = torch.softmax(logits, -1).sort(-1, descending=True).values
    return s[:, k - 1] - s[:, k], p[:, k - 1] - p[:, k]


@contextmanager
def _reference_routing(model, log: list[Routed]):
    """Every MoE call of the reference ``model`` appends its routing (the one moe_reference
    computes) to ``log``."""
    ops = model.ops
    moe = ops.moe

    def recording(x, block):
        w, i = route(x @ block.router.T, block.n_expert_used, block.normalize)
        log.append(Routed(block.layer, x.clone(), w, i))
        return moe(x, block)

    ops.moe = recording
    try:
        yield
    finally:
        del ops.moe


@contextmanager
def _kernel_routing(replay: list[Routed] | None = None, log: list[Routed] | None = None):
    """The kernel model's router (moe_ops.route, which moe_step calls): ``replay``: each call
    returns the next recorded routing instead (the same layer and token count, all consumed);
    ``log``: each call's own routing is appended."""
    own = moe_ops.route
    calls = []

    def routing(x, block):
        if replay is None:
            w, i = own(x, block)
            log.append(Routed(block.layer, x.float().cpu(), w.cpu(), i.long().cpu()))
            return w, i
        assert len(calls) < len(replay), "more MoE calls than the reference made"
        r = replay[len(calls)]
        calls.append(r)
        assert (r.layer, r.ids.shape[0]) == (block.layer, x.shape[0]), "routing replay out of step"
        return (r.weights.to(x.device, torch.float32).contiguous(),
                r.ids.to(x.device, torch.int32).contiguous())

    moe_ops.route = routing
    try:
        yield
    finally:
        moe_ops.route = own
    assert replay is None or len(calls) == len(replay), f"{len(calls)} of {len(replay)} replayed"


def _teacher_forced(model, prompt: list[int], tokens: list[int], device: str):
    """Logits at every prompt position [P, V], then at ``tokens`` fed one by one [N, V]."""
    kv = KVCache(model.config, len(prompt) + len(tokens), device=device)
    n = len(prompt)
    pre = kv.forward(model, torch.tensor(prompt, device=device), torch.arange(n, device=device))
    dec = [kv.forward(model, torch.tensor([t], device=device))[0] for t in tokens]
    return pre.float().cpu(), torch.stack(dec).float().cpu()


def _rel_rows(ref: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """Each row's relative RMS error [N]."""
    ref, got = ref.double(), got.double()
    return (got - ref).norm(dim=1) / ref.norm(dim=1)


def _by_id(weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each row's weights in the order of its expert ids."""
    return weights.gather(1, ids.argsort(1))


def _check_own_routing(ref_model, ref_log: list[Routed], got_log: list[Routed],
                       n_prompt: int) -> list[Flip]:
    """The kernels' routing along their own path (``got_log``) against the reference's
    (``ref_log``, the same calls): at every call equal to the reference's routing of the same
    input (unless that input's gap < LOCAL_GAP); the first layer where a position's experts
    differ from the reference path's: a Flip."""
    assert [(r.layer, r.x.shape) for r in ref_log] == [(g.layer, g.x.shape) for g in got_log]
    flips: dict[int, Flip] = {}
    n_layer = ref_model.config.n_layer
    for c, (r, g) in enumerate(zip(ref_log, got_log)):
        block = ref_model.layers[r.layer].moe
        k = block.n_expert_used
        logits = g.x @ block.router.T
        w, i = route(logits, k, block.normalize)
        gap, _ = _gaps(logits, k)
        same = (i.sort(1).values == g.ids.sort(1).values).all(1)
        bad = (~same & (gap >= LOCAL_GAP)).nonzero().flatten().tolist()
        assert not bad, (f"layer {r.layer} call {c}: the kernels route tokens {bad} of the same input "
                         f"differently: {g.ids[bad].tolist()} vs {i[bad].tolist()}")
        dw = (_by_id(w, i) - _by_id(g.weights, g.ids))[same].abs().max().item() if same.any() else 0.0
        assert dw < ROUTE_WEIGHT, f"layer {r.layer} call {c}: routing weights off by {dw:.1e}"
        step = c // n_layer
        gap_r, margin_r = _gaps(r.x @ block.router.T, k)
        x_rel = (g.x - r.x).norm(dim=1) / r.x.norm(dim=1)
        flipped = (r.ids.sort(1).values != g.ids.sort(1).values).any(1)
        for t in flipped.nonzero().flatten().tolist():
            pos = t if step == 0 else n_prompt + step - 1
            flips.setdefault(pos, Flip(pos, r.layer, gap_r[t].item(), margin_r[t].item(),
                                       x_rel[t].item(), r.ids[t].tolist(), g.ids[t].tolist()))
    return sorted(flips.values())


def compare_whole_moe(f: GGUFFile, label: str, device: str = "cuda", ref=None) -> None:
    """tests/test_gpu_model.py's whole-model comparison for a MoE file, on ``device``
    (``ref``: the file's reference model, when loaded already):
    - with the reference's routing (expert ids and weights of every token at every layer)
      forced into the kernel model: prefill logits and decode logits along the reference's
      greedy path within 1e-2 relative RMS, each position's within POSITION_REL, the greedy
      tokens as _compare_whole asks;
    - on the kernels' own routing (the prompt, then the reference's tokens fed): at every
      call the same routing as the reference's for the same input, a position's experts
      other than the reference path's only where the reference's router gap < FLIP_GAP, at
      most MAX_FLIPS positions, printed; the other positions' logits within UNFORCED_REL."""
    from test_gpu_model import N_GREEDY, TIE, _forced, _greedy, _rel

    ref = load_model(f) if ref is None else ref
    gpu = ARCHITECTURES[ref.config.arch](ref.config, WeightSource(f, device, kernels=True))
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, ref.config.n_vocab, (37,), generator=g).tolist()
    ref_log: list[Routed] = []
    with _reference_routing(ref, ref_log):
        ref_logits, ref_tokens = _greedy(ref, prompt, N_GREEDY, "cpu")  # feeds ref_tokens[:N_GREEDY]
    calls = ref.config.n_layer * N_GREEDY  # the prefill and ref_tokens[:-1]: _forced's calls
    ref_dec = _forced(ref, prompt, ref_tokens[:-1], "cpu")
    with _kernel_routing(replay=ref_log):
        gpu_logits, gpu_tokens = _greedy(gpu, prompt, N_GREEDY, device)
    with _kernel_routing(replay=ref_log[:calls]):
        gpu_dec = _forced(gpu, prompt, ref_tokens[:-1], device)
    own_log: list[Routed] = []
    with _kernel_routing(log=own_log):
        own_pre, own_dec = _teacher_forced(gpu, prompt, ref_tokens[:-1], device)

    rel, rel_dec = _rel(ref_logits, gpu_logits), _rel(ref_dec, gpu_dec)
    flips = _check_own_routing(ref, ref_log[:calls], own_log, len(prompt))
    want_all, own_all = torch.cat([ref_logits, ref_dec]), torch.cat([own_pre, own_dec])
    kept = [p for p in range(want_all.shape[0]) if p not in {fl.position for fl in flips}]
    rel_own, rel_kept = _rel(want_all, own_all), _rel(want_all[kept], own_all[kept])
    flip_lines = "".join(f"\n  flip: {fl}" for fl in flips)
    print(f"{label}: reference routing forced: prefill logits rel rms {rel:.2e}, decode {rel_dec:.2e}; "
          f"greedy {gpu_tokens}; own routing: logits rel rms {rel_own:.2e}, {rel_kept:.2e} without "
          f"the {len(flips)} positions that took other experts{flip_lines}")
    assert rel < 1e-2, f"{label}: prefill logits relative RMS error {rel:.2e} (reference routing)"
    assert rel_dec < 1e-2, f"{label}: decode logits relative RMS error {rel_dec:.2e} (reference routing)"
    each = _rel_rows(torch.cat([ref_logits, ref_dec]), torch.cat([gpu_logits, gpu_dec]))
    worst = int(each.argmax())
    assert each[worst] < POSITION_REL, (f"{label}: position {worst}: logits relative RMS error "
                                        f"{each[worst]:.2e} (reference routing)")
    picks = [int(torch.cat([gpu_logits[-1:], gpu_dec])[i].argmax()) for i in range(N_GREEDY)]
    top2 = torch.cat([ref_logits[-1:], ref_dec]).topk(2, dim=1).values
    gaps = (top2[:, 0] - top2[:, 1]).tolist()
    for i, (want, got) in enumerate(zip(ref_tokens, picks)):
        assert got == want or gaps[i] < TIE, (f"{label}: step {i} picks {got}, reference {want}, "
                                              f"gap {gaps[i]:.3f}")
    first = next((i for i, (a, b) in enumerate(zip(ref_tokens, gpu_tokens)) if a != b), None)
    if first is not None:
        assert gaps[first] < TIE, (f"{label}: free-running greedy differs at step {first}, "
                                   f"gap {gaps[first]:.3f}")
    wide = [fl for fl in flips if fl.gap >= FLIP_GAP]
    assert not wide, f"{label}: experts flipped where the reference's router gap was wide:{flip_lines}"
    assert len(flips) <= MAX_FLIPS, f"{label}: {len(flips)} positions took other experts:{flip_lines}"
    assert rel_kept < UNFORCED_REL, f"{label}: own routing: logits relative RMS error {rel_kept:.2e}"
