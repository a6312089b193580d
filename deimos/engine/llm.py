"""The Python API: ``LLM(path_or_name).generate(prompt)`` and ``.chat(messages)``.

    llm = LLM("smollm2")
    print(llm.generate("The capital of France is", max_tokens=16, temperature=0, raw=True).text)
    for piece in llm.stream_chat([{"role": "user", "content": "Hi!"}]):
        print(piece, end="")
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deimos.engine.generator import Generator
from deimos.engine.request import Request
from deimos.gguf import GGUFFile
from deimos.kernels.sampling import SamplingParams
from deimos.models import load_model
from deimos.registry import resolve
from deimos.runtime.kernel_cache import use_kernel_cache
from deimos.tokenizer import Tokenizer
from deimos.tokenizer.chat import encode_chat
from deimos.tokenizer.stops import end_of_generation_ids
from deimos.tokenizer.template import ChatTemplate

log = logging.getLogger("deimos")

DEFAULT_CONTEXT = 4096


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    finish_reason: str

    def __str__(self) -> str:
        return self.text


class LLM:
    def __init__(self, model: str | Path, *, n_ctx: int | None = None, device: str = "cpu",
                 progress=None):
        """``model``: a GGUF path or the short name of a known model (pulled if needed).
        ``progress(label)``: called at each loading stage (the CLI's progress bar)."""
        if device != "cpu":
            use_kernel_cache()
        self.path = resolve(model)
        self.file = GGUFFile(self.path)
        if progress is not None:
            progress("weights")
        self.model = load_model(self.file, device=device)
        self.config = self.model.config
        self.tokenizer = Tokenizer.from_gguf(self.file)
        md = self.file.metadata
        tokens = md.get("tokenizer.ggml.tokens", [])
        self.template = ChatTemplate.from_metadata(md, tokens)
        self.stop_ids = end_of_generation_ids(self.tokenizer.vocab, self.template)
        n_ctx = n_ctx or min(self.config.context_length, DEFAULT_CONTEXT)
        self.generator = Generator(self.model, n_ctx, device=device)
        self.generator.warm(progress)  # CUDA graphs (and every kernel) before the first request

    @property
    def n_ctx(self) -> int:
        return self.generator.n_ctx

    # ---- prompts ---------------------------------------------------------------------

    def encode_raw(self, prompt: str) -> list[int]:
        """A raw prompt: BOS as the model's metadata says, special tokens as plain text."""
        return self.tokenizer.encode(prompt, add_special=True, parse_special=False)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], **template_kwargs: Any) -> list[int]:
        """The chat template applied; special tokens parsed in the template's text only."""
        return encode_chat(self.tokenizer, self.template, messages, **template_kwargs)

    # ---- generation ------------------------------------------------------------------

    def _request(self, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams | None,
                 kw: dict[str, Any]) -> Request:
        params = sampling or SamplingParams(**kw)
        return Request(prompt_ids, max_tokens, params, self.stop_ids)

    def stream_ids(self, req: Request) -> Iterator[str]:
        """Text pieces of ``req``'s generated tokens (complete UTF-8 only; stop tokens not shown)."""
        dec = self.tokenizer.stream_decoder()
        for token in self.generator.run(req):
            if req.finish_reason == "stop":
                break
            piece = dec.feed(token)
            if piece:
                yield piece
        tail = dec.flush()
        if tail:
            yield tail

    def stream(self, prompt: str, *, max_tokens: int = 256, raw: bool = False,
               sampling: SamplingParams | None = None, **sampling_kw: Any) -> Iterator[str]:
        """Streams the answer to ``prompt`` (chat template applied unless ``raw``)."""
        ids = self.encode_raw(prompt) if raw else self.encode_chat([{"role": "user", "content": prompt}])
        yield from self.stream_ids(self._request(ids, max_tokens, sampling, sampling_kw))

    def generate(self, prompt: str, *, max_tokens: int = 256, raw: bool = False,
                 sampling: SamplingParams | None = None, **sampling_kw: Any) -> Completion:
        ids = self.encode_raw(prompt) if raw else self.encode_chat([{"role": "user", "content": prompt}])
        return self._complete(self._request(ids, max_tokens, sampling, sampling_kw))

    def stream_chat(self, messages: Sequence[Mapping[str, Any]], *, max_tokens: int = 256,
                    sampling: SamplingParams | None = None, **sampling_kw: Any) -> Iterator[str]:
        req = self._request(self.encode_chat(messages), max_tokens, sampling, sampling_kw)
        yield from self.stream_ids(req)

    def chat(self, messages: Sequence[Mapping[str, Any]], *, max_tokens: int = 256,
             sampling: SamplingParams | None = None, **sampling_kw: Any) -> Completion:
        return self._complete(self._request(self.encode_chat(messages), max_tokens, sampling, sampling_kw))

    def _complete(self, req: Request) -> Completion:
        text = "".join(self.stream_ids(req))
        return Completion(text, list(req.output_ids), len(req.prompt_ids), req.cached_tokens,
                          req.finish_reason or "length")
