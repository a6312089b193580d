"""CPU expert misses (deimos.runtime.cpu_experts) against the float64 oracle
``moe_misses_reference`` (deimos.quant's bit-exact decode, float64 products)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from deimos.gguf.constants import GGMLType
from deimos.quant import get_format

try:
    import ggml
except ImportError:  # the exact backend's tests still run
    ggml = None

from deimos.runtime.cpu_experts import (
    CpuExperts,
    ExpertMatrix,
    LayerExperts,
    moe_misses_reference,
    quantize_planes,
)

needs_ggml = pytest.mark.skipif(ggml is None, reason="ggml-python is not installed")
E, F, D = 5, 256, 512  # k-quant blocks fit every width; n_ff != n_embd shows a swapped shape


def make_layer(gate_up: GGMLType, down: GGMLType, seed: int = 0, n_ff: int = F, n_embd: int = D) -> LayerExperts:
    rng = np.random.default_rng(seed)

    def mat(t: GGMLType, n_out: int, n_in: int, name: str) -> ExpertMatrix:
        f = get_format(t)
        raw = f.random_blocks(E * n_out * n_in // f.block_size, rng).reshape(E, n_out, -1)
        return ExpertMatrix(raw, t, n_out, n_in, name)

    return LayerExperts(mat(gate_up, n_ff, n_embd, "gate"), mat(gate_up, n_ff, n_embd, "up"),
                        mat(down, n_embd, n_ff, "down"))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


# (token row, expert, weight): edges (expert 0, the last), a token with several misses, one
# expert chosen by several tokens, a row twice with the same expert
MISSES = ([0, 0, 3, 6, 2, 6, 6], [0, E - 1, E - 1, 1, 0, E - 1, E - 1], [0.5, 0.25, 1.0, 0.3, 0.7, 0.1, 0.2])
T = 7

MIXES = [(GGMLType.Q4_K, GGMLType.Q6_K), (GGMLType.Q8_0, GGMLType.Q8_0),
         (GGMLType.IQ4_XS, GGMLType.Q5_K), (GGMLType.Q4_0, GGMLType.Q3_K)]
ids = [f"{a.name}-{b.name}" for a, b in MIXES]


@pytest.mark.parametrize("mix", MIXES, ids=ids)
def test_exact_backend_matches_float64_oracle(mix):
    lay = make_layer(*mix)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(1))
    ref = moe_misses_reference(x, lay, *MISSES)
    out = CpuExperts([lay], backend="exact")(0, x, *MISSES)
    err = rel_err(out, ref)
    assert err < 1e-6, f"exact backend rel err {err:.2e}"
    assert torch.all(out[[1, 4, 5]] == 0)  # rows without misses


@needs_ggml
@pytest.mark.parametrize("planes,tol", [(1, 5e-2), (2, 5e-4), (3, 3e-6)], ids=["planes1", "planes2", "planes3"])
@pytest.mark.parametrize("mix", MIXES, ids=ids)
def test_ggml_backend_against_float64_oracle(mix, planes, tol):
    lay = make_layer(*mix)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(2))
    ref = moe_misses_reference(x, lay, *MISSES)
    cpu = CpuExperts([lay], backend="ggml", planes=planes)
    assert cpu.backend(0) == "ggml"
    out = cpu(0, x, *MISSES)
    err = rel_err(out, ref)
    print(f"{mix[0].name}/{mix[1].name} planes={planes}: rel err {err:.2e}, "
          f"max diff {(out.double() - ref).abs().max().item():.2e}")
    assert err < tol
    assert torch.all(out[[1, 4, 5]] == 0)


@needs_ggml
def test_ggml_same_expert_for_every_token_and_many_calls():
    """Every token on the last expert, then varying miss counts (plans per count reused)."""
    lay = make_layer(GGMLType.Q4_K, GGMLType.Q6_K, seed=3)
    cpu = CpuExperts([lay], backend="ggml", planes=3)
    g = torch.Generator().manual_seed(3)
    for m in (9, 1, 4, 9):
        x = torch.randn(m, D, generator=g)
        rows, experts, w = np.arange(m), np.full(m, E - 1), np.linspace(0.1, 1, m)
        err = rel_err(cpu(0, x, rows, experts, w), moe_misses_reference(x, lay, rows, experts, w))
        assert err < 3e-6, (m, err)


@pytest.mark.parametrize("backend", ["ggml", "exact"])
@pytest.mark.parametrize("planes", [1, 2, 3])
@pytest.mark.parametrize("mix", MIXES, ids=ids)
def test_token_path_equals_the_rows_path(mix, planes, backend):
    """CpuExperts.token (a decode step's misses: x's planes once, no per-miss copies) gives
    __call__'s sums for that token bit for bit, added to what ``out`` held; miss counts of 1
    to 5 on one layer (a plan per count), expert 0 and the last among them."""
    if backend == "ggml" and ggml is None:
        pytest.skip("ggml-python is not installed")
    lay = make_layer(*mix, seed=11)
    cpu = CpuExperts([lay], backend=backend, planes=planes)
    g = torch.Generator().manual_seed(12)
    for experts in ([E - 1], [0, 3], [4, 0, 2, 1, 3], [2, 4, 0]):
        x = torch.randn(1, D, generator=g) * 3
        w = np.linspace(0.2, 1.0, len(experts)).astype(np.float32)
        e = np.array(experts)
        want = cpu(0, x, np.zeros(len(experts), np.int64), e, w)[0]
        base = torch.randn(D, generator=g)
        out = base.numpy().copy()
        cpu.token(0, x[0].numpy(), e, w, out)
        assert np.array_equal(out, (want + base).numpy()), (experts, planes)
        assert np.allclose(out, (want + base).numpy(), rtol=1e-5, atol=1e-5)


def test_token_path_bad_input():
    lay = make_layer(GGMLType.Q8_0, GGMLType.Q8_0)
    cpu = CpuExperts([lay], backend="exact")
    x, out = np.zeros(D, np.float32), np.zeros(D, np.float32)
    with pytest.raises(ValueError, match="expert outside"):
        cpu.token(0, x, np.array([0, E]), np.ones(2, np.float32), out)
    with pytest.raises(ValueError, match="weights"):
        cpu.token(0, x, np.array([0, 1]), np.ones(3, np.float32), out)
    with pytest.raises(ValueError, match="width"):
        cpu.token(0, x[:-1], np.array([0]), np.ones(1, np.float32), out)
    cpu.token(0, x, np.array([], np.int64), np.ones(0, np.float32), out)  # no misses: nothing
    assert not out.any()


def test_out_accumulates_and_no_misses_leave_it_alone():
    lay = make_layer(GGMLType.Q8_0, GGMLType.Q8_0, seed=4)
    cpu = CpuExperts([lay])
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(4))
    base = torch.randn(T, D, generator=torch.Generator().manual_seed(5))
    out = base.clone()
    assert cpu(0, x, [], [], [], out=out) is out and torch.equal(out, base)
    cpu(0, x, *MISSES, out=out)
    ref = moe_misses_reference(x, lay, *MISSES) + base.double()
    assert rel_err(out, ref) < 1e-4
    assert torch.equal(out[[1, 4, 5]], base[[1, 4, 5]])


@needs_ggml
def test_formats_without_an_8bit_activation_type_run_exact():
    """Q4_1's dot in ggml takes Q8_1 activations (not quantized here): auto falls back to the
    exact backend for that layer; backend='ggml' refuses it."""
    lays = [make_layer(GGMLType.Q4_K, GGMLType.Q4_K, seed=6), make_layer(GGMLType.Q4_1, GGMLType.Q4_1, seed=7)]
    cpu = CpuExperts(lays)
    assert (cpu.backend(0), cpu.backend(1)) == ("ggml", "exact")
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(8))
    assert rel_err(cpu(1, x, *MISSES), moe_misses_reference(x, lays[1], *MISSES)) < 1e-6
    with pytest.raises(ValueError, match="8-bit activation"):
        CpuExperts(lays, backend="ggml")


@needs_ggml
@pytest.mark.parametrize("act", [15, 8], ids=["Q8_K", "Q8_0"])
def test_one_plane_is_ggmls_own_quantization(act):
    """quantize_planes(x, t, 1) equals ggml's from_float for the activation type byte for byte
    (what llama.cpp feeds its dot products)."""
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((3, 512)) * np.array([[1.0], [1e-3], [40.0]])).astype(np.float32)
    x[0, :256] = 0  # an all-zero block
    x[1, 7] = -x[1].__abs__().max() * 2  # the largest magnitude negative
    ours = quantize_planes(x, act, 1)
    traits = ggml.ggml_get_type_traits_cpu(act).contents
    for r in range(3):
        theirs = np.zeros(ours[r].nbytes, np.uint8)
        row = np.ascontiguousarray(x[r])
        traits.from_float(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), theirs.ctypes.data, 512)
        assert theirs.tobytes() == ours[r].tobytes(), f"row {r}"


@needs_ggml
@pytest.mark.parametrize("act", [15, 8], ids=["Q8_K", "Q8_0"])
@pytest.mark.parametrize("planes", [1, 2, 3])
def test_the_c_quantizer_gives_the_planes_of_quantize_planes(act, planes):
    """The engine's planes (_Planes: ggml's from_float a plane, the residual in numpy) are
    quantize_planes' byte for byte, rows of every scale."""
    from deimos.runtime.cpu_experts import _Planes

    rng = np.random.default_rng(act * 10 + planes)
    x = (rng.standard_normal((4, 512)) * np.array([[1.0], [1e-3], [40.0], [3.0]])).astype(np.float32)
    x[0, :256] = 0
    want = quantize_planes(x, act, planes)
    got = _Planes(ggml, act, planes).quantize(x, np.empty_like(want))
    assert got.tobytes() == want.tobytes()


@needs_ggml
@pytest.mark.parametrize("act", [15, 8], ids=["Q8_K", "Q8_0"])
def test_a_reused_planes_target_gives_each_call_its_own_planes(act):
    """The decode path's prepared buffers (_Planes.target, quantize_into: planes first) written
    again and again: each call's bytes are quantize_planes' of that call's x, planes first,
    with nothing left from the call before (an all-zero block after a nonzero one, whose
    bsums ggml does not write)."""
    from deimos.runtime.cpu_experts import _Planes

    rng = np.random.default_rng(act)
    q = _Planes(ggml, act, 2)
    out = np.empty((2, 3, 512 // (256 if act == 15 else 32)), dtype=quantize_planes(
        np.ones((1, 512), np.float32), act, 1).dtype)
    t = q.target(out)
    for scale in (1.0, 1e-3, 40.0):
        x = (rng.standard_normal((3, 512)) * scale).astype(np.float32)
        if scale != 1.0:
            x[1, 256:] = 0
        q.quantize_into(x, t)
        want = quantize_planes(x, act, 2).transpose(1, 0, 2)
        assert out.tobytes() == np.ascontiguousarray(want).tobytes(), f"scale {scale}"
    with pytest.raises(ValueError, match="rows"):
        q.quantize_into(np.zeros((2, 512), np.float32), t)


def test_bad_input():
    lay = make_layer(GGMLType.Q8_0, GGMLType.Q8_0)
    cpu = CpuExperts([lay], backend="exact")
    x = torch.randn(T, D)
    with pytest.raises(ValueError, match="float32"):
        cpu(0, x.double(), *MISSES)
    with pytest.raises(ValueError, match="expert outside"):
        cpu(0, x, [0], [E], [1.0])
    with pytest.raises(ValueError, match="row outside"):
        cpu(0, x, [T], [0], [1.0])
    with pytest.raises(ValueError, match="2 rows, 1 experts"):
        cpu(0, x, [0, 1], [0], [1.0, 1.0])
    with pytest.raises(ValueError, match="backend"):
        CpuExperts([lay], backend="blas")
    with pytest.raises(ValueError, match="disagree"):
        LayerExperts(lay.gate, lay.up, lay.gate)
    with pytest.raises(ValueError, match="want uint8"):
        ExpertMatrix(lay.gate.raw[:, :, :-1], GGMLType.Q8_0, F, D)


@needs_ggml
def test_ggml_thread_pool_gives_the_disposable_pools_answer():
    """The persistent pool (made once, 3 threads) computes what ggml's per-compute threads
    compute, bit for bit, call after call (two layers, the same plans reused)."""
    layers = [make_layer(GGMLType.Q4_K, GGMLType.Q6_K, seed=s) for s in (0, 1)]
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(4))
    pooled = CpuExperts(layers, backend="ggml", n_threads=3)
    plain = CpuExperts(layers, backend="ggml", n_threads=3, pool=False)
    assert pooled._pool is not None and pooled._pool.n_threads == 3 and plain._pool is None
    for _ in range(3):
        for i in (0, 1):
            assert torch.equal(pooled(i, x, *MISSES), plain(i, x, *MISSES))


@needs_ggml
@pytest.mark.parametrize("mix", MIXES[:2], ids=ids[:2])
def test_batched_miss_counts_share_bucketed_plans(mix):
    """Above PLAN_BUCKET misses a layer's plan is the next multiple of it, the extra rows a
    repeat of the last miss: the sums equal an exact-count plan's bit for bit, and miss counts
    17..32 share one plan (a batched decode's count changes every step)."""
    from deimos.runtime.cpu_experts import PLAN_BUCKET

    lay = make_layer(*mix, seed=3)
    bucketed, exact = CpuExperts([lay]), CpuExperts([lay])
    exact._ggml[0].bucket = 1 << 30
    rng = np.random.default_rng(4)
    t = 9
    x = torch.from_numpy(rng.standard_normal((t, D)).astype(np.float32) * 2)
    for m in (PLAN_BUCKET + 1, 2 * PLAN_BUCKET - 3, 2 * PLAN_BUCKET, PLAN_BUCKET):
        rows = np.sort(rng.integers(0, t, m))
        experts = rng.integers(0, E, m)
        w = rng.random(m).astype(np.float32)
        got, want = bucketed(0, x, rows, experts, w), exact(0, x, rows, experts, w)
        assert torch.equal(got, want), m
    assert sorted(bucketed._ggml[0]._plans) == [PLAN_BUCKET, 2 * PLAN_BUCKET]
    assert sorted(exact._ggml[0]._plans) == sorted({PLAN_BUCKET + 1, 2 * PLAN_BUCKET - 3, 2 * PLAN_BUCKET,
                                                    PLAN_BUCKET})
