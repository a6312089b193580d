"""Perplexity as ``llama-perplexity`` computes it (tools/perplexity/perplexity.cpp, build 11434).

The whole text is tokenized once (BOS as the vocabulary asks, special tokens as plain text)
and cut into ``n_chunk = n_tokens // n_ctx`` windows of ``n_ctx`` tokens (``--chunks`` takes
fewer), each evaluated from an empty cache. When the vocabulary adds BOS, the window's first
token is *replaced* by BOS (not shifted). Only the second half is scored: with
``first = n_ctx // 2``, the logits of positions ``first .. n_ctx - 2`` predict the tokens
``first + 1 .. n_ctx - 1``, ``n_ctx - 1 - first`` per window, so every scored token has at
least ``first`` tokens of context. Over all N scored tokens, with ``x_i = -log p(t_i)``:

    PPL = exp(mean x)        uncertainty = PPL * sqrt((mean x^2 - (mean x)^2) / (N - 1))

(the standard error of mean x carried through exp). A text shorter than ``2 * n_ctx`` tokens is
refused, as llama.cpp does.

The model runs each window in steps of at most ``n_batch`` tokens through ``model.forward``
with the window's KV cache, asking logits only for the scored positions: on the CPU the
float32 reference, on a GPU the prefill kernels. Log-softmax is taken in float64.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from deimos.eval import kld
from deimos.eval.logits_file import FLOOR, LogProbFile, LogProbWriter
from deimos.models.blocks import DecoderModel
from deimos.runtime.kv_cache import KVCache

DEFAULT_CTX = 512  # llama-perplexity's default -c (deimos.eval.cli has a copy)
DEFAULT_BATCH = 512  # tokens per forward step: bounds the attention score matrix (and a copy)
_ROWS = 64  # scored rows per log-softmax on the host (KLD): bounds float64 temporaries


class PerplexityError(ValueError):
    """The text or the settings cannot give a perplexity (too short, bad -c or --chunks)."""


@dataclass(frozen=True)
class Windows:
    """Where the scored windows of a token stream are."""

    n_tokens: int
    n_ctx: int
    n_chunk: int

    @property
    def first(self) -> int:
        return self.n_ctx // 2

    @property
    def scored_per_chunk(self) -> int:
        return self.n_ctx - 1 - self.first

    def start(self, i: int) -> int:
        return i * self.n_ctx


def plan_windows(n_tokens: int, n_ctx: int, n_chunks: int | None = None) -> Windows:
    if n_ctx < 4:
        raise PerplexityError(f"-c {n_ctx}: the context must be at least 4 tokens (half of it "
                              "is context, the other half is scored)")
    if n_chunks is not None and n_chunks <= 0:
        raise PerplexityError(f"--chunks {n_chunks}: must be positive (leave it out for all)")
    if n_tokens < 2 * n_ctx:
        raise PerplexityError(f"the text has {n_tokens} tokens; perplexity with -c {n_ctx} needs "
                              f"at least {2 * n_ctx} (as llama-perplexity): a longer text or a "
                              "smaller -c")
    n_max = n_tokens // n_ctx
    return Windows(n_tokens, n_ctx, n_max if n_chunks is None else min(n_chunks, n_max))


def window_input(tokens: np.ndarray, w: Windows, i: int, bos_id: int | None) -> np.ndarray:
    """The tokens window ``i`` evaluates: its first one replaced by BOS when ``bos_id``."""
    ids = np.array(tokens[w.start(i):w.start(i) + w.n_ctx], dtype=np.int64)
    if bos_id is not None:
        ids[0] = bos_id
    return ids


def window_targets(tokens: np.ndarray, w: Windows, i: int) -> np.ndarray:
    """The scored tokens of window ``i`` [scored_per_chunk] (the original text's, never BOS)."""
    s = w.start(i)
    return np.array(tokens[s + w.first + 1:s + w.n_ctx], dtype=np.int64)


def window_logits(model: DecoderModel, kv: KVCache, ids: np.ndarray, first: int,
                  n_batch: int = DEFAULT_BATCH) -> torch.Tensor:
    """Logits [n_ctx - 1 - first, n_vocab] float32 of positions ``first .. n_ctx - 2`` of one
    window ``ids`` [n_ctx], evaluated from an empty cache on the model's device."""
    device = model.device
    n = ids.shape[0]
    kv.truncate(0)
    out = []
    tokens = torch.from_numpy(ids).to(device)
    for b in range(0, n, n_batch):
        e = min(b + n_batch, n)
        lo, hi = max(b, first), min(e, n - 1)  # scored positions in this step
        # a step with none to score still fills the cache; it asks for its last row only
        want = torch.arange(lo - b, hi - b, device=device) if lo < hi else None
        logits = kv.forward(model, tokens[b:e], want)
        if want is not None:
            out.append(logits)
    return torch.cat(out)


def token_nll(logits: torch.Tensor, targets: np.ndarray) -> np.ndarray:
    """[R] float64: -log softmax(logits[r])[targets[r]], log-softmax in float64."""
    t = torch.from_numpy(targets).to(logits.device)
    logp = torch.log_softmax(logits.double(), dim=-1)
    return (-logp.gather(1, t[:, None])[:, 0]).cpu().numpy()


def ppl_estimate(nll: np.ndarray) -> kld.Estimate:
    """llama.cpp's final estimate: exp(mean nll) and its uncertainty (module docstring)."""
    x = np.asarray(nll, dtype=np.float64)
    n = x.shape[0]
    mean = float(x.mean())
    ppl = math.exp(mean)
    var = float((x * x).mean()) - mean * mean
    return kld.Estimate(ppl, ppl * math.sqrt(var / (n - 1)) if var > 0 and n > 1 else 0.0)


@dataclass(frozen=True)
class PerplexityResult:
    model: str
    text: str
    device: str
    windows: Windows
    nll: np.ndarray  # [n_chunk * scored_per_chunk] float64, window after window
    seconds: float
    kld: kld.KLDSummary | None = None  # with --kl-divergence
    base: str | None = None  # the log-prob file written or read
    chunk_ppl: list[float] = field(default_factory=list)  # running PPL after each window

    @property
    def ppl(self) -> kld.Estimate:
        return ppl_estimate(self.nll)

    def to_json(self) -> dict:
        w = self.windows
        p = self.ppl
        out = {"model": self.model, "text": self.text, "device": self.device,
               "n_tokens": w.n_tokens, "n_ctx": w.n_ctx, "n_chunk": w.n_chunk,
               "scored": int(self.nll.shape[0]), "ppl": p.value, "ppl_unc": p.unc,
               "mean_nll": float(self.nll.mean()), "chunk_ppl": self.chunk_ppl,
               "seconds": self.seconds}
        if self.base is not None:
            out["base"] = self.base
        if self.kld is not None:
            out["kld"] = self.kld.to_json()
        return out


Progress = Callable[[int, int, float], None]  # (windows done, of, running PPL)


def evaluate(model: DecoderModel, tokens: np.ndarray, w: Windows, *, bos_id: int | None,
             n_batch: int = DEFAULT_BATCH, base_out: LogProbWriter | None = None,
             base_in: LogProbFile | None = None, progress: Progress | None = None,
             labels: tuple[str, str] = ("?", "?")) -> PerplexityResult:
    """Scores every window of ``tokens`` (see the module docstring). ``base_out``: also writes
    each window's log-probabilities (the reference run). ``base_in``: compares each window with
    the reference's rows (the tokens must be the file's) and adds the KLD summary."""
    kv = KVCache(model.config, w.n_ctx, device=str(model.device))
    nll, stats, running = [], [], []
    t0 = time.perf_counter()
    for i in range(w.n_chunk):
        logits = window_logits(model, kv, window_input(tokens, w, i, bos_id), w.first, n_batch)
        targets = window_targets(tokens, w, i)
        nll.append(token_nll(logits, targets))
        if base_out is not None or base_in is not None:
            ref = base_in.chunk_logp(i) if base_in is not None else None
            for r in range(0, targets.shape[0], _ROWS):
                test = torch.log_softmax(logits[r:r + _ROWS].double(), dim=-1).cpu().numpy()
                if base_out is not None:
                    base_out.write_rows(test)
                if ref is not None:
                    stats.append(kld.compare_positions(ref[r:r + _ROWS], test,
                                                       targets[r:r + _ROWS], floor=FLOOR))
        running.append(math.exp(float(np.concatenate(nll).mean())))
        if progress is not None:
            progress(i + 1, w.n_chunk, running[-1])
    seconds = time.perf_counter() - t0
    summary = kld.summarize(kld.PositionStats.concat(stats)) if stats else None
    base = base_out.path if base_out is not None else (base_in.path if base_in else None)
    return PerplexityResult(labels[0], labels[1], str(model.device), w, np.concatenate(nll),
                            seconds, summary, None if base is None else str(base), running)
