"""The evaluation paths of the exactness study: each gives, for a sequence, the logits of its
scored positions ([P, n_vocab], any float dtype).

Deimos: ``float64`` (the yardstick: the CPU reference widened, deimos.eval.float64),
``deimos-cpu`` (the float32 reference), ``deimos-cuda-prefill`` (the sequence as one prefill:
fp16 dequantized weights, tensor-core matmul), ``deimos-cuda-decode`` (one token a step after a
one-token prefill: the integer-activation GEMV, as generation runs).
llama.cpp (tools/llama_ref ``logits`` mode): on the CPU or, with a CUDA build of llama_ref,
on the GPU (``--ngl 99``); with its reference settings (f32 KV cache, flash attention off) or
its defaults (f16 KV cache, flash attention auto); and on the F32 twin of the file (the same
weights, dequantized by llama-quantize: no activation quantization), the cross-check of the
yardstick by an independent implementation.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from deimos.eval.float64 import kv_cache, to_float64
from deimos.gguf import GGUFFile
from deimos.models import load_model
from deimos.runtime.kv_cache import KVCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "llama_ref"))
import driver  # noqa: E402

from .q8act import quantize_activations  # noqa: E402
from .sequences import Sequence  # noqa: E402

# a path: a sequence -> the logits of its scored positions [P, n_vocab]
Path_ = Callable[[Sequence], np.ndarray]


def _deimos_forward(model, kv, seq: Sequence, device: str) -> np.ndarray:
    n = len(seq.tokens)
    t = torch.tensor(seq.tokens, device=device)
    at = torch.tensor(seq.positions, device=device)
    logits = kv.forward(model, t, at)
    return logits.cpu().numpy()


def deimos_reference(path: Path, float64: bool, q8act: bool = False) -> Path_:
    """The CPU reference, in float64 (the yardstick) or float32; ``q8act``: with llama.cpp's
    activation rounding emulated (q8act.py)."""
    model = load_model(GGUFFile(path))
    if float64:
        to_float64(model)
    if q8act:
        quantize_activations(model)

    def run(s: Sequence) -> np.ndarray:
        kv = kv_cache(model, len(s.tokens)) if float64 else KVCache(model.config, len(s.tokens))
        return _deimos_forward(model, kv, s, "cpu")

    return run


def deimos_cuda(path: Path, decode: bool) -> Path_:
    model = load_model(GGUFFile(path), device="cuda")

    def run(s: Sequence) -> np.ndarray:
        kv = KVCache(model.config, len(s.tokens), device="cuda")
        if not decode:
            return _deimos_forward(model, kv, s, "cuda")
        rows = {}
        # the first token as a one-token prefill, then one decode step per token
        for i, tok in enumerate(s.tokens[: max(s.positions) + 1]):
            out = kv.forward(model, torch.tensor([tok], device="cuda"))
            if i in s.positions:
                rows[i] = out[0].float().cpu().numpy()
        return np.stack([rows[p] for p in s.positions])

    return run


@dataclass(frozen=True)
class LlamaRun:
    """llama_ref's logits of one sequence (a process per sequence: the logits file holds one
    sequence's rows, and a long sequence is scored at its strided positions only)."""

    exe: Path
    model: Path
    opts: driver.LlamaOptions
    env: dict[str, str] | None = None

    def __call__(self, s: Sequence) -> np.ndarray:
        o = self.opts
        opts = driver.LlamaOptions(max(len(s.tokens), 64), o.ngl, o.kv, o.fa, o.threads)
        start = s.positions[0]
        stride = s.positions[1] - start if len(s.positions) > 1 else 1
        with tempfile.TemporaryDirectory() as tmp:
            (positions, rows), = driver.logits(self.exe, self.model, [list(s.tokens)],
                                               Path(tmp) / "rows.f32", opts, stride, start,
                                               env=self.env)
            index = {p: i for i, p in enumerate(positions)}
            missing = [p for p in s.positions if p not in index]
            if missing:
                raise RuntimeError(f"llama_ref scored no logits at positions {missing[:5]}")
            return np.array(rows[[index[p] for p in s.positions]])
