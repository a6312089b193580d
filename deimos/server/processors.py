"""Logits processors the server attaches to a request (``Request.logits_processors``)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from deimos.kernels.token_mask import NEG, set_ids

# Masked logits are set to NEG (deimos.kernels.token_mask), not -inf: the sampler's top-p
# histogram takes the logits' min-max range, which -inf would make infinite.


class LogitBias:
    """OpenAI ``logit_bias``: add a bias to chosen token ids (-100 in effect bans a token)."""

    def __init__(self, bias: Mapping[int, float]) -> None:
        self.ids = torch.tensor(list(bias.keys()), dtype=torch.long)
        self.values = torch.tensor(list(bias.values()), dtype=torch.float32)

    def __call__(self, output_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        out = logits.clone()
        out[self.ids] += self.values
        return out


class Constrained:
    """Drives a grammar constraint (``JsonConstraint``: ``allowed(logits)``, ``advance(id)``,
    ``done``) from the generation loop: feeds it each token the loop chose, masks what it
    forbids, and once the value is complete allows only end-of-generation tokens, so the
    answer ends there with finish_reason "stop"."""

    def __init__(self, constraint: Any, stop_ids: Collection[int]) -> None:
        self.constraint = constraint
        self.stop_ids = torch.tensor(sorted(stop_ids), dtype=torch.long)
        self._seen = 0

    def _advance(self, output_ids: Sequence[int]) -> None:
        for t in output_ids[self._seen:]:  # one at a time: a refused token is refused again
            self.constraint.advance(t)
            self._seen += 1

    def mask_words(self, output_ids: Sequence[int], out: np.ndarray) -> None:
        """What ``__call__`` would mask now, as allowed-token bit words into ``out`` (uint32
        [n_words(V)]): the device masks the row instead (the batch sampler's window kernel,
        deimos.kernels.triton.sample_batch reads them) and samples it with the others, equal
        to the host's choice on the processed row."""
        self._advance(output_ids)
        if self.constraint.done:
            set_ids(out, self.stop_ids.tolist())
        else:
            self.constraint.mask_words(out)

    def __call__(self, output_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        self._advance(output_ids)
        if self.constraint.done:
            out = torch.full_like(logits, NEG)
            out[self.stop_ids] = logits[self.stop_ids]
            return out
        out = self.constraint.allowed(logits)
        return torch.nan_to_num(out, nan=NEG, neginf=NEG)
