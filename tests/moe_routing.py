"""Whole MoE models on the kernel path against the CPU reference with the routing apart, shared by
tests/test_moe_gpu.py (qwen3moe, through KVCache.forward) and tests/test_qwen3next.py and
tests/test_qwen35moe.py (the hybrids, through tests/test_qwen35_gpu.py's paged step with the
recurrent state).

Oracle: the float32 CPU reference model of the same file. ``compare_routed`` runs it once,
recording every MoE block's input and routing, then the kernel model three times: with the
reference's routing (expert ids and weights) forced, free-running greedy with it forced, and on
its own routing. Why the routing is forced for the tight comparison: tests/test_moe_gpu.py's
docstring (qwen3moe: router near-tie flips, and a sharp router turning a 1e-3 input difference
into weight differences of up to 6e-2; not a kernel defect).

The hybrids (measured under the interpreter, kernels on the CPU, the Q8_0 files of the tests,
65 prompt tokens and 3 decode steps; the H200 gave the same unforced numbers: 5.8e-2 ssmin):

                          reference routing forced          own routing
                          all     prefill decode  worst     all     without the flips  flips
    qwen3next-tiny        7.1e-3  7.3e-3  2.8e-3  2.5e-2    1.4e-2  1.2e-2             1
    qwen3next-tiny-ssmin  1.0e-2  8.3e-3  2.9e-2  4.9e-2    5.8e-2  4.3e-2             11
    qwen35moe-tiny        6.0e-3  6.1e-3  3.0e-3  2.3e-2    1.0e-2  6.7e-3             2

- the forced error is the prefill's fp16 rounding (a step of more than 4 rows multiplies x and
  W in fp16; decode's integer activations are exact to ~1e-5): the reference with exactly
  those roundings gives the same numbers (ssmin 1.0e-2, decode 2.8e-2, position 65 at 4.8e-2)
  and is 0.8-1.5e-3 from the kernel path. ssmin's positions 64-65 are where its random
  weights amplify them; with float32 matrices (kernels=False, triton_ops=True: the delta rule,
  convolution, attention and norm kernels, the ssm_in layout) the ssmin path is 1.2e-5 from
  the reference, and its Gated DeltaNet blocks with the packed linears are within 7e-4 of the
  reference blocks in both layouts;
- the flips (reference gaps 0.0004-0.18; a typical gap is 0.2-0.3, the synthetic routers have
  16 experts of similar logits): ssmin's first at position 36 layer 0 (gap 0.0018, block input
  1.3e-3 off) carries through the recurrent state and the attention to positions 38-50 (up
  to 22% off; the later flips there have block inputs off by 4-10%, hence gaps up to 0.18).
  The reference with the kernel path's roundings routing itself gives the same 11 flips and
  5.8e-2; with 1e-4-3e-4 noise on its MoE inputs it gives 5-13 flips, 2.5-5.9e-2, the rest
  1.2-4.4e-2 (that flip at 36 is there or not).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from typing import NamedTuple

import kernel_device  # noqa: F401  (before the kernel modules: sets TRITON_INTERPRET)
import torch

from deimos.models import ARCHITECTURES, load_model
from deimos.models.gpu import moe_ops
from deimos.models.moe import route
from deimos.models.weights import WeightSource

LOCAL_GAP = 1e-3  # router-logit gap under which the same input may route differently: float32
                  # products in another order differ by ~1e-6
ROUTE_WEIGHT = 1e-4  # the kernels' weights against the reference's for the same input and experts

# A run: run(model, device, prompt, forced=None) -> (logits [P + N, V] float32 on the host, fed
# [N]): the prompt in one step (logits at every position), then N one-token steps, step i
# feeding forced[i] or the greedy pick of the row before.
Run = Callable[..., tuple[torch.Tensor, list[int]]]


class Bounds(NamedTuple):
    """What compare_routed asks. Reference routing forced: ``rel`` the relative RMS error of all
    logits and of the prompt's, ``decode`` the decode steps', ``position`` each position's; a
    greedy pick other than the reference's only where its top two are within ``tie``. Own
    routing: a position's flip where its block input was within ``near`` of the reference's
    only at a reference router gap < ``flip_gap`` (a flip further off follows an earlier one,
    carried in the keys or the recurrent state), at most ``max_flips`` positions flipped, the
    other positions' logits within ``unforced``."""

    rel: float
    decode: float
    position: float
    flip_gap: float
    max_flips: int
    unforced: float
    near: float = float("inf")
    tie: float = 0.1


# the hybrids (module docstring; at most, under the interpreter and in the emulation's draws:
# forced 1.0e-2 all, 2.9e-2 decode, 4.9e-2 a position; flips with block inputs within 2e-2 at
# gaps to 0.057 (0.2-0.3 typical), 13 positions flipped of 68, 4.4e-2 the rest). The forced
# path's block inputs are 1-4e-3 off (median) and at most 3.9e-2.
HYBRID = Bounds(rel=2e-2, decode=6e-2, position=1e-1, flip_gap=0.15, max_flips=20, unforced=1e-1,
                near=3e-2)


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


def router_gaps(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> the k-th minus (k+1)-th largest logit and probability [T]."""
    s = logits.sort(-1, descending=True).values
    p = torch.softmax(logits, -1).sort(-1, descending=True).values
    return s[:, k - 1] - s[:, k], p[:, k - 1] - p[:, k]


@contextmanager
def reference_routing(model, log: list[Routed]):
    """Every MoE call of the reference ``model`` appends its routing (the one moe_reference
    computes) to ``log``."""
    ops = model.ops
    moe = ops.moe

    def recording(x, block, defer=False):
        w, i = route(x @ block.router.T, block.n_expert_used, block.normalize)
        log.append(Routed(block.layer, x.clone(), w, i))
        return moe(x, block, defer=defer)

    ops.moe = recording
    try:
        yield
    finally:
        del ops.moe


@contextmanager
def kernel_routing(replay: list[Routed] | None = None, log: list[Routed] | None = None):
    """The kernel model's router (moe_ops.route, which moe_step calls, fused or not):
    ``replay``: each call returns the next recorded routing instead (the same layer and token
    count, all consumed); ``log``: each call's own routing is appended."""
    own = moe_ops.route
    calls = []

    def routing(x, block, scratch=None):
        if replay is None:
            w, i = own(x, block, scratch)
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


def rel(ref: torch.Tensor, got: torch.Tensor) -> float:
    """Relative RMS error ‖got - ref‖ / ‖ref‖ in float64."""
    ref, got = ref.double(), got.double()
    return ((got - ref).norm() / ref.norm()).item()


def rel_rows(ref: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """Each row's relative RMS error [N]."""
    ref, got = ref.double(), got.double()
    return (got - ref).norm(dim=1) / ref.norm(dim=1)


def _by_id(weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each row's weights in the order of its expert ids."""
    return weights.gather(1, ids.argsort(1))


def check_own_routing(ref_model, ref_log: list[Routed], got_log: list[Routed]) -> list[Flip]:
    """The kernels' routing along their own path (``got_log``) against the reference's
    (``ref_log``, the same calls): at every call equal to the reference's routing of the same
    input (unless that input's gap < LOCAL_GAP), the weights within ROUTE_WEIGHT; the first
    layer where a position's experts differ from the reference path's: a Flip. A layer's
    calls take the positions in order (each call's rows follow the previous call's)."""
    assert [(r.layer, r.x.shape) for r in ref_log] == [(g.layer, g.x.shape) for g in got_log]
    flips: dict[int, Flip] = {}
    next_position: dict[int, int] = {}
    for c, (r, g) in enumerate(zip(ref_log, got_log)):
        block = ref_model.layers[r.layer].moe
        k = block.n_expert_used
        logits = g.x @ block.router.T
        w, i = route(logits, k, block.normalize)
        gap, _ = router_gaps(logits, k)
        same = (i.sort(1).values == g.ids.sort(1).values).all(1)
        bad = (~same & (gap >= LOCAL_GAP)).nonzero().flatten().tolist()
        assert not bad, (f"layer {r.layer} call {c}: the kernels route tokens {bad} of the same input "
                         f"differently: {g.ids[bad].tolist()} vs {i[bad].tolist()}")
        dw = (_by_id(w, i) - _by_id(g.weights, g.ids))[same].abs().max().item() if same.any() else 0.0
        assert dw < ROUTE_WEIGHT, f"layer {r.layer} call {c}: routing weights off by {dw:.1e}"
        first = next_position.get(r.layer, 0)
        next_position[r.layer] = first + r.x.shape[0]
        gap_r, margin_r = router_gaps(r.x @ block.router.T, k)
        x_rel = (g.x - r.x).norm(dim=1) / r.x.norm(dim=1)
        flipped = (r.ids.sort(1).values != g.ids.sort(1).values).any(1)
        for t in flipped.nonzero().flatten().tolist():
            pos = first + t
            if pos not in flips or flips[pos].layer > r.layer:
                flips[pos] = Flip(pos, r.layer, gap_r[t].item(), margin_r[t].item(), x_rel[t].item(),
                                  r.ids[t].tolist(), g.ids[t].tolist())
    return sorted(flips.values())


def compare_routed(ref, ker, prompt: list[int], run: Run, label: str, device: str, b: Bounds) -> None:
    """The kernel model ``ker`` on ``device`` against the reference ``ref`` (on the CPU), both
    through ``run``:
    - with the reference's routing forced (the reference's tokens fed): the logits within
      ``b.rel`` (all and the prompt's), ``b.decode`` (the decode steps'), ``b.position`` (each
      position's); at the last prompt position and each decode step the reference's greedy
      pick unless the reference's top two are within ``b.tie``, and free-running greedy (its
      routing forced too) the reference's tokens up to such a tie;
    - on its own routing (the reference's tokens fed): check_own_routing at every call, a
      position's experts other than the reference path's (with its block input within
      ``b.near`` of the reference's) only where the reference's router gap < ``b.flip_gap``,
      at most ``b.max_flips`` positions (printed), the logits of the other positions within
      ``b.unforced``."""
    ref_log: list[Routed] = []
    with reference_routing(ref, ref_log):
        want, tokens = run(ref, "cpu", prompt)
    with kernel_routing(replay=ref_log):
        got, _ = run(ker, device, prompt, tokens)
    with kernel_routing(replay=ref_log):
        _, free = run(ker, device, prompt)
    own_log: list[Routed] = []
    with kernel_routing(log=own_log):
        own, _ = run(ker, device, prompt, tokens)

    n = len(prompt)
    each = rel_rows(want, got)
    worst = int(each.argmax())
    rel_all, rel_pre, rel_dec = rel(want, got), rel(want[:n], got[:n]), rel(want[n:], got[n:])
    flips = check_own_routing(ref, ref_log, own_log)
    kept = [p for p in range(want.shape[0]) if p not in {fl.position for fl in flips}]
    rel_own, rel_kept = rel(want, own), rel(want[kept], own[kept])
    flip_lines = "".join(f"\n  flip: {fl}" for fl in flips)
    print(f"{label}: reference routing forced: logits rel rms {rel_all:.2e} (prompt {rel_pre:.2e}, "
          f"decode {rel_dec:.2e}, worst position {worst} {each[worst]:.2e}); greedy {free}; own "
          f"routing: logits rel rms {rel_own:.2e}, {rel_kept:.2e} without the {len(flips)} positions "
          f"that took other experts{flip_lines}")
    for what, value, bound in (("all", rel_all, b.rel), ("prompt", rel_pre, b.rel), ("decode", rel_dec, b.decode)):
        assert value < bound, f"{label}: {what} logits relative RMS error {value:.2e} (reference routing)"
    assert each[worst] < b.position, (f"{label}: position {worst}: logits relative RMS error "
                                      f"{each[worst]:.2e} (reference routing)")
    rows = slice(n - 1, n + len(tokens))  # the rows whose greedy pick is fed (and the last)
    top2 = want[rows].topk(2, dim=1).values
    gaps = (top2[:, 0] - top2[:, 1]).tolist()
    picks = zip(want[rows].argmax(1).tolist(), got[rows].argmax(1).tolist())
    for i, (a, c) in enumerate(picks):
        assert c == a or gaps[i] < b.tie, f"{label}: step {i} picks {c}, reference {a}, gap {gaps[i]:.3f}"
    first = next((i for i, (a, c) in enumerate(zip(tokens, free)) if a != c), None)
    if first is not None:
        assert gaps[first] < b.tie, (f"{label}: free-running greedy differs at step {first}, "
                                     f"gap {gaps[first]:.3f}")
    wide = [fl for fl in flips if fl.x_rel < b.near and fl.gap >= b.flip_gap]
    assert not wide, f"{label}: experts flipped where the reference's router gap was wide:{flip_lines}"
    assert len(flips) <= b.max_flips, f"{label}: {len(flips)} positions took other experts:{flip_lines}"
    assert rel_kept < b.unforced, f"{label}: own routing: logits relative RMS error {rel_kept:.2e}"


def paged_run(model, device: str, prompt: list[int], forced: list[int] | None = None):
    """tests/test_qwen35_gpu.py's ``_run`` as a Run: the prompt in one paged step, then 3 decode
    steps, the recurrent state carried."""
    from test_qwen35_gpu import _run

    logits, fed, _ = _run(model, device, prompt, forced)
    return logits, fed


def compare_hybrid_moe(f, label: str, prompt: list[int], device: str = "cuda") -> None:
    """A hybrid MoE file (qwen35moe, qwen3next) on the kernel path on ``device`` (the CPU: the
    kernels in the interpreter) against its reference: compare_routed through paged_run."""
    ref = load_model(f)
    ker = ARCHITECTURES[ref.config.arch](ref.config, WeightSource(f, device, kernels=True))
    compare_routed(ref, ker, prompt, paged_run, label, device, HYBRID)
