"""The generation loop of one sequence: prefill the prompt, then decode token by token.

The KV cache belongs to the generator's single slot and outlives a request: the next
request reuses the longest common prefix of its prompt with what the cache holds (a chat
resends the whole conversation every turn) and prefills only the rest.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from deimos.engine.request import ContextLengthError, EngineError, Request, RequestError
from deimos.kernels.sampling import Sampler, logprobs
from deimos.models.batch import Batch
from deimos.models.blocks import DecoderModel
from deimos.runtime.kv_cache import KVCache

PREFILL_CHUNK = 512  # prompt tokens per forward step: bounds the attention score matrix


class Generator:
    def __init__(self, model: DecoderModel, n_ctx: int, device: str = "cpu", cuda_graph: bool = True):
        self.model = model
        self.n_ctx = n_ctx
        self.device = device
        self.kv = KVCache(model.config, n_ctx, device=device)
        self.cached: list[int] = []  # tokens whose entries the cache holds, in order
        self.graph = None  # decode steps replay one CUDA graph on the kernel path
        self.prefill_graphs = None  # prompt chunks: one graph per padded length
        if cuda_graph and model.device.type == "cuda" and getattr(model.ops, "graph_safe", False):
            from deimos.runtime.graph import DecodeGraph, PrefillGraphs

            pool = torch.cuda.graph_pool_handle()  # one pool: the graphs never run at once
            self.graph = DecodeGraph(model, self.kv, pool=pool)
            self.prefill_graphs = PrefillGraphs(model, self.kv, pool=pool)

    def warm(self, progress=None) -> None:
        """Capture every graph now (compiling every kernel the model needs): the first
        request then pays nothing and GPU memory is taken once. A no-op without graphs."""
        if self.graph is None:
            return
        if self.kv.length:
            raise RuntimeError("Generator.warm: only before the first request")
        self.prefill_graphs.capture_all(progress)
        if progress is not None:
            progress("decode graph")
        self.graph.capture()

    def _reuse_prefix(self, prompt: list[int]) -> int:
        n = 0
        limit = min(len(prompt) - 1, len(self.cached))  # always recompute the last prompt token
        while n < limit and prompt[n] == self.cached[n]:
            n += 1
        self.kv.truncate(n)
        del self.cached[n:]
        return n

    def reset(self) -> None:
        """Forget everything cached (the next prompt is prefilled whole)."""
        self.kv.truncate(0)
        self.cached.clear()

    def prefill(self, tokens: list[int]) -> torch.Tensor:
        """``tokens`` appended to the cache in chunks of PREFILL_CHUNK; the last one's logits."""
        for i in range(0, len(tokens), PREFILL_CHUNK):
            logits = self.forward(tokens[i : i + PREFILL_CHUNK])
        return logits

    def forward(self, tokens: list[int]) -> torch.Tensor:
        """One step of ``tokens`` at the cache's next positions (a graph replay when one
        holds it): the logits [n_vocab] of the last, valid until the next step."""
        logits = None
        if len(tokens) == 1 and self.graph is not None:
            logits = self.graph.step(tokens[0])
        elif self.prefill_graphs is not None:
            logits = self.prefill_graphs.run(tokens)
        if logits is not None:
            self.cached.extend(tokens)
            return logits
        start = self.kv.length
        batch = Batch(
            torch.tensor(tokens, dtype=torch.long, device=self.device),
            torch.arange(start, start + len(tokens), device=self.device),
            self.kv,
        )
        logits = self.model.forward(batch)[0]
        self.cached.extend(tokens)
        return logits

    def run(self, req: Request) -> Iterator[int]:
        """Yields each generated token id as soon as it is chosen; sets ``req.finish_reason``."""
        n_vocab = self.model.config.n_vocab
        bad = [t for t in req.prompt_ids if not 0 <= t < n_vocab]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {n_vocab})")
        if len(req.prompt_ids) >= self.n_ctx:
            raise ContextLengthError(
                f"the prompt has {len(req.prompt_ids)} tokens; the context holds {self.n_ctx} "
                "(prompt plus at least one generated token)"
            )
        req.sampler = Sampler(req.sampling, n_vocab)
        for t in req.prompt_ids:
            req.sampler.accept(t)
        if req.max_tokens == 0:
            req.finish_reason = "length"
            return
        try:
            req.cached_tokens = self._reuse_prefix(req.prompt_ids)
            logits = self.prefill(req.prompt_ids[req.cached_tokens:])
            while True:
                token = self._sample(req, logits)
                yield token
                if req.finish_reason is not None:
                    return
                if self.graph is not None and _chainable(req):
                    yield from self._greedy_chain(req, token)
                    return
                logits = self.forward([token])
        except BaseException:
            # a failed or abandoned step leaves the cache consistent with ``cached``
            self.kv.truncate(min(self.kv.length, len(self.cached)))
            raise

    def _sample(self, req: Request, logits: torch.Tensor) -> int:
        logits = logits.float() if _device_sampling(req) else logits.float().cpu()
        processed = logits
        for proc in req.logits_processors:
            processed = proc(req.output_ids, processed)
        try:
            token = req.sampler.sample(processed)
        except ValueError as e:  # the request's sampling was checked: the logits are at fault
            raise EngineError(f"cannot sample from the model's logits: {e}") from e
        if req.top_logprobs is not None:
            req.token_logprobs.append(logprobs(logits, token, req.top_logprobs))
        self._emit(req, token)
        return token

    def _emit(self, req: Request, token: int) -> None:
        """``token`` is the request's next output: recorded, and the request finished on a
        stop token or the last output allowed: ``max_tokens``, or no cache row left to feed
        it (every earlier output has been fed: prompt + outputs - 1 rows)."""
        req.sampler.accept(token)
        req.output_ids.append(token)
        if token in req.stop_ids:
            req.finish_reason = "stop"
        elif req.loop_guard is not None and req.loop_guard.period(req.output_ids) is not None:
            req.finish_reason = "repetition"
        elif (len(req.output_ids) >= req.max_tokens
              or len(req.prompt_ids) + len(req.output_ids) - 1 >= self.n_ctx):  # fmt: skip
            req.finish_reason = "length"

    def _greedy_chain(self, req: Request, token: int) -> Iterator[int]:
        """Greedy decoding a step ahead of the host: the decode graph writes its argmax as
        the next replay's token (runtime/graph.py), so step j + 1 is enqueued before step j's
        token is read and the GPU does not wait for the host between tokens. ``token`` (the
        last output, not yet fed) starts the chain; step j feeds output ``first + j`` and
        makes the next. A step is launched only while its output is within ``max_tokens`` and
        a cache row is free, so the one step that can run past the end is the one fed a stop
        token: its row is then recorded in ``cached`` like any fed token (a valid entry)."""
        graph = self.graph
        graph.start_chain(token)
        first = len(req.output_ids) - 1
        tickets: list[int] = []
        launched = read = recorded = 0

        def record() -> None:  # the launched steps' inputs known so far, into ``cached``
            nonlocal recorded
            while recorded < min(launched, read + 1):
                self.cached.append(req.output_ids[first + recorded])
                recorded += 1

        while True:
            while (launched - read < 2 and first + launched + 2 <= req.max_tokens
                   and self.kv.length < self.n_ctx):  # fmt: skip
                tickets.append(graph.launch_chained())
                launched += 1
                record()
            if not tickets:  # unreachable: the last read output finished the request
                raise RuntimeError("greedy chain: no step in flight for an unfinished request")
            token = graph.chained_token(tickets.pop(0))
            read += 1
            self._emit(req, token)
            record()
            yield token
            if req.finish_reason is not None:
                return


def _chainable(req: Request) -> bool:
    """Greedy with nothing that needs the host between tokens (penalties read the history,
    processors and logprobs the host logits): the chain of device-chosen tokens applies."""
    return (req.sampling.greedy and not req.sampling.penalties_enabled
            and _device_sampling(req))  # fmt: skip


def _device_sampling(req: Request) -> bool:
    """The sampler (penalties, top-k/top-p/min-p, temperature, the draw) runs where the logits
    are: on a GPU the vocabulary never crosses to the host, one int is read back. Logits
    processors (grammar masks) and logprobs work on host logits."""
    return not req.logits_processors and req.top_logprobs is None
