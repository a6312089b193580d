"""The GPU path (deimos.models.gpu: packed weights, Triton kernels) against the CPU reference.

Oracle: the float32 CPU reference model of the same file (itself checked against llama.cpp).
- ``test_kernel_linears_*`` (not gpu-marked): the QuantLinear / embedding / fp16-fallback code
  paths of a tiny synth model, on the first rows of each matrix (the interpreter is slow), under
  TRITON_INTERPRET=1 when there is no GPU (set before the kernels are imported).
- ``gpu``-marked: whole models on CUDA: logits relative RMS error < 1e-2 and the same 16 greedy
  tokens, for tiny synth files of every architecture at Q4_K_M and Q8_0 and for the two real
  models. External needs: the llama-spm vocab donor (tiny synth files are written here) and, for
  the real-model tests, $DEIMOS_TEST_DATA/models/{SmolLM2-135M-Instruct.Q4_1,gemma-3-270m-q4_k_m}.gguf.
"""

from __future__ import annotations

import pytest
import torch

from kernel_device import INTERPRETED  # noqa: F401, I001  (first: sets TRITON_INTERPRET)

from testdata import REAL_MODELS, llama_cpp_path, model_path  # noqa: E402

from deimos.gguf import GGUFFile  # noqa: E402
from deimos.gguf.constants import GGMLType  # noqa: E402
from deimos.quant.triton.dequant_gemv import scale16  # noqa: E402
from deimos.models import ARCHITECTURES, load_model  # noqa: E402
from deimos.models.gpu import (  # noqa: E402
    DenseLinear,
    LinearPart,
    QuantEmbedding,
    QuantLinear,
    gather_rows,
)
from deimos.models.weights import WeightSource  # noqa: E402
from deimos.quant.triton.gemv_q8 import quantize_x_reference  # noqa: E402
from deimos.runtime.kv_cache import KVCache  # noqa: E402
from deimos.synth import write_model  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DONOR = "models/ggml-vocab-llama-spm.gguf"  # 0.7 MB; any tokenizer serves a random-weight model
ROWS = 8  # rows of each matrix checked in the interpreter


def _rel(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.double().cpu(), got.double().cpu()
    return ((got - ref).norm() / ref.norm()).item()


@pytest.fixture(scope="module")
def synth_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu_synth")


def _synth(d, arch: str, typ: str, preset: str | None = None):
    preset = preset or f"{arch}-tiny"
    path = d / f"{preset}-{typ}.gguf"
    if not path.exists():
        write_model(path, arch, preset, typ, llama_cpp_path(DONOR), seed=3)
    return GGUFFile(path)


# formats whose blocks are 256 wide: the tiny llama with 256-multiple widths (else llama-tiny's
# 128-wide rows fall back to other formats)
K256 = {t: "llama-tiny-k" for t in ("TQ1_0", "TQ2_0", "IQ4_XS", "IQ2_XXS", "IQ3_XXS", "Q2_K",
                                     "IQ2_XS", "IQ2_M", "IQ1_M")}


def _kernel_model(f: GGUFFile, device: str = DEVICE):
    ref = load_model(f)
    return ref, ARCHITECTURES[ref.config.arch](ref.config, WeightSource(f, device, kernels=True))


def _first_rows(lin: QuantLinear) -> QuantLinear:
    rows = torch.arange(ROWS, device=lin.packed.device)
    return QuantLinear(gather_rows(lin.packed, rows), None, lin.name, lin.inputs, lin.notices)


# each file's mix: the formats its layer-0 linears and output matrix must include
# ("scale16": a matrix in Q8_0's layout with a scale per 16, as IQ2_XS runs)
MIXES = {"Q4_K_M": {GGMLType.Q4_K, GGMLType.Q5_0, GGMLType.Q8_0}, "Q2_K": {GGMLType.Q2_K},
         "IQ2_XS": {"scale16"}}


@pytest.mark.parametrize("typ", list(MIXES))
def test_kernel_linears_match_reference(synth_dir, typ: str) -> None:
    """Decode (T = 1: int8-activation GEMV; oracle: the reference weight times the q8-rounded
    x) and prefill (T = 3, fp16 dequant + matmul; oracle: the reference on x itself)."""
    ref, kern = _kernel_model(_synth(synth_dir, "llama", typ, K256.get(typ)))
    r0, k0 = ref.layers[0], kern.layers[0]
    pairs = [(getattr(getattr(r0, blk), n), getattr(getattr(k0, blk), n))
             for blk, names in (("attn", "qkvo"), ("mlp", ("gate", "up", "down"))) for n in names]
    pairs.append((ref.lm_head, kern.lm_head))
    seen = set()
    g = torch.Generator().manual_seed(0)
    for r, k in pairs:
        seen.add(k.ggml_type)
        if scale16(k.packed if isinstance(k, QuantLinear) else k.group.linear.packed):
            seen.add("scale16")
        if isinstance(k, LinearPart):  # q/k/v or gate/up of one format: one fused matrix
            small, rows = k, r.weight.shape[0]
        else:
            assert isinstance(k, QuantLinear), f"{k.name}: {type(k).__name__}"
            small, rows = _first_rows(k), ROWS
        for t, tol in ((1, 1e-3), (3, 3e-3)):
            x = torch.randn(t, r.weight.shape[1], generator=g)
            want = (quantize_x_reference(x) if t == 1 else x) @ r.weight[:rows].T
            got = small(x.to(DEVICE))
            assert got.shape == (t, rows) and got.dtype == torch.float32
            rel = _rel(want, got)
            print(f"{k.name} {k.ggml_type.name} T={t}: rel rms {rel:.2e}")
            assert rel < tol, f"{k.name} ({k.ggml_type.name}) T={t}: relative RMS error {rel:.2e}"
    # llama-tiny's Q4_K_M mix: Q5_0 where rows of 128 do not fit 256-blocks, Q4_K, Q8_0 output
    assert MIXES[typ] <= seen, seen
    assert isinstance(k0.mlp.gate, LinearPart) and k0.mlp.gate.group is k0.mlp.up.group


def test_kernel_gated_mlp_one_launch(synth_dir) -> None:
    """A gated MLP whose gate and up are one fused matrix: past 16 rows on the matmul path
    (prompt rows, past gemm_q's 64) its activation comes from one launch (matmul_gated, float16)
    equal to the reference's; a few rows take the two products and the activation instead."""
    from deimos.models.gpu.linear import gated_pair

    ref, kern = _kernel_model(_synth(synth_dir, "llama", "Q8_0"))
    r, k = ref.layers[0].mlp, kern.layers[0].mlp
    pair = gated_pair(k.gate, k.up)
    assert pair is not None and pair is k.gate.group.linear
    assert gated_pair(k.up, k.gate) is None and gated_pair(k.gate, k.down) is None
    g = torch.Generator().manual_seed(3)
    for t, fused in ((65, True), (3, False)):
        x = torch.randn(t, ref.config.n_embd, generator=g)
        want = r.ops.gated_act(r.gate(x), r.up(x), r.activation)
        assert (pair.gated(x.to(DEVICE), k.activation) is not None) == fused
        got = k.ops.gated_mlp(x.to(DEVICE), k.gate, k.up, k.activation)
        assert got.dtype == (torch.float16 if fused else torch.float32)
        rel = _rel(want, got)
        assert rel < 3e-3, f"T={t}: relative RMS error {rel:.2e}"


def test_kernel_input_prepared_once(synth_dir) -> None:
    """One activation is quantized once for every projection reading it (q/k/v of one format
    are even one launch: parts of one LinearGroup)."""
    _, kern = _kernel_model(_synth(synth_dir, "llama", "Q8_0"))
    attn = kern.layers[0].attn
    x = torch.randn(1, kern.config.n_embd, device=DEVICE)
    assert attn.q.group is attn.k.group is attn.v.group
    cache = attn.q.group.linear.inputs
    assert kern.layers[1].mlp.up.group.linear.inputs is cache and kern.lm_head.inputs is cache
    first = cache.quantized(x)
    assert cache.quantized(x) is first
    assert cache.quantized(x.clone()) is not first


MIXED_QKV = {
    # Q4_K_M gives some layers' v Q6_K
    "q4_k_m": [("q", GGMLType.Q4_K, 64), ("k", GGMLType.Q4_K, 32), ("v", GGMLType.Q6_K, 32)],
    # all three run in Q8_0's layout, v with a scale per 32 instead of per 16: it cannot stack
    "iq2_xs": [("q", GGMLType.IQ2_XS, 64), ("k", GGMLType.IQ2_XS, 32), ("v", GGMLType.IQ3_XXS, 32)],
}


@pytest.mark.parametrize("mix", list(MIXED_QKV))
def test_kernel_linears_fuse_what_shares_a_format(tmp_path, mix: str) -> None:
    """q/k/v of mixed formats: the parts whose packed arrays stack are one matrix, the others
    stand alone; every part computes its own rows."""
    import gguf
    import numpy as np

    from deimos.gguf.constants import GGML_BLOCK
    from deimos.models.gpu.source import GpuWeights
    from deimos.quant import get_format

    rng = np.random.default_rng(0)
    k = 256
    spec = MIXED_QKV[mix]
    blocks = {}
    w = gguf.GGUFWriter(str(tmp_path / "mix.gguf"), "llama")
    for name, t, n in spec:
        blocks[name] = get_format(t).random_blocks(n * k // GGML_BLOCK[t][0], rng).reshape(n, -1)
        w.add_tensor(f"{name}.weight", blocks[name], raw_dtype=gguf.GGMLQuantizationType(int(t)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(tmp_path / "mix.gguf")
    src = GpuWeights(f, DEVICE)
    q, kk, v = src.linears([f.tensors[f"{name}.weight"] for name, _, _ in spec], [None] * 3)
    assert isinstance(q, LinearPart) and isinstance(kk, LinearPart) and q.group is kk.group
    assert isinstance(v, QuantLinear) and v.packed.stack_key != q.group.linear.packed.stack_key
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(1))
    for lin, (name, t, n) in zip((q, kk, v), spec):
        dense = torch.from_numpy(get_format(t).decode_blocks(blocks[name].reshape(-1, GGML_BLOCK[t][1])))
        want = quantize_x_reference(x) @ dense.reshape(n, k).float().T
        assert _rel(want, lin(x.to(DEVICE))) < 1e-4, name


def test_kernel_embedding_and_tied_head(synth_dir) -> None:
    f = _synth(synth_dir, "qwen2", "Q8_0")  # qwen2-tiny: tied embeddings
    ref, kern = _kernel_model(f)
    assert isinstance(kern.embed, QuantEmbedding)
    tokens = torch.tensor([0, 5, 31999, 5, 1234])
    got = kern.embed(tokens.to(DEVICE))
    rel = _rel(ref.embed(tokens), got)
    assert rel < 1e-3, f"embedding rows: relative RMS error {rel:.2e}"
    with pytest.raises(ValueError, match="out of range"):
        kern.embed(torch.tensor([ref.config.n_vocab]))
    head = kern.lm_head
    assert isinstance(head, QuantLinear) and head.packed is kern.embed.packed
    x = torch.randn(1, kern.config.n_embd, generator=torch.Generator().manual_seed(1))
    rel = _rel(quantize_x_reference(x) @ ref.lm_head.weight[:ROWS].T, _first_rows(head)(x.to(DEVICE)))
    assert rel < 1e-3


def test_kernel_fallback_dense_fp16(synth_dir) -> None:
    """A format without a kernel (F16 here) becomes an fp16 matrix on the device."""
    ref, kern = _kernel_model(_synth(synth_dir, "llama", "F16"))
    q = kern.layers[0].attn.q
    assert isinstance(q, DenseLinear) and q.weight.dtype == torch.float16
    x = torch.randn(2, kern.config.n_embd, generator=torch.Generator().manual_seed(2))
    rel = _rel(ref.layers[0].attn.q(x), q(x.to(DEVICE)))
    assert rel < 3e-3, f"fp16 fallback: relative RMS error {rel:.2e}"


def test_triton_ops_whole_tiny_model(synth_dir) -> None:
    """The Triton layer ops (fused add+RMSNorm, q/k head norms fused into RoPE, prefill flash
    attention, cache scatter + split-K decode attention over the whole cache, gated
    activation) in whole models: a 6-token prefill and 3 decode steps against the CPU
    reference. The matrices stay the reference's (the GEMV kernels have their own tests and
    take minutes in the interpreter), so any difference is the ops'."""
    for arch in ("qwen3", "gemma3"):
        f = _synth(synth_dir, arch, "Q8_0")
        ref = load_model(f)
        ops = ARCHITECTURES[ref.config.arch](ref.config, WeightSource(f, DEVICE, kernels=False, triton_ops=True))
        assert type(ops.ops).__name__ == "TritonOps"
        prompt = torch.randint(0, ref.config.n_vocab, (6,), generator=torch.Generator().manual_seed(5)).tolist()
        ref_logits, ref_tokens = _greedy(ref, prompt, 3, "cpu")
        got_logits, got_tokens = _greedy(ops, prompt, 3, DEVICE)
        rel = _rel(ref_logits, got_logits)
        assert rel < 1e-3, f"{arch}: logits relative RMS error {rel:.2e}"
        assert got_tokens == ref_tokens, f"{arch}: {got_tokens} vs {ref_tokens}"


# ---- whole models on the GPU --------------------------------------------------------------------

N_GREEDY = 16


def _greedy(model, prompt: list[int], n: int, device: str) -> tuple[torch.Tensor, list[int]]:
    """Prefill (logits at every prompt position), then n greedy tokens through T = 1 steps."""
    cfg = model.config
    kv = KVCache(cfg, len(prompt) + n, device=device)
    t = torch.tensor(prompt, device=device)
    logits = kv.forward(model, t, torch.arange(len(prompt), device=device))
    out: list[int] = []
    tok = int(torch.argmax(logits[-1]))
    for i in range(n):
        out.append(tok)
        step = kv.forward(model, torch.tensor([tok], device=device))
        tok = int(torch.argmax(step[0]))
    return logits.float().cpu(), out


TIE = 0.1  # reference top-2 logit gap under which a rounded (fixed-point) activation may flip the argmax


def _forced(model, prompt: list[int], tokens: list[int], device: str) -> torch.Tensor:
    """Decode logits [len(tokens), V] with ``tokens`` fed one by one after the prompt."""
    cfg = model.config
    kv = KVCache(cfg, len(prompt) + len(tokens), device=device)
    kv.forward(model, torch.tensor(prompt, device=device))
    out = []
    for i, tok in enumerate(tokens):
        out.append(kv.forward(model, torch.tensor([tok], device=device))[0].float().cpu())
    return torch.stack(out)


def _compare_whole(f: GGUFFile, label: str) -> None:
    """Prefill logits at every prompt position and decode logits along the reference's greedy
    path within 1e-2 relative RMS; the GPU's own greedy tokens equal the reference's up to
    the first step where the reference's top two logits are within TIE (decode rounds
    activations to 15-bit fixed point: a near-tie may flip), and at every step of the
    reference's path the GPU picks the reference's token unless that step is such a tie.
    A MoE file goes to tests/test_moe_gpu.py's compare_whole_moe: its routing is forced to
    the reference's for these checks, and its own routing checked apart."""
    ref = load_model(f)
    if ref.config.is_moe:
        from test_moe_gpu import compare_whole_moe

        compare_whole_moe(f, label, ref=ref)
        return
    gpu = load_model(f, device="cuda")
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, ref.config.n_vocab, (37,), generator=g).tolist()
    ref_logits, ref_tokens = _greedy(ref, prompt, N_GREEDY, "cpu")
    gpu_logits, gpu_tokens = _greedy(gpu, prompt, N_GREEDY, "cuda")
    rel = _rel(ref_logits, gpu_logits)
    ref_dec = _forced(ref, prompt, ref_tokens[:-1], "cpu")
    gpu_dec = _forced(gpu, prompt, ref_tokens[:-1], "cuda")
    rel_dec = _rel(ref_dec, gpu_dec)
    top2 = torch.cat([ref_logits[-1:], ref_dec]).topk(2, dim=1).values
    gaps = (top2[:, 0] - top2[:, 1]).tolist()  # gap before choosing ref_tokens[i]
    print(f"{label}: prefill logits rel rms {rel:.2e}, decode {rel_dec:.2e}; greedy {gpu_tokens}")
    assert rel < 1e-2, f"{label}: prefill logits relative RMS error {rel:.2e}"
    assert rel_dec < 1e-2, f"{label}: decode logits relative RMS error {rel_dec:.2e}"
    picks = [int(torch.cat([gpu_logits[-1:], gpu_dec])[i].argmax()) for i in range(N_GREEDY)]
    for i, (want, got) in enumerate(zip(ref_tokens, picks)):
        assert got == want or gaps[i] < TIE, f"{label}: step {i} picks {got}, reference {want}, gap {gaps[i]:.3f}"
    first = next((i for i, (a, b) in enumerate(zip(ref_tokens, gpu_tokens)) if a != b), None)
    if first is not None:
        assert gaps[first] < TIE, f"{label}: free-running greedy differs at step {first}, gap {gaps[first]:.3f}"


@pytest.mark.gpu
@pytest.mark.parametrize("typ", ["Q4_K_M", "Q8_0"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_gpu_whole_synth_model(synth_dir, arch: str, typ: str) -> None:
    _compare_whole(_synth(synth_dir, arch, typ), f"{arch}-tiny {typ}")


@pytest.mark.gpu
@pytest.mark.parametrize("typ", ["TQ1_0", "TQ2_0", "IQ4_NL", "IQ4_XS", "IQ2_XXS", "IQ3_XXS", "Q2_K",
                                 "IQ2_XS", "IQ2_M", "IQ1_M"])
def test_gpu_whole_synth_model_q8_layouts(synth_dir, typ: str) -> None:
    """The formats past the first eight (Q8_0's layout with their values; Q2_K in its own):
    whole llama-tiny files."""
    _compare_whole(_synth(synth_dir, "llama", typ, K256.get(typ)), f"{K256.get(typ, 'llama-tiny')} {typ}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", REAL_MODELS)
def test_gpu_whole_real_model(name: str) -> None:
    _compare_whole(GGUFFile(model_path(name)), name)


@pytest.mark.gpu
def test_gpu_llm_generate_greedy() -> None:
    from deimos.engine import LLM

    path = model_path(REAL_MODELS[0])
    args = dict(max_tokens=12, temperature=0, raw=True)
    want = LLM(path, device="cpu").generate("The capital of France is", **args)
    got = LLM(path, device="cuda").generate("The capital of France is", **args)
    assert got.token_ids == want.token_ids, f"{got.text!r} vs {want.text!r}"
