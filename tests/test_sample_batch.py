"""The batched device sampler (deimos.kernels.triton.sample_batch). Oracle:
``sample_rows_reference``, a loop over rows through the sampler's own code (apply_penalties,
then choose), and, for rows built from Samplers, ``Sampler.sample`` itself with the same u.
Ids must be equal exactly, flags exactly where the 256-candidate window cannot decide
(hand-built rows at each edge of that rule), the logits bitwise unchanged after the call, and
each row's ordered window equal to the sampler's ``_topk(penalized row, 256)``.
Also the counter-based draw (``draw_uniform``, ``Sampler.next_uniform``).

Without CUDA the kernels run in Triton's interpreter at V of a few thousand (4097 and 5003:
two blocks, so topk's merge pass runs); the gpu test captures ``sample_rows`` in a CUDA graph
at B = 64, V = 151,936 and replays it on new inputs.
"""

from __future__ import annotations

import random
import time
from collections import Counter

import numpy as np
import pytest
import torch

from kernel_device import DEVICE, INTERPRETED  # noqa: I001  (first: sets TRITON_INTERPRET)

from deimos.kernels.sample_batch import (  # noqa: E402
    EXACT,
    HOST,
    NAN_ROW,
    WINDOW,
    SamplingRows,
    copy_rows,
    empty_rows,
    row_params,
    rows_for,
    sample_rows_reference,
)
from deimos.kernels.sampling import (  # noqa: E402
    Sampler,
    SamplingParams,
    _topk,
    apply_penalties,
    draw_uniform,
)
from deimos.kernels.token_mask import bits_of, n_words, set_ids  # noqa: E402
from deimos.kernels.triton.sample_batch import SampleScratch, sample_rows  # noqa: E402

POISON = -7  # neither an id nor a flag: an unwritten output shows
NEG_INF = float("-inf")


def _run(logits: torch.Tensor, rows: SamplingRows, windows: list | None = None,
         spare: int = 0, masks: tuple[torch.Tensor, torch.Tensor] | None = None
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """sample_rows on device copies (a scratch made for ``spare`` rows more; ``masks``: its
    words and masked arguments); (ids, flags) on the host. Checks the logits' bits;
    ``windows`` (if given) gets each row's ordered candidate ids."""
    n_b, v = logits.shape
    x = logits.to(DEVICE)
    before = x.clone()
    dev = SamplingRows(*(t.to(DEVICE) for t in rows))
    ids = torch.full((n_b,), POISON, dtype=torch.int64, device=DEVICE)
    flags = torch.full((n_b,), POISON, dtype=torch.int32, device=DEVICE)
    scratch = SampleScratch(n_b + spare, v, rows.pen_ids.shape[1], DEVICE)
    sample_rows(x, dev, ids, flags, scratch, *(m.to(DEVICE) for m in masks or ()))
    assert torch.equal(x.view(torch.int32), before.view(torch.int32)), "logits changed"
    if windows is not None:  # the ordered keys' low halves: 0xFFFFFFFF - id
        windows.extend((0xFFFFFFFF - (scratch.sorted[:n_b].cpu() & 0xFFFFFFFF)).tolist())
    return ids.cpu(), flags.cpu()


def _row(kind: str, v: int, g: torch.Generator) -> torch.Tensor:
    """One row of logits: normal; ties (half steps, the maximum tied, -0.0 beside 0.0);
    masked (a grammar: all but a few -inf); flat (top_p / min_p sets far beyond 256);
    peaked (one dominant token)."""
    x = torch.randn(v, generator=g) * 3
    if kind == "ties":
        x = torch.round(x * 2) / 2
        x[x == 0] = torch.where(torch.rand(v, generator=g) < 0.5, -0.0, 0.0)[x == 0]
        x[torch.randperm(v, generator=g)[:3]] = x.max()
    elif kind.startswith("masked"):
        keep = torch.randperm(v, generator=g)[: int(kind[6:])]
        y = torch.full((v,), NEG_INF)
        y[keep] = x[keep]
        x = y
    elif kind == "flat":
        x = torch.randn(v, generator=g) * 0.01
    elif kind == "peaked":
        x[int(torch.randint(v, (1,), generator=g))] = 30.0
    return x


# (kind, temperature, top_k, top_p, min_p, penalties): every path of the row kernel
FIXED = [
    ("normal", 0.0, 40, 0.95, 0.05, True),  # greedy after penalties
    ("ties", 0.0, 0, 1.0, 0.0, False),  # greedy: the lowest of the tied maxima
    ("normal", 0.8, 1, 1.0, 0.0, False),
    ("normal", 0.8, 40, 0.95, 0.05, True),  # llama.cpp's defaults
    ("ties", 1.5, 40, 1.0, 0.0, False),  # a tie across the k-th place
    ("ties", 0.3, 256, 0.5, 0.0, True),
    ("normal", 0.8, 0, 0.95, 0.0, False),  # top_p over the vocabulary's logsumexp
    ("normal", 0.8, 0, 1.0, 0.05, True),  # min_p alone: drawn in id order
    ("ties", 1.5, 0, 1.0, 0.5, False),
    ("flat", 0.8, 0, 0.95, 0.0, False),  # top_p's set beyond the window: HOST
    ("flat", 0.8, 0, 1.0, 0.0, False),  # no filter: HOST
    ("flat", 0.8, 0, 0.5, 0.05, False),  # min_p keeps the flat vocabulary: HOST
    ("masked5", 0.8, 40, 0.95, 0.0, True),  # -inf inside the top 40
    ("masked5", 0.8, 0, 1.0, 0.0, False),  # no filter: HOST (the set is the vocabulary)
    ("masked20", 1.5, 0, 0.95, 0.0, False),
    ("peaked", 0.8, 300, 0.9, 0.5, False),  # top_k > 256 with top_p, min_p keeps one
    ("normal", 0.8, 300, 1.0, 0.05, True),  # top_k > 256, min_p's set within the window
    ("normal", 0.8, 300, 0.9, 0.05, False),  # top_p over k > 256: HOST
    ("normal", 0.8, 10**6, 0.9, 0.0, False),  # top_k >= V is off
    ("ties", 0.8, 0, 0.95, 0.05, True),
]
TEMPS, TOP_K, TOP_P, MIN_P = (0.0, 0.3, 0.8, 1.5), (1, 40, 256, 0, 300), (0.5, 0.95, 1.0), (0.0, 0.05, 0.5)
KINDS = ("normal", "ties", "masked5", "masked300", "flat", "peaked")


def _mixed(v: int, n_random: int, seed: int, width: int = 24, nan_rows: int = 2):
    """Logits [B, V] and host rows: FIXED, then random settings, then NaN rows."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    cfgs = list(FIXED) + [(rng.choice(KINDS), rng.choice(TEMPS), rng.choice(TOP_K),
                           rng.choice(TOP_P), rng.choice(MIN_P), rng.random() < 0.5)
                          for _ in range(n_random)]  # fmt: skip
    cfgs += [("normal", t, 40, 0.95, 0.05, True) for t in (0.0, 0.8)][:nan_rows]
    rows = empty_rows(len(cfgs), width)
    x = torch.empty(len(cfgs), v)
    for b, (kind, temp, k, top_p, min_p, pen) in enumerate(cfgs):
        x[b] = _row(kind, v, g)
        rows.temperature[b], rows.top_k[b], rows.top_p[b], rows.min_p[b] = temp, k, top_p, min_p
        rows.u[b] = rng.random()
        if pen:  # distinct ids: some of the row's best (so the penalty reorders them), some any
            rows.repeat[b], rows.frequency[b], rows.presence[b] = 1.3, 0.2, 0.4
            best = torch.argsort(x[b], descending=True)[:8].tolist()
            ids = list(dict.fromkeys(best[: rng.randint(1, 8)] + rng.sample(range(v), 5)))
            rows.pen_ids[b, : len(ids)] = torch.tensor(ids)
            rows.pen_counts[b, : len(ids)] = torch.tensor([rng.randint(1, 5) for _ in ids],
                                                          dtype=torch.int32)
        if b >= len(cfgs) - nan_rows:
            x[b, rng.randrange(v)] = float("nan")
    return x, rows, cfgs


@pytest.mark.parametrize("v,n_random", [(3001, 28), (5003, 12), (4097, 4)], ids=lambda x: str(x))
def test_mixed_rows_equal_reference(v: int, n_random: int) -> None:
    x, rows, cfgs = _mixed(v, n_random, seed=v)
    want_ids, want_flags = sample_rows_reference(x, rows)
    windows: list[list[int]] = []
    got_ids, got_flags = _run(x, rows, windows)
    for b, cfg in enumerate(cfgs):
        # the window of a sampled row: the sampler's top 256 after penalties (a greedy row keeps
        # only its maximum, checked by its id)
        if want_flags[b] != NAN_ROW and cfg[1] > 0:
            p, counts, _ = row_params(rows, b)
            want_window = _topk(apply_penalties(x[b], counts, p), WINDOW)[1].tolist()
            assert windows[b] == want_window, f"row {b} {cfg}: window differs"
        assert (int(got_ids[b]), int(got_flags[b])) == (int(want_ids[b]), int(want_flags[b])), \
            f"row {b} {cfg}: got id {int(got_ids[b])} flag {int(got_flags[b])}, " \
            f"want id {int(want_ids[b])} flag {int(want_flags[b])}"
    seen = Counter(got_flags.tolist())
    assert seen[EXACT] >= len(FIXED) // 2 and seen[HOST] >= 4 and seen[NAN_ROW] == 2, seen
    assert (got_ids[got_flags != EXACT] == -1).all()


def _masks(x: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Allowed-token words for every other row of ``x``: a few tokens, some of them far from
    the row's best (outside the 256-candidate window unmasked), or half the vocabulary; a NaN
    row's NaN forbidden on one of its two rows (then not flagged)."""
    n_b, v = x.shape
    g = torch.Generator().manual_seed(seed)
    words = np.zeros((n_b, n_words(v) + 1), dtype=np.uint32)
    masked = torch.zeros(n_b, dtype=torch.int32)
    for b in range(0, n_b, 2):
        order = torch.argsort(x[b].nan_to_num(nan=-1e9), descending=True)
        few = [b % 5 + 2 * (b % 3), 300, 301, v - 1]
        pick = few if b % 4 else torch.randperm(v, generator=g)[: v // 2]
        keep = set(order[torch.as_tensor(pick)].tolist())
        nan = torch.isnan(x[b]).nonzero().flatten().tolist()
        if nan and b % 4 == 0:
            keep -= set(nan)
        set_ids(words[b], sorted(keep))
        masked[b] = 1
    return torch.from_numpy(words.view(np.int32)), masked


@pytest.mark.parametrize("v,n_random", [(3001, 20), (4097, 6)], ids=lambda x: str(x))
def test_masked_rows_equal_reference(v: int, n_random: int) -> None:
    """Rows with a grammar's allowed-token mask (every other row, with and without penalties,
    every filter): the same ids and flags as the reference's (the mask applied after the
    penalties), each decided id one the mask allows; the unmasked rows as without masks."""
    x, rows, _ = _mixed(v, n_random, seed=v + 1, nan_rows=2)
    words, masked = _masks(x, seed=v)
    want_ids, want_flags = sample_rows_reference(x, rows, words, masked)
    got_ids, got_flags = _run(x, rows, masks=(words, masked))
    assert torch.equal(got_flags, want_flags) and torch.equal(got_ids, want_ids)
    plain_ids, plain_flags = sample_rows_reference(x, rows)
    for b in range(x.shape[0]):
        if masked[b]:
            allowed = torch.from_numpy(bits_of(words[b].numpy(), v).copy())
            # (a row whose allowed logits are all -inf, as no model gives, draws among NEG)
            if got_flags[b] == EXACT and bool(torch.isfinite(x[b][allowed]).any()):
                assert allowed[int(got_ids[b])], f"row {b}: a forbidden id"
        else:
            assert (got_ids[b], got_flags[b]) == (plain_ids[b], plain_flags[b])
    assert int(((got_flags == EXACT) & (masked == 1)).sum()) >= 4
    changed = (masked == 1) & ((got_ids != plain_ids) | (got_flags != plain_flags))
    assert int(changed.sum()) >= 4, "the masks changed too few rows to test them"


def test_rows_from_samplers_equal_sampler_sample() -> None:
    """Rows built from live Samplers (penalty windows, their next draws): every decided id is
    what ``Sampler.sample`` of that row's raw logits gives with the row's u."""
    v, rng = 3001, random.Random(1)
    g = torch.Generator().manual_seed(1)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, repetition_penalty=r,
                             frequency_penalty=f, presence_penalty=pr, penalty_last_n=n, seed=s)
              for s, (t, k, p, m, r, f, pr, n) in enumerate([
                  (0.8, 40, 0.95, 0.05, 1.1, 0.0, 0.0, 64), (0.0, 40, 0.95, 0.05, 1.5, 0.3, 0.2, -1),
                  (1.2, 0, 0.9, 0.0, 1.0, 0.5, 0.0, 16), (0.7, 0, 1.0, 0.1, 1.2, 0.0, 0.6, 64),
                  (0.9, 300, 1.0, 0.02, 1.0, 0.0, 0.0, 0), (0.8, 1, 1.0, 0.0, 2.0, 0.0, 0.0, 8),
                  (1.5, 256, 0.7, 0.0, 1.05, 0.1, 0.1, -1), (0.8, 0, 1.0, 0.0, 1.1, 0.0, 0.0, 64)])]  # fmt: skip
    samplers, twins = [], []
    for p in params:
        s, twin = Sampler(p, v), Sampler(p, v)
        for t in [rng.randrange(40) for _ in range(30)]:  # repeats: counts above 1
            s.accept(t)
            twin.accept(t)
        samplers.append(s)
        twins.append(twin)
    rows = rows_for(samplers + [None], width=40)
    assert [s.draws for s in samplers] == [0 if p.greedy else 1 for p in params]
    assert int(rows.pen_counts.sum()) == sum(sum(s.penalty_counts().values()) for s in samplers)
    x = torch.stack([_row("ties", v, g) for _ in range(len(params) + 1)])
    x[:, :40] += 4.0  # the history's tokens are among the best: the penalties matter
    got_ids, got_flags = _run(x, rows)
    assert got_flags.tolist() == [EXACT] * 7 + [HOST, EXACT]  # no filter: the host's
    for b, twin in enumerate(twins):
        u = float(rows.u[b])
        assert twin.next_uniform() == u or twin.params.greedy  # the same stream
        host = twin.sample(x[b], u)
        if got_flags[b] == EXACT:
            assert int(got_ids[b]) == host, f"row {b}"
    assert int(got_ids[-1]) == int(torch.argmax(x[-1]))  # the padding row: greedy


def _plateau(v: int, n: int, top: float = 0.0, rest: float = -20.0) -> torch.Tensor:
    x = torch.full((v,), rest)
    x[torch.randperm(v, generator=torch.Generator().manual_seed(n))[:n]] = top
    return x


def test_flags_at_the_window_edge() -> None:
    """Rows at each edge of the window's rule (sample_batch's docstring): the flag and, when
    decided, the id equal the reference's; the flags equal the rule's by hand."""
    v = 3001
    g = torch.Generator().manual_seed(5)
    peaked = _row("peaked", v, g)
    two_peaks = peaked.clone()
    two_peaks[int(torch.argmin(peaked))] = 30.0
    cases = [  # (logits, temperature, top_k, top_p, min_p, want flag)
        (_plateau(v, 255), 0.8, 0, 1.0, 0.01, EXACT),  # min_p keeps 255: the 256th is below
        (_plateau(v, 256), 0.8, 0, 1.0, 0.01, HOST),  # exactly 256: its end is not seen
        (_plateau(v, 256), 0.8, 256, 1.0, 0.01, EXACT),  # top_k ends it at 256
        (_plateau(v, 300), 0.8, 0, 1.0, 0.01, HOST),
        (_plateau(v, 300, rest=-30), 0.8, 0, 255.5 / 300, 0.0, EXACT),  # top_p keeps 256
        (_plateau(v, 300, rest=-30), 0.8, 0, 256.5 / 300, 0.0, HOST),  # 257
        (_plateau(v, 300, rest=-30), 0.8, 0, 0.5, 0.0, EXACT),  # 150
        (_plateau(v, 100, rest=-1.0), 0.8, 0, 0.5, 0.5, EXACT),  # top_p unseen, min_p keeps 100
        (peaked, 0.8, 300, 0.9, 0.5, EXACT),  # top_p over 300 candidates, min_p keeps one
        (two_peaks, 0.8, 300, 0.9, 0.5, HOST),  # ... keeps two: top_p's cut is unknown
        (_plateau(v, 100, rest=-1.0), 0.8, 300, 1.0, 0.5, EXACT),  # top_k 300, min_p keeps 100
        (_plateau(v, 300), 0.8, 256, 1.0, 0.0, EXACT),
        (_plateau(v, 300), 0.8, 257, 1.0, 0.0, HOST),
        (_plateau(v, 300), 0.8, 0, 1.0, 0.0, HOST),  # no filter
        (_plateau(v, 300), 0.0, 0, 1.0, 0.0, EXACT),  # greedy: the lowest id of the plateau
    ]
    rows = empty_rows(len(cases), 1)
    for b, (_, temp, k, top_p, min_p, _) in enumerate(cases):
        rows.temperature[b], rows.top_k[b], rows.top_p[b], rows.min_p[b] = temp, k, top_p, min_p
        rows.u[b] = draw_uniform(99, b)
    x = torch.stack([c[0] for c in cases])
    want_flags = [c[-1] for c in cases]
    want_ids, ref_flags = sample_rows_reference(x, rows)
    assert ref_flags.tolist() == want_flags
    got_ids, got_flags = _run(x, rows, spare=3)  # a batch smaller than its scratch
    assert got_flags.tolist() == want_flags
    assert got_ids.tolist() == want_ids.tolist()
    assert int(got_ids[-1]) == int(torch.nonzero(x[-1] == 0.0)[0])


def test_bad_input() -> None:
    v, n_b, w = 1000, 3, 4
    x = torch.zeros(n_b, v, device=DEVICE)
    rows = empty_rows(n_b, w, DEVICE)
    scratch = SampleScratch(n_b, v, w, DEVICE)
    ids = torch.zeros(n_b, dtype=torch.int64, device=DEVICE)
    flags = torch.zeros(n_b, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"logits must be float32 \[B <= 3, 1000\]"):
        sample_rows(x[:, :999], rows, ids, flags, scratch)
    with pytest.raises(ValueError, match=r"temperature must be contiguous torch.float64 \[2\]"):
        sample_rows(x[:2], rows, ids, flags, scratch)
    with pytest.raises(ValueError, match="logits must be float32"):
        sample_rows(x.double(), rows, ids, flags, scratch)
    with pytest.raises(ValueError, match="top_p must be contiguous torch.float64"):
        sample_rows(x, rows._replace(top_p=rows.top_p.float()), ids, flags, scratch)
    with pytest.raises(ValueError, match=r"pen_ids must be contiguous torch.int64 \[3, 4\]"):
        sample_rows(x, rows._replace(pen_ids=rows.pen_ids[:, :2]), ids, flags, scratch)
    with pytest.raises(ValueError, match="out_ids"):
        sample_rows(x, rows, ids.int(), flags, scratch)
    words = torch.zeros(n_b, n_words(v), dtype=torch.int32, device=DEVICE)
    masked = torch.zeros(n_b, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="words and masked go together"):
        sample_rows(x, rows, ids, flags, scratch, words)
    with pytest.raises(ValueError, match=r"words must be int32 \[>= 3, >= 32\]"):
        sample_rows(x, rows, ids, flags, scratch, words[:, :31], masked)
    with pytest.raises(ValueError, match="masked int32"):
        sample_rows(x, rows, ids, flags, scratch, words, masked.long())
    with pytest.raises(ValueError, match="must exceed the window"):
        SampleScratch(n_b, 256, w, DEVICE)
    with pytest.raises(ValueError, match="width 2"):
        s = Sampler(SamplingParams(repetition_penalty=1.1), v)
        for t in (1, 2, 3):
            s.accept(t)
        rows_for([s], width=2)


# ---- the draw ----------------------------------------------------------------------------------


def _chi2(values: list[float], bins: int = 20) -> float:
    counts = Counter(int(u * bins) for u in values)
    e = len(values) / bins
    return sum((counts[i] - e) ** 2 / e for i in range(bins))


def test_draw_uniform_range_and_uniformity() -> None:
    # 19 degrees of freedom: P(chi2 > 43.8) = 0.001; the draws are fixed, so is the statistic
    along = [draw_uniform(1234, n) for n in range(10_000)]  # one stream
    across = [draw_uniform(s, 7) for s in range(10_000)]  # one draw of many seeds
    for us in (along, across):
        assert all(0.0 <= u < 1.0 for u in us)
        assert _chi2(us) < 43.8
        assert abs(sum(us) / len(us) - 0.5) < 0.01
    assert len(set(along)) == len(along)
    assert draw_uniform(2**64 - 1, 2**40) < 1.0
    # the same on every machine: the algorithm is pinned (splitmix64 of the mixed seed)
    assert draw_uniform(0, 0) == 0.8833108082136426
    with pytest.raises(ValueError, match="must be >= 0"):
        draw_uniform(-1, 0)


def test_same_seed_same_stream() -> None:
    p = SamplingParams(temperature=0.8, seed=42)
    a, b = Sampler(p, 100), Sampler(p, 100)
    stream = [a.next_uniform() for _ in range(50)]
    assert stream == [b.next_uniform() for _ in range(50)]
    assert stream == [draw_uniform(42, n) for n in range(50)] and a.draws == 50
    c = Sampler(SamplingParams(temperature=0.8, seed=43), 100)
    assert [c.next_uniform() for _ in range(50)] != stream


# ---- on the GPU: captured in a CUDA graph ------------------------------------------------------


@pytest.mark.gpu
def test_gpu_graph_capture_equals_reference() -> None:
    """sample_rows captured once in a CUDA graph (static logits, rows, outputs, scratch), then
    replayed on new inputs copied into the static tensors: each replay equals the reference,
    the logits unchanged; prints the replay time at B = 64, V = 151,936."""
    if INTERPRETED or not torch.cuda.is_available():
        pytest.fail("gpu test needs CUDA (run on the GPU machine)")
    n_b, v, w = 64, 151936, 24
    logits = torch.zeros(n_b, v, device="cuda")
    rows = empty_rows(n_b, w, "cuda")
    scratch = SampleScratch(n_b, v, w, "cuda")
    ids = torch.full((n_b,), POISON, dtype=torch.int64, device="cuda")
    flags = torch.full((n_b,), POISON, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles the kernels outside the capture
        sample_rows(logits, rows, ids, flags, scratch)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sample_rows(logits, rows, ids, flags, scratch)
    for trial in range(3):
        x, host_rows, _ = _mixed(v, n_b - len(FIXED) - 2, seed=100 + trial, width=w)
        logits.copy_(x)
        copy_rows(rows, host_rows)
        ids.fill_(POISON)
        flags.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(logits.cpu().view(torch.int32), x.view(torch.int32)), "logits changed"
        want_ids, want_flags = sample_rows_reference(x, host_rows)
        assert flags.cpu().tolist() == want_flags.tolist(), trial
        assert ids.cpu().tolist() == want_ids.tolist(), trial
    reps = 50
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize()
    print(f"sample_rows B={n_b} V={v}: {(time.perf_counter() - t0) / reps * 1e6:.1f} us a replay")


def test_packed_views_one_copy_moves_every_part() -> None:
    """DeviceRows' inputs live in one buffer (one host-to-device copy a step): each part a
    view at an 8-byte aligned offset, none overlapping, and a copy of the whole buffer into
    another of the same parts carries every part's values."""
    from deimos.engine.device_sampling import packed_views

    parts = [("f64", torch.float64, (4, 3)), ("ids", torch.int64, (3, 5)), ("f32", torch.float32, (3, 3)),
             ("k", torch.int32, (3,)), ("m", torch.int32, (3,)), ("c", torch.int32, (3, 5))]
    src, a = packed_views(parts, torch.device("cpu"))
    dst, b = packed_views(parts, torch.device("cpu"))
    spans = []
    for name, dtype, shape in parts:
        v = a[name]
        assert v.dtype == dtype and tuple(v.shape) == shape and v.is_contiguous(), name
        off = v.data_ptr() - src.data_ptr()
        assert off % 8 == 0, name
        spans.append((off, off + v.numel() * v.element_size()))
        assert torch.count_nonzero(v) == 0, name
    spans.sort()
    assert all(e0 <= s1 for (_, e0), (s1, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= src.numel()
    g = torch.Generator().manual_seed(3)
    for name, dtype, shape in parts:
        a[name].copy_(torch.randint(-1000, 1000, shape, generator=g).to(dtype))
    dst.copy_(src)
    for name, _, _ in parts:
        assert torch.equal(a[name], b[name]), name
