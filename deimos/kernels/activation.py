"""Gated MLP activations: SwiGLU (llama, qwen) and GeGLU with tanh-approximated GELU (gemma);
gated attention's sigmoid output gate (qwen35)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gated_act(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """gate, up: [..., F] -> act(gate) * up."""
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    raise ValueError(f"gated_act: unknown activation {activation!r}")


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Gated attention's output: ``x * sigmoid(gate)``, gate any view of x's elements in order
    (qwen35: each head's half of the q projection)."""
    return x * torch.sigmoid(gate.reshape(x.shape))
