"""A GPU tests' helper for the kernels that load weights before their PDL wait (``ahead``):
a chain of dependent launches captured in a CUDA graph and replayed on new inputs must give
what the same chain gives run eagerly with the loads after the wait."""

from __future__ import annotations

from collections.abc import Callable

import torch


def assert_replays_match(chain: Callable[[], torch.Tensor], x: torch.Tensor, module, monkeypatch,
                         replays: int = 3) -> None:
    """``chain()`` reads ``x`` (a static CUDA input); ``module`` is the one whose
    ``ahead_on`` decides the launches (patched to False for the eager oracle)."""
    x.copy_(torch.randn(x.shape, device=x.device))
    chain()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = chain()
    for seed in range(replays):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(x.device))
        graph.replay()
        torch.cuda.synchronize()
        with monkeypatch.context() as m:
            m.setattr(module, "ahead_on", lambda device: False)
            want = chain()
        err = ((y - want).double().norm() / want.double().norm()).item()
        assert err < 1e-6, f"replay {seed}: relative error {err:.2e}"
