"""The float64 yardstick of the exactness study (deimos.eval.float64, docs/exactness.md).

Oracle: the float32 CPU reference on the same file. float64 arithmetic on the same weights
must land within float32 rounding of it (relative RMS ~1e-6), and really be float64 all the
way: the dtype of every weight, rope table and logit, and each reference op exact to float64
rounding on float64 input (they cast to float32 before the study).
"""

from __future__ import annotations

import ctypes
import sys

import numpy as np
import pytest
import torch
from testdata import REPO, llama_cpp_path, llama_cpu_lib

from deimos.eval.float64 import kv_cache, to_float64
from deimos.gguf import GGUFFile
from deimos.kernels.attention import causal_attention
from deimos.kernels.norm import rms_norm
from deimos.kernels.rope import apply_rope, rope_cos_sin
from deimos.models import load_model
from deimos.runtime.kv_cache import KVCache
from deimos.synth import write_model

sys.path.insert(0, str(REPO / "tools"))
from exactness import q8act  # noqa: E402

DONOR = "models/ggml-vocab-llama-spm.gguf"
PROMPT = [1, 450, 4996, 17354, 1701, 29916, 432, 17204, 975, 278, 17366, 11203, 29889]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def path(request, tmp_path_factory):
    p = tmp_path_factory.mktemp("exact") / f"{request.param}.gguf"
    return write_model(p, request.param, f"{request.param}-tiny", "Q4_K_M", llama_cpp_path(DONOR),
                       seed=5)


def _logits(model, kv) -> torch.Tensor:
    t = torch.tensor(PROMPT)
    n = len(PROMPT)
    return kv.forward(model, t, torch.arange(n))


def test_float64_model_is_float64_and_close_to_float32(path):
    f = GGUFFile(path)
    m32 = load_model(f)
    m64 = to_float64(load_model(f))
    floats = [t for t in _tensors(m64) if t.is_floating_point()]
    assert floats and all(t.dtype == torch.float64 for t in floats)
    assert m64.ops.dtype == torch.float64
    if "output.weight" not in f.tensors:  # tied embeddings stay one tensor
        assert m64.lm_head.weight is m64.embed.table
    l32 = _logits(m32, KVCache(m32.config, 32))
    l64 = _logits(m64, kv_cache(m64, 32))
    assert l32.dtype == torch.float32 and l64.dtype == torch.float64
    rel = float((l64 - l32.double()).norm() / l64.norm())
    print(f"relative RMS float32 vs float64: {rel:.3g}, max |diff| {float((l64 - l32).abs().max()):.3g}")
    assert rel < 1e-5


def _tensors(model):
    seen, out = set(), []

    def walk(v):
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif hasattr(v, "__dict__") and id(v) not in seen:
            seen.add(id(v))
            for x in vars(v).values():
                walk(x)

    walk(model)
    return out


def test_reference_ops_keep_float64():
    """Each reference op computes in float64 when given float64 (they once cast to float32)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 8, dtype=torch.float64, generator=g)
    w = torch.rand(8, dtype=torch.float64, generator=g) + 0.5
    y = rms_norm(x, w, 1e-6)
    exact = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
    assert y.dtype == torch.float64 and float((y - exact).abs().max()) < 1e-14

    pos = torch.arange(5)
    cos, sin = rope_cos_sin(pos, 8, 10000.0, dtype=torch.float64)
    assert cos.dtype == torch.float64
    r = apply_rope(x, cos, sin, "neox")
    assert r.dtype == torch.float64
    # a rotation keeps the norm of each rotated pair to float64 precision
    assert float((r.norm(dim=-1) - x.norm(dim=-1)).abs().max()) < 1e-13

    o = causal_attention(x, x[:, :1], x[:, :1], pos, pos, 0.5)
    assert o.dtype == torch.float64
    probs = torch.softmax(torch.einsum("thd,sd->hts", x, x[:, 0]) * 0.5 +
                          torch.triu(torch.full((5, 5), float("-inf"), dtype=torch.float64), 1), -1)
    want = torch.einsum("hts,sd->thd", probs, x[:, 0])
    assert float((o - want).abs().max()) < 1e-14


def test_to_float64_refuses_the_kernel_path(path):
    m = load_model(GGUFFile(path))
    m.ops = object()
    with pytest.raises(ValueError, match="only the CPU reference"):
        to_float64(m)


def _ggml_round_trip(name: str, x: np.ndarray, block_bytes: int, block: int) -> np.ndarray:
    lib = ctypes.CDLL(str(llama_cpu_lib("libggml-base.so")))
    n = x.size
    blocks = np.zeros(n // block * block_bytes, dtype=np.uint8)
    out = np.full(n, np.nan, dtype=np.float32)  # poison: unwritten shows
    getattr(lib, f"quantize_row_{name}_ref")(x.ctypes.data_as(ctypes.c_void_p),
                                             blocks.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(n))
    getattr(lib, f"dequantize_row_{name}")(blocks.ctypes.data_as(ctypes.c_void_p),
                                           out.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(n))
    return out


@pytest.mark.parametrize("name,block_bytes,block", [("q8_0", 34, 32), ("q8_K", 292, 256)])
def test_q8_activation_emulation_is_ggmls_rounding(name, block_bytes, block):
    """tools/exactness/q8act.py rounds as ggml's quantize_row_*_ref + dequantize_row_* do
    (oracle: ggml itself); Q8_1 has Q8_0's codes and scale."""
    rng = np.random.default_rng(3)
    # rows of 1024 with blocks of very different scales, and an outlier: the study's case
    x = (rng.standard_normal(4096) * np.repeat(10.0 ** rng.uniform(-3, 3, 4096 // 32), 32))
    x[100] = 900.0
    x = x.astype(np.float32)
    want = _ggml_round_trip(name, x, block_bytes, block)
    rounding = q8act.round_q8_32 if block == 32 else q8act.round_q8_k
    got = rounding(torch.from_numpy(x).view(4, 1024)).reshape(-1).numpy()
    np.testing.assert_array_equal(got, want)
