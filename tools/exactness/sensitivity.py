"""How strongly a sequence amplifies small errors: Gaussian noise of relative size ``eps``
(times each row's RMS) added to the input of every linear of the float32 reference, and the
KLD of the noisy log-probs to the clean ones (docs/exactness.md: some repeated-word sequences
turn llama.cpp's 1% activation rounding into several nats).

    python -m tools.exactness.sensitivity MODEL.gguf WORD [WORD ...]   (from the repo root)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from deimos.eval.kld import kld_per_position
from deimos.gguf import GGUFFile
from deimos.models import load_model
from deimos.models.weights import Linear
from deimos.runtime.kv_cache import KVCache
from deimos.tokenizer import Tokenizer

from .q8act import linears
from .sequences import REPEAT_TIMES

EPS = (1e-4, 1e-3, 1e-2)


class NoisyLinear(Linear):
    """A reference ``Linear`` whose input gets ``eps * rms(row) * N(0, 1)`` first."""

    eps: float = 0.0
    generator: torch.Generator | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.eps:
            rms = x.pow(2).mean(-1, keepdim=True).sqrt()
            x = x + self.eps * rms * torch.randn(x.shape, generator=self.generator)
        return super().__call__(x)


def log_probs(model, ids: list[int]) -> torch.Tensor:
    n = len(ids)
    out = KVCache(model.config, n).forward(model, torch.tensor(ids), torch.arange(n - 1))
    return out.double().log_softmax(-1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("words", nargs="+")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    f = GGUFFile(args.model)
    model, tok = load_model(f), Tokenizer.from_gguf(f)
    lins = linears(model)
    g = torch.Generator().manual_seed(args.seed)
    for lin in lins:
        lin.__class__ = NoisyLinear
        lin.generator = g
    for word in args.words:
        ids = tok.encode(" ".join([word] * REPEAT_TIMES))
        for lin in lins:
            lin.eps = 0.0
        clean = log_probs(model, ids).numpy()
        cells = []
        for eps in EPS:
            for lin in lins:
                lin.eps = eps
            k = kld_per_position(clean, log_probs(model, ids).numpy())
            cells.append(f"eps {eps:g}: KLD mean {k.mean():.2g} max {k.max():.2g}")
        print(f"{word} x{REPEAT_TIMES}: " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
