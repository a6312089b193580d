"""Layer kernels (deimos.kernels.triton) against their torch references (deimos.kernels.*).

Oracles: rms_norm / add_rms_norm, rope_cos_sin + apply_rope (float64 angles), gated_act,
causal_attention (float32, k_pos = arange), torch.argmax (first maximum) and the CPU sampler's
``_topk`` (exact ids, ties by lowest id). Float kernels: relative RMS error with the max
difference printed; outputs are poisoned with NaN before each launch and the cache past the
valid keys is NaN too, so an unwritten output or a read past the mask shows.

Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1 set before the import);
tests marked ``gpu`` use real shapes, print timings and fail without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from kernel_device import DEVICE, INTERPRETED  # noqa: I001  (first: sets TRITON_INTERPRET)
from kernel_checks import close as _close  # noqa: E402
from kernel_checks import rand as _rand  # noqa: E402

from deimos.kernels import activation as ref_act  # noqa: E402
from deimos.kernels import attention as ref_attn  # noqa: E402
from deimos.kernels import norm as ref_norm  # noqa: E402
from deimos.kernels import rope as ref_rope  # noqa: E402
from deimos.kernels.sampling import _topk  # noqa: E402
from deimos.kernels.triton import (  # noqa: E402
    add_rms_norm,
    apply_rope,
    argmax,
    decode_attention,
    gated_act,
    prefill_attention,
    rms_norm,
    rope,
    rope_inv_freq,
    topk,
)

NAN = float("nan")




def _tol(dtype: torch.dtype) -> float:
    return 2e-3 if dtype == torch.float16 else 1e-5


def _poison(like: torch.Tensor) -> torch.Tensor:
    return torch.full(like.shape, NAN, dtype=like.dtype, device=like.device)


# ---- RMSNorm ------------------------------------------------------------------------------------

DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
# (1, 1000), (2, 2560): a decode row split over programs of 256 (the last partly masked)
@pytest.mark.parametrize("t,d", [(1, 64), (7, 60), (63, 576), (1, 1000), (2, 2560)], ids=lambda v: str(v))
def test_rms_norm(t: int, d: int, dtype: torch.dtype) -> None:
    x = _rand(t, d, seed=t + d, dtype=dtype, scale=3.0)
    w = _rand(d, seed=d, dtype=torch.float32)
    out = _poison(x)
    y = rms_norm(x, w, 1e-6, out=out)
    ref = ref_norm.rms_norm(x.cpu(), w.cpu(), 1e-6)
    _close(f"rms_norm t={t} d={d} {dtype}", y, ref, _tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
# (1, 1000), (2, 2560): a decode row split over programs of 256 (the last partly masked)
@pytest.mark.parametrize("t,d", [(1, 64), (7, 60), (63, 576), (1, 1000), (2, 2560)], ids=lambda v: str(v))
def test_add_rms_norm(t: int, d: int, dtype: torch.dtype) -> None:
    x = _rand(t, d, seed=t, dtype=dtype)
    r = _rand(t, d, seed=t + 1, dtype=dtype, scale=4.0)
    w = _rand(d, seed=d, dtype=torch.float16)
    ref_y, ref_r = ref_norm.add_rms_norm(x.cpu(), r.cpu(), w.cpu(), 1e-5)
    y, r2 = add_rms_norm(x, r, w, 1e-5, out=_poison(x), residual_out=_poison(r))
    _close(f"add_rms_norm y t={t} d={d}", y, ref_y, _tol(dtype))
    _close(f"add_rms_norm r t={t} d={d}", r2, ref_r, 1e-6)  # one rounded add: exact
    # in place on the residual, x a strided view (every other row of a bigger tensor)
    xs = torch.repeat_interleave(x, 2, dim=0)[::2]
    y3, r3 = add_rms_norm(xs, r, w, 1e-5, residual_out=r)
    assert r3 is r
    _close(f"add_rms_norm in place t={t} d={d}", y3, ref_y, _tol(dtype))
    _close(f"add_rms_norm in place r t={t} d={d}", r, ref_r, 1e-6)


def test_add_rms_norm_without_residual_and_errors() -> None:
    x = _rand(3, 32, seed=5)
    w = _rand(32, seed=6)
    y, r = add_rms_norm(x, None, w, 1e-6)
    assert r is x
    _close("add_rms_norm no residual", y, ref_norm.rms_norm(x.cpu(), w.cpu(), 1e-6), 1e-5)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(x, w[:16], 1e-6)
    with pytest.raises(ValueError, match="x must be"):
        rms_norm(x[0], w, 1e-6)
    with pytest.raises(ValueError, match="are not the 3 rows of x"):  # the kernel would write past it
        add_rms_norm(x, x.clone(), w, 1e-6, out=torch.empty_like(x[:2]))
    with pytest.raises(ValueError, match=r"residual \(2, 32\) .* does not match x \(3, 32\)"):
        add_rms_norm(x, x[:2].clone(), w, 1e-6)


# ---- RoPE ---------------------------------------------------------------------------------------

ROPE_CASES = [
    # (T, Hq, Hk, D, rope_dim, type, freq_factors, dtype)
    (1, 4, 2, 64, 64, "norm", False, torch.float32),
    (7, 4, 2, 64, 64, "neox", False, torch.float16),
    (63, 4, 2, 32, 32, "norm", False, torch.float16),
    (7, 3, 1, 80, 32, "neox", True, torch.float32),  # partial rotation, odd heads, factors
    (63, 4, 2, 256, 256, "neox", False, torch.float32),
    (7, 4, 2, 64, 48, "norm", True, torch.float32),
]


@pytest.mark.parametrize(
    "case", ROPE_CASES, ids=lambda c: f"T{c[0]}_h{c[1]}x{c[2]}_d{c[3]}_r{c[4]}_{c[5]}"
    + ("_ff" if c[6] else "") + f"_{str(c[7])[6:]}")  # fmt: skip
def test_rope(case: tuple) -> None:
    t, hq, hk, d, rd, kind, use_ff, dtype = case
    # q and k as views of one fused qkv output [T, (Hq + 2 Hk) * D], as a model produces them
    qkv = _rand(t, (hq + 2 * hk) * d, seed=t * d, dtype=dtype)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    g = torch.Generator().manual_seed(t)
    pos = torch.randint(0, 4096, (t,), generator=g).to(DEVICE)
    ff = (1.0 + torch.rand(rd // 2, generator=g) * 7.0) if use_ff else None
    base, scale = 10000.0, 0.5 if use_ff else 1.0
    cos, sin = ref_rope.rope_cos_sin(pos.cpu(), rd, base, scale, ff)
    ref_q = ref_rope.apply_rope(q.cpu(), cos, sin, kind)
    ref_k = ref_rope.apply_rope(k.cpu(), cos, sin, kind)
    # fp32 angles vs float64: ~pos * 2^-24 rad
    tol = 2e-3 if dtype == torch.float16 else 2e-4
    label = f"rope {case}"
    qo, ko = rope(q, k, pos, rd, base, kind, scale, ff)
    _close(label + " q", qo, ref_q, tol)
    _close(label + " k", ko, ref_k, tol)
    inv = rope_inv_freq(rd, base, scale, ff, DEVICE)
    qo2, ko2 = apply_rope(q, k, pos.to(torch.int32), inv, kind, inplace=True)
    assert qo2 is q and ko2 is k
    _close(label + " q in place", q, ref_q, tol)
    _close(label + " k in place", k, ref_k, tol)
    if rd < d:  # dims past rope_dim are copied bit for bit
        assert torch.equal(qo[..., rd:].cpu(), ref_q[..., rd:])


@pytest.mark.parametrize("case", [(1, 4, 2, 128, 128, "neox"), (5, 3, 1, 80, 32, "norm")],
                         ids=lambda c: f"T{c[0]}_d{c[3]}_r{c[4]}_{c[5]}")
def test_rope_with_head_norms(case: tuple) -> None:
    """qk-norm fused into RoPE (one launch, k and v into the cache): oracle = the reference
    RMSNorm of every head, then the reference rotation."""
    t, hq, hk, d, rd, kind = case
    qkv = _rand(t, (hq + 2 * hk) * d, seed=d, scale=5.0)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    v = qkv[:, (hq + hk) * d :].view(t, hk, d)
    qn, kn = _rand(d, seed=1) + 1.0, _rand(d, seed=2) + 1.0
    pos = torch.arange(3, 3 + t, device=DEVICE)
    cos, sin = ref_rope.rope_cos_sin(pos.cpu(), rd, 1e6, 1.0, None)
    ref_q = ref_rope.apply_rope(ref_norm.rms_norm(q.cpu().reshape(-1, d), qn.cpu(), 1e-6).view(t, hq, d),
                                cos, sin, kind)  # fmt: skip
    ref_k = ref_rope.apply_rope(ref_norm.rms_norm(k.cpu().reshape(-1, d), kn.cpu(), 1e-6).view(t, hk, d),
                                cos, sin, kind)  # fmt: skip
    k_cache = torch.full((t + 8, hk, d), NAN, device=DEVICE)
    v_cache = torch.full((t + 8, hk, d), NAN, device=DEVICE)
    inv = rope_inv_freq(rd, 1e6, device=DEVICE)
    want_v = v.clone()
    apply_rope(q, k, pos.to(torch.int32), inv, kind, inplace=True, cache=(v, k_cache, v_cache),
               head_norms=(qn, kn, 1e-6))  # fmt: skip
    _close("rope+norm q", q, ref_q, 2e-4)
    _close("rope+norm k", k_cache[3 : 3 + t], ref_k, 2e-4)
    assert torch.equal(v_cache[3 : 3 + t].cpu(), want_v.cpu())
    with pytest.raises(ValueError, match="head-norm weight"):
        apply_rope(q, k, pos, inv, kind, head_norms=(qn[:16], kn, 1e-6))


def test_rope_errors() -> None:
    q = _rand(2, 4, 64, seed=1)
    inv = rope_inv_freq(64, 10000.0, device=DEVICE)
    with pytest.raises(ValueError, match="positions"):
        apply_rope(q, None, torch.zeros(3, dtype=torch.long, device=DEVICE), inv, "norm")
    with pytest.raises(ValueError, match="rope type"):
        apply_rope(q, None, torch.zeros(2, dtype=torch.long, device=DEVICE), inv, "yarn")
    with pytest.raises(ValueError, match="inv_freq"):
        apply_rope(q, None, torch.zeros(2, dtype=torch.long, device=DEVICE),
                   rope_inv_freq(128, 1e4, device=DEVICE), "norm")  # fmt: skip


# ---- gated activations --------------------------------------------------------------------------


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("t,f", [(1, 64), (7, 1000), (63, 1536)], ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gated_act(t: int, f: int, act: str, dtype: torch.dtype) -> None:
    gu = _rand(t, 2 * f, seed=t + f, dtype=dtype, scale=4.0)  # fused gate_up output
    gate, up = gu[:, :f], gu[:, f:]
    out = gated_act(gate, up, act, out=_poison(gate.contiguous()))
    ref = ref_act.gated_act(gate.cpu().float(), up.cpu().float(), act)
    _close(f"{act} t={t} f={f} {dtype}", out, ref, _tol(dtype))


def test_gated_act_errors() -> None:
    g = _rand(2, 8, seed=1)
    with pytest.raises(ValueError, match="unknown activation"):
        gated_act(g, g, "relu")
    with pytest.raises(ValueError, match="same"):
        gated_act(g, g[:, :4], "silu")


# ---- attention ----------------------------------------------------------------------------------


def _cache(s_valid: int, capacity: int, hkv: int, d: int, seed: int, dtype=torch.float16):
    """k, v [capacity, Hkv, D]: random keys 0..s_valid-1, NaN after (never to be read)."""
    k = torch.full((capacity, hkv, d), NAN, dtype=dtype)
    v = torch.full((capacity, hkv, d), NAN, dtype=dtype)
    k[:s_valid] = _rand(s_valid, hkv, d, seed=seed, dtype=dtype).cpu()
    v[:s_valid] = _rand(s_valid, hkv, d, seed=seed + 1, dtype=dtype).cpu()
    return k.to(DEVICE), v.to(DEVICE)


def _attn_ref(q, k, v, q_pos, n_keys, scale, window):
    return ref_attn.causal_attention(
        q.float().cpu(), k[:n_keys].float().cpu(), v[:n_keys].float().cpu(),
        q_pos.long().cpu(), torch.arange(n_keys), scale, window,
    )  # fmt: skip


PREFILL_CASES = [
    # (T, start, Hq, Hkv, D, window)
    (1, 0, 4, 2, 64, 0),
    (7, 0, 4, 2, 32, 0),
    (7, 100, 4, 2, 64, 0),
    (63, 0, 4, 2, 64, 0),
    (63, 37, 4, 2, 32, 16),
    (63, 90, 4, 2, 256, 0),
    (63, 90, 4, 1, 64, 40),
    (7, 200, 2, 2, 64, 5),
]


@pytest.mark.parametrize("case", PREFILL_CASES,
                         ids=lambda c: "T{}_p{}_h{}x{}_d{}_w{}".format(*c))  # fmt: skip
@pytest.mark.parametrize("device_start", [False, True], ids=["host_start", "device_start"])
def test_prefill_attention(case: tuple, device_start: bool) -> None:
    """``device_start``: the start read from the chunk's positions on the device (what a
    prefill graph replays); the cache beyond the chunk holds garbage that must not be read."""
    t, start, hq, hkv, d, window = case
    n = start + t
    k, v = _cache(n, n + 45, hkv, d, seed=t + start + d)
    q = _rand(t, hq, d, seed=d + 3, dtype=torch.float16)
    scale = d**-0.5
    where = torch.arange(start, n, dtype=torch.int32, device=q.device) if device_start else start
    out = prefill_attention(q, k, v, where, scale, window, out=_poison(q))
    ref = _attn_ref(q, k, v, torch.arange(start, n), n, scale, window)
    _close(f"prefill {case}", out, ref, 3e-3)


DECODE_CASES = [
    # (q positions, capacity, Hq, Hkv, D, window)
    ((0,), 64, 4, 2, 64, 0),
    ((299,), 300, 4, 2, 64, 0),
    ((262,), 400, 4, 2, 32, 0),
    ((262,), 400, 4, 2, 64, 100),
    ((700,), 800, 4, 2, 256, 0),
    ((130, 131, 132), 200, 8, 1, 64, 0),  # three drafted tokens, one kv head for 8
    ((130, 131, 132), 200, 4, 2, 64, 50),
]


@pytest.mark.parametrize("case", DECODE_CASES,
                         ids=lambda c: "p{}_cap{}_h{}x{}_d{}_w{}".format(c[0][-1], *c[1:]))
def test_decode_attention(case: tuple) -> None:
    q_pos, cap, hq, hkv, d, window = case
    n = q_pos[-1] + 1
    k, v = _cache(n, cap, hkv, d, seed=n + d)
    q = _rand(len(q_pos), hq, d, seed=d, dtype=torch.float16)
    pos = torch.tensor(q_pos, dtype=torch.int32, device=DEVICE)
    scale = d**-0.5
    out = decode_attention(q, k, v, pos, scale, window, out=_poison(q))
    _close(f"decode {case}", out, _attn_ref(q, k, v, pos, n, scale, window), 3e-3)


FUSED_ROPE_CASES = [
    # (q_pos, cap, Hq, Hkv, D, R, rope type, head norms, window)
    (0, 200, 4, 2, 64, 64, "norm", False, 0),
    (63, 200, 4, 2, 64, 64, "neox", True, 0),
    (64, 200, 8, 2, 64, 32, "norm", True, 0),
    (130, 200, 4, 1, 128, 128, "neox", False, 40),
    (199, 200, 6, 2, 32, 32, "norm", False, 0),
]


@pytest.mark.parametrize("case", FUSED_ROPE_CASES, ids=lambda c: "p{}_cap{}_h{}x{}_d{}_r{}_{}_n{}_w{}".format(*c))
def test_decode_attention_fused_rope(case: tuple) -> None:
    """RoPE (and qk-norm) fused into the decode attention launch (``new=NewToken``) against
    apply_rope writing the cache, then the plain decode attention: the same output, and the
    same rows q_pos of the k and v caches (row q_pos of the fused call's cache held garbage)."""
    from deimos.kernels.triton.decode_attention import NewToken

    q_pos, cap, hq, hkv, d, r, kind, norms, window = case
    k_c, v_c = _cache(q_pos, cap, hkv, d, seed=q_pos + d)
    qkv = _rand(1, hq + 2 * hkv, d, seed=d + 1, dtype=torch.float32)  # one projection output
    q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
    inv = rope_inv_freq(r, 10000.0, 1.0, None, DEVICE)
    hn = (_rand(d, seed=3, dtype=torch.float32), _rand(d, seed=4, dtype=torch.float32), 1e-6) if norms else None
    pos = torch.tensor([q_pos], dtype=torch.int32, device=DEVICE)
    scale = d**-0.5
    k_a, v_a, q_a = k_c.clone(), v_c.clone(), q.clone()
    apply_rope(q_a, k, pos, inv, kind, inplace=True, cache=(v, k_a, v_a), head_norms=hn)
    want = decode_attention(q_a, k_a, v_a, pos, scale, window)
    k_b, v_b = k_c.clone(), v_c.clone()
    k_b[q_pos] = float("nan")
    v_b[q_pos] = float("nan")
    got = decode_attention(q, k_b, v_b, pos, scale, window, out=_poison(q),
                           new=NewToken(k, v, inv, kind, hn))  # fmt: skip
    _close(f"fused rope {case}", got, want, 2e-3)
    assert torch.equal(k_b[q_pos], k_a[q_pos]) and torch.equal(v_b[q_pos], v_a[q_pos])
    assert torch.equal(k_b[:q_pos], k_a[:q_pos])


def test_attention_errors() -> None:
    q = _rand(3, 4, 32, seed=1, dtype=torch.float16)
    k = _rand(10, 3, 32, seed=2, dtype=torch.float16)
    with pytest.raises(ValueError, match="does not fit"):
        prefill_attention(q, k, k, 0, 1.0)
    k = _rand(10, 2, 32, seed=2, dtype=torch.float16)
    with pytest.raises(ValueError, match="cache of at least"):
        prefill_attention(q, k, k, 8, 1.0)
    with pytest.raises(ValueError, match="q_pos"):
        decode_attention(q, k, k, torch.zeros(2, dtype=torch.int32, device=DEVICE), 1.0)


# ---- sampling -----------------------------------------------------------------------------------


def _logits(b: int, v: int, seed: int, levels: int = 0) -> torch.Tensor:
    """Random logits; with ``levels`` the values are rounded to that many steps, so ties are
    everywhere (the maximum included), and some are negative zero vs zero."""
    x = _rand(b, v, seed=seed, scale=3.0)
    if levels:
        x = torch.round(x * levels / 8) * (8 / levels)
    return x


@pytest.mark.parametrize("b,v,levels", [(1, 1, 0), (1, 7, 0), (2, 5000, 0), (3, 70000, 4),
                                        (1, 262144, 8)], ids=lambda x: str(x))  # fmt: skip
def test_argmax(b: int, v: int, levels: int) -> None:
    x = _logits(b, v, seed=v, levels=levels)
    got = argmax(x)
    want = torch.argmax(x.cpu(), dim=1)  # first maximum
    assert got.tolist() == want.tolist()
    assert int(argmax(x[0])) == int(want[0])


@pytest.mark.parametrize("v,k,levels", [(7, 7, 0), (300, 5, 0), (5000, 40, 16),
                                        (10000, 256, 2), (70000, 100, 64)],
                         ids=lambda x: str(x))  # fmt: skip
def test_topk(v: int, k: int, levels: int) -> None:
    x = _logits(2, v, seed=k, levels=levels)
    got = topk(x, k)
    for row in range(2):
        want_vals, want_ids = _topk(x[row].cpu(), k)
        assert got.ids[row].cpu().tolist() == want_ids.tolist(), f"row {row}: ids differ"
        assert torch.equal(got.values[row].cpu(), want_vals)
    one = topk(x[1], k)
    assert one.ids.cpu().tolist() == got.ids[1].cpu().tolist()


def test_topk_signed_zeros_tie_by_id() -> None:
    """-0.0 and +0.0 are equal logits: ordered by id, as the torch path orders them."""
    x = torch.tensor([-0.0, 0.0, -1.0, 0.0, -0.0, -2.0], device=DEVICE)
    for k in (1, 2, 4):
        got = topk(x, k)
        want_vals, want_ids = _topk(x.cpu(), k)
        assert got.ids.cpu().tolist() == want_ids.tolist() == [0, 1, 3, 4][:k]
        assert torch.equal(got.values.cpu(), want_vals)


def test_sampling_errors() -> None:
    x = _rand(10, seed=1)
    with pytest.raises(ValueError, match="k = 11"):
        topk(x, 11)
    with pytest.raises(ValueError, match="float32"):
        argmax(x.half())


# ---- GPU: real shapes, with timings -------------------------------------------------------------


def _time_ms(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def _gpu_check() -> None:
    assert not INTERPRETED and torch.cuda.is_available(), "gpu tests need CUDA"


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,d,window", [(32, 8, 128, 0), (8, 4, 256, 0), (8, 4, 256, 1024)],
                         ids=lambda x: str(x))  # fmt: skip
@pytest.mark.parametrize("start", [0, 1536])
def test_gpu_prefill_attention(hq: int, hkv: int, d: int, window: int, start: int) -> None:
    _gpu_check()
    t = 512
    n = start + t
    k, v = _cache(n, 4096, hkv, d, seed=1)
    q = _rand(t, hq, d, seed=2, dtype=torch.float16)
    out = prefill_attention(q, k, v, start, d**-0.5, window, out=_poison(q))
    _close(f"gpu prefill h{hq}x{hkv} d{d} w{window} p{start}", out,
           _attn_ref(q, k, v, torch.arange(start, n), n, d**-0.5, window), 3e-3)  # fmt: skip
    ms = _time_ms(lambda: prefill_attention(q, k, v, start, d**-0.5, window, out=out))
    w = min(window, n) if window else n
    flops = 4 * t * hq * d * (w - t / 2 if not window else w)  # approx. visible pairs
    print(f"prefill T={t} p0={start} Hq={hq} D={d} w={window}: {ms * 1e3:.1f} us, "
          f"{flops / ms / 1e9:.1f} TFLOP/s (approx)")


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (8, 4, 256), (16, 8, 256)],
                         ids=lambda x: str(x))  # fmt: skip
@pytest.mark.parametrize("s", [512, 4096])
def test_gpu_decode_attention(hq: int, hkv: int, d: int, s: int) -> None:
    _gpu_check()
    k, v = _cache(s, s, hkv, d, seed=3)
    q = _rand(1, hq, d, seed=4, dtype=torch.float16)
    pos = torch.tensor([s - 1], dtype=torch.int32, device=DEVICE)
    out = decode_attention(q, k, v, pos, d**-0.5, out=_poison(q))
    _close(f"gpu decode h{hq}x{hkv} d{d} s{s}", out, _attn_ref(q, k, v, pos, s, d**-0.5, 0), 3e-3)
    ms = _time_ms(lambda: decode_attention(q, k, v, pos, d**-0.5, out=out))
    nbytes = 2 * s * hkv * d * 2
    print(f"decode S={s} Hq={hq} Hkv={hkv} D={d}: {ms * 1e3:.1f} us, {nbytes / ms / 1e6:.0f} GB/s")


@pytest.mark.gpu
def test_gpu_elementwise() -> None:
    _gpu_check()
    t, d, f = 512, 4096, 14336
    x = _rand(t, d, seed=1, dtype=torch.float16)
    r = _rand(t, d, seed=2, dtype=torch.float16)
    w = _rand(d, seed=3, dtype=torch.float32)
    y, r2 = add_rms_norm(x, r, w, 1e-6)
    ref_y, ref_r = ref_norm.add_rms_norm(x.cpu(), r.cpu(), w.cpu(), 1e-6)
    _close("gpu add_rms_norm", y, ref_y, 2e-3)
    ms = _time_ms(lambda: add_rms_norm(x, r, w, 1e-6, out=y, residual_out=r2))
    print(f"add_rms_norm [{t}, {d}] fp16: {ms * 1e3:.1f} us, {4 * t * d * 2 / ms / 1e6:.0f} GB/s")
    gu = _rand(t, 2 * f, seed=4, dtype=torch.float16)
    a = gated_act(gu[:, :f], gu[:, f:], "silu")
    _close("gpu silu", a, ref_act.gated_act(gu[:, :f].float().cpu(), gu[:, f:].float().cpu(),
                                            "silu"), 2e-3)  # fmt: skip
    ms = _time_ms(lambda: gated_act(gu[:, :f], gu[:, f:], "gelu_tanh", out=a))
    print(f"gated_act [{t}, {f}] fp16: {ms * 1e3:.1f} us, {3 * t * f * 2 / ms / 1e6:.0f} GB/s")
    q = _rand(t, 32, 128, seed=5, dtype=torch.float16)
    k = _rand(t, 8, 128, seed=6, dtype=torch.float16)
    pos = torch.arange(t, device=DEVICE)
    inv = rope_inv_freq(128, 500000.0, device=DEVICE)
    qo, _ = apply_rope(q, k, pos, inv, "norm")
    cos, sin = ref_rope.rope_cos_sin(pos.cpu(), 128, 500000.0)
    _close("gpu rope", qo, ref_rope.apply_rope(q.cpu(), cos, sin, "norm"), 2e-3)
    ms = _time_ms(lambda: apply_rope(q, k, pos, inv, "norm", inplace=True))
    print(f"rope T={t} 32+8 heads x 128 fp16 in place: {ms * 1e3:.1f} us")


@pytest.mark.gpu
@pytest.mark.parametrize("k", [40, 256])
def test_gpu_sampling(k: int) -> None:
    _gpu_check()
    v = 262144
    x = _logits(1, v, seed=k, levels=64)
    assert int(argmax(x[0])) == int(torch.argmax(x[0].cpu()))
    got = topk(x[0], k)
    want_vals, want_ids = _topk(x[0].cpu(), k)
    assert got.ids.cpu().tolist() == want_ids.tolist()
    ms_a = _time_ms(lambda: argmax(x[0]))
    ms_k = _time_ms(lambda: topk(x[0], k))
    print(f"V={v}: argmax {ms_a * 1e3:.1f} us, top-{k} {ms_k * 1e3:.1f} us")


# ---- activations handed to the GEMV already quantized ---------------------------------------

def _same_quantized(label: str, got, out: torch.Tensor) -> None:
    """A kernel's fused QuantizedX equals quantize_x of the output it stored."""
    from deimos.quant.triton.gemv_q8 import quantize_x

    want = quantize_x(out.reshape(out.shape[0], -1))
    for name in ("xq", "xd", "xs"):
        assert torch.equal(getattr(got, name), getattr(want, name)), f"{label}: {name} differs"


def test_fused_quantized_outputs() -> None:
    from deimos.kernels.triton import add_rms_norm, decode_attention, gated_act
    from deimos.quant.triton.gemv_q8 import empty_quantized

    d = 320
    x, r = _rand(1, d, seed=1), _rand(1, d, seed=2)
    w = _rand(d, seed=3)
    qx = empty_quantized(1, d, DEVICE)
    y, _ = add_rms_norm(x, r, w, 1e-6, quantized=qx)
    _same_quantized("add_rms_norm", qx, y)
    qx = empty_quantized(1, d, DEVICE)
    y, _ = add_rms_norm(x, None, w, 1e-6, quantized=qx)
    _same_quantized("rms_norm", qx, y)

    f = 2112  # three programs of 1024, the last partly masked
    g, u = _rand(1, f, seed=4), _rand(1, f, seed=5)
    for act in ("silu", "gelu_tanh"):
        qx = empty_quantized(1, f, DEVICE)
        _same_quantized(f"gated_act {act}", qx, gated_act(g, u, act, quantized=qx))

    hq, hkv, dh, s = 4, 2, 64, 40
    k, v = _cache(s, s + 8, hkv, dh, seed=6)
    q = _rand(1, hq, dh, seed=7)
    pos = torch.tensor([s - 1], dtype=torch.int32, device=DEVICE)
    qx = empty_quantized(1, hq * dh, DEVICE)
    out = decode_attention(q, k, v, pos, dh**-0.5, quantized=qx)
    _same_quantized("decode_attention", qx, out)
    with pytest.raises(ValueError, match="does not fit"):
        add_rms_norm(x, r, w, 1e-6, quantized=empty_quantized(1, 64, DEVICE))


def test_fused_half_outputs() -> None:
    """A batch's rows also stored in float16 by the kernel that makes them (what the next
    matmuls read, with no cast launch between): equal to the stored output's ``.half()``; a
    buffer that does not fit is refused before any launch."""
    from deimos.kernels.triton import add_rms_norm, gated_act

    d = 320
    x, r = _rand(3, d, seed=1), _rand(3, d, seed=2)
    w = _rand(d, seed=3)
    for res in (r, None):
        h = torch.empty(3, d, dtype=torch.float16, device=DEVICE)
        y, _ = add_rms_norm(x, res, w, 1e-6, half=h)
        assert torch.equal(h, y.half()), f"add_rms_norm (residual {res is not None})"
    f = 2112
    g, u = _rand(5, f, seed=4), _rand(5, f, seed=5)
    for act in ("silu", "gelu_tanh"):
        h = torch.empty(5, f, dtype=torch.float16, device=DEVICE)
        y = gated_act(g, u, act, half=h)
        assert torch.equal(h, y.half()), act
    for bad in (torch.empty(3, d, device=DEVICE), torch.empty(2, d, dtype=torch.float16, device=DEVICE),
                torch.empty(d, 3, dtype=torch.float16, device=DEVICE).t()):
        with pytest.raises(ValueError, match="half output must be contiguous float16"):
            add_rms_norm(x, r, w, 1e-6, half=bad)
    with pytest.raises(ValueError, match="half output must be contiguous float16"):
        gated_act(g, u, "silu", half=torch.empty(5, f, device=DEVICE))


def test_decode_attention_new_token_bad_input() -> None:
    """A fused new token (RoPE in the attention launch) checked before any launch: one query
    row, k/v of the cache's heads, a known rope type, inv_freq and head norms that fit."""
    from deimos.kernels.triton.decode_attention import NewToken

    k_c, v_c = _cache(8, 16, 2, 64, seed=2)
    q = _rand(1, 4, 64, seed=3)
    kn, vn = _rand(1, 2, 64, seed=4), _rand(1, 2, 64, seed=5)
    pos = torch.tensor([8], dtype=torch.int32, device=DEVICE)
    inv = rope_inv_freq(64, 10000.0, device=DEVICE)
    cases = [
        (dict(q=_rand(2, 4, 64, seed=6), pos=torch.tensor([8, 9], dtype=torch.int32, device=DEVICE)),
         NewToken(kn, vn, inv, "norm"), "needs one query row, got 2"),
        ({}, NewToken(kn, vn, inv, "yarn"), "unknown rope type 'yarn'"),
        ({}, NewToken(_rand(1, 3, 64, seed=7), vn, inv, "norm"), r"new token's k must be \[1, 2, 64\]"),
        ({}, NewToken(kn, vn[:, :, :32], inv, "norm"), r"new token's v must be \[1, 2, 64\]"),
        ({}, NewToken(kn, vn, rope_inv_freq(160, 10000.0, device=DEVICE), "norm"), "R <= 64"),
        ({}, NewToken(kn, vn, inv, "neox", (inv, inv, 1e-6)), r"q head-norm weight must be \[64\]"),
    ]
    for over, new, msg in cases:
        with pytest.raises(ValueError, match=msg):
            decode_attention(over.get("q", q), k_c, v_c, over.get("pos", pos), 0.125, new=new)


def test_fused_quantized_and_device_start_bad_input() -> None:
    from deimos.kernels.triton import decode_attention, gated_act, prefill_attention
    from deimos.quant.triton.gemv_q8 import empty_quantized

    g = _rand(1, 64, seed=1)
    with pytest.raises(ValueError, match="does not fit"):
        gated_act(g, g, "silu", quantized=empty_quantized(1, 32, DEVICE))
    k, v = _cache(8, 8, 2, 64, seed=2)
    q = _rand(1, 4, 64, seed=3)
    pos = torch.tensor([7], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="does not fit"):
        decode_attention(q, k, v, pos, 0.125, quantized=empty_quantized(1, 64, DEVICE))
    qp = _rand(2, 4, 64, seed=4, dtype=torch.float16)
    with pytest.raises(ValueError, match="device start must be an int tensor"):
        prefill_attention(qp, k, v, torch.tensor([0.0, 1.0], device=DEVICE), 0.125)


def test_pdl_launch_options() -> None:
    """Programmatic dependent launch is asked for only where it can run (a compiled sm_90+
    GPU), and then both the kernel's wait and Triton's launch attribute go together."""
    from deimos.quant.triton.pdl import launch_options, pdl_on

    assert launch_options(False) == {"PDL": False}
    assert launch_options(True) == {"PDL": True, "launch_pdl": True}
    assert pdl_on(torch.device("cpu")) is False
    if INTERPRETED:
        assert pdl_on(torch.device("cuda", 0)) is False  # the interpreter has no griddepcontrol


def test_env_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset or empty: the default; 0 / 1: off / on; anything else: the variable named."""
    from deimos.switches import env_switch

    monkeypatch.delenv("DEIMOS_TEST_SWITCH", raising=False)
    assert env_switch("DEIMOS_TEST_SWITCH", True) is True
    for value, want in (("", False), ("0", False), ("1", True)):
        monkeypatch.setenv("DEIMOS_TEST_SWITCH", value)
        assert env_switch("DEIMOS_TEST_SWITCH", False) is want
    monkeypatch.setenv("DEIMOS_TEST_SWITCH", "yes")
    with pytest.raises(ValueError, match="DEIMOS_TEST_SWITCH must be 0 or 1, got 'yes'"):
        env_switch("DEIMOS_TEST_SWITCH", True)


@pytest.mark.parametrize("var,module", [("DEIMOS_PDL_AHEAD", "deimos.quant.triton.pdl"),
                                        ("DEIMOS_ATTN_MERGE", "deimos.models.gpu.ops"),
                                        ("DEIMOS_MOE_DEFER", "deimos.models.gpu.moe_ops"),
                                        ("DEIMOS_MOE_MMQ", "deimos.quant.triton.moe_gemm")])
def test_a_bad_switch_is_named(var: str, module: str) -> None:
    """A profile switch other than 0 or 1: a named error when its module is imported."""
    import os
    import subprocess
    import sys

    env = {**os.environ, var: "off"}
    r = subprocess.run([sys.executable, "-c", f"import {module}"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and f"{var} must be 0 or 1, got 'off'" in r.stderr
