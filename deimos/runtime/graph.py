"""Decode as one CUDA graph: a model's one-token step over one KV cache, captured once and
replayed every token.

The graph reads the token and its position from two static device tensors, which are
filled from a pinned host buffer before each replay (one small copy); every intermediate
lives in the graph's private memory pool, so a replay allocates nothing and makes no host
synchronisation: the caller syncs once, when it reads the sampled token. Nothing in the step
depends on the position on the host (deimos.models.gpu.ops: cache scatter at the device
position, decode attention over the whole cache with the length read on the device), so the
graph is captured once per (model, cache) and never patched or re-captured.

The cache's host bookkeeping (``begin``/``commit``) stays outside the graph, here.
"""

from __future__ import annotations

import torch

from deimos.models.batch import Batch
from deimos.models.blocks import DecoderModel
from deimos.runtime.kv_cache import KVCache


class DecodeGraph:
    def __init__(self, model: DecoderModel, kv: KVCache, warmup: int = 2):
        device = model.device
        if device.type != "cuda":
            raise ValueError(f"DecodeGraph: the model is on {device}, CUDA graphs need a CUDA device")
        self.model = model
        self.kv = kv
        self.warmup = warmup
        self.tokens = torch.zeros(1, dtype=torch.long, device=device)
        self.positions = torch.zeros(1, dtype=torch.long, device=device)
        self._host = torch.zeros(2, dtype=torch.long).pin_memory()
        self._graph: torch.cuda.CUDAGraph | None = None
        self._logits: torch.Tensor | None = None
        self.replays = 0

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def _load(self, token: int, position: int) -> None:
        self._host[0] = token
        self._host[1] = position
        self.tokens.copy_(self._host[:1], non_blocking=True)
        self.positions.copy_(self._host[1:], non_blocking=True)

    @torch.inference_mode()
    def _capture(self) -> None:
        # warm-up and capture write this step's keys and values at the position loaded now,
        # which is the free slot the real step writes next: nothing valid is overwritten
        batch = Batch(self.tokens, self.positions, self.kv)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compiles the kernels, settles the allocator
            for _ in range(self.warmup):
                self.model.step(batch, self.kv.length)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._logits = self.model.step(batch, self.kv.length)[0]
        self._graph = graph

    def step(self, token: int) -> torch.Tensor:
        """Runs ``token`` at the cache's next position and commits it; returns the logits
        float32 ``[n_vocab]`` on the device (a static tensor: valid until the next step)."""
        position = self.kv.begin(self.positions)  # the room check (device positions: no sync)
        self._load(token, position)
        if self._graph is None:
            self._capture()
        self._graph.replay()
        self.replays += 1
        self.kv.commit(1)
        return self._logits
