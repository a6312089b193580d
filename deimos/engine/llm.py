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

from deimos.engine.engine import Engine, EngineConfig
from deimos.engine.repetition import LoopGuard
from deimos.engine.request import Request
from deimos.engine.speculate import SpecConfig
from deimos.gguf import GGUFFile
from deimos.kernels.sampling import SamplingParams
from deimos.models import load_model
from deimos.registry import resolve
from deimos.runtime.kernel_cache import use_kernel_cache
from deimos.runtime.kv_pool import bytes_per_token, step_bytes
from deimos.tokenizer import Tokenizer
from deimos.tokenizer.chat import encode_chat
from deimos.tokenizer.stops import end_of_generation_ids
from deimos.tokenizer.template import ChatTemplate

log = logging.getLogger("deimos")

DEFAULT_CONTEXT = 4096


def check_device(device: str, name: str = "device") -> str:
    """``device`` if Deimos can run on it here, else a ValueError in one line naming ``name``
    (the CLI passes "--device"): an unknown device, a CPU-only torch, no GPU, no such GPU."""
    import torch

    kind, _, index = device.partition(":")
    if kind == "cpu" and not index:
        return device
    if kind != "cuda" or (index and not index.isdigit()):
        raise ValueError(f"{name} {device!r}: Deimos runs on cpu, cuda or cuda:N")
    if torch.version.cuda is None:
        raise ValueError(f"{name} {device}: this torch ({torch.__version__}) is a CPU-only build; "
                         f"install a CUDA build of torch, or use {name} cpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ValueError(f"{name} {device}: torch {torch.__version__} (CUDA {torch.version.cuda}) "
                         "sees no CUDA GPU (driver, nvidia-smi, CUDA_VISIBLE_DEVICES?); "
                         f"or use {name} cpu")
    if index and int(index) >= count:
        raise ValueError(f"{name} {device}: there is no GPU {index}; this machine has {count} "
                         f"(cuda:0..cuda:{count - 1})")
    return device


def context_size(n_ctx: int | None, trained: int, name: str = "n_ctx") -> int:
    """The context to allocate: ``n_ctx``, or the trained context up to DEFAULT_CONTEXT."""
    if n_ctx is None:
        return min(trained, DEFAULT_CONTEXT)
    if isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx < 2:
        raise ValueError(f"{name} must be an integer >= 2 (the prompt plus one token), "
                         f"got {n_ctx!r}")
    return n_ctx


def speculation(method: str | None, k: int | None,
                draft_model: str | None = None) -> SpecConfig | None:
    """The SpecConfig of ``speculative`` / ``spec_k`` / ``draft_model`` (None: off)."""
    if method is None:
        if k is not None or draft_model is not None:
            raise ValueError("spec_k and draft_model need speculative (e.g. speculative='ngram')")
        return None
    extra = {} if k is None else {"k_max": k}
    return SpecConfig(method, draft_model=draft_model, **extra)


def same_vocabulary(model: GGUFFile, draft: GGUFFile) -> None:
    """A ValueError unless ``draft`` tokenizes as ``model`` does (the same token strings)."""
    key = "tokenizer.ggml.tokens"
    a, b = model.metadata.get(key), draft.metadata.get(key)
    if a is None or b is None or len(a) != len(b) or list(a) != list(b):
        n_a, n_b = len(a or ()), len(b or ())
        raise ValueError(f"the draft model {Path(draft.path).name} does not share "
                         f"{Path(model.path).name}'s vocabulary ({n_b} tokens against {n_a}, "
                         "or different ones): a draft model must tokenize as the model does")


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
                 progress=None, dense_weights: str = "auto", experts: str = "auto",
                 expert_cache_gib: float | None = None, speculative: str | None = None,
                 spec_k: int | None = None, draft_model: str | Path | None = None,
                 **engine: Any):
        """``model``: a GGUF path or the short name of a known model (pulled if needed).
        ``progress(label)``: called at each loading stage (the CLI's progress bar).
        ``n_ctx``: the most tokens one sequence holds; past the model's trained context it is
        allowed, with a warning. ``engine``: EngineConfig's other fields (max_seqs,
        max_batch_tokens, block_size, kv_tokens, kv_gib, prefix_cache, cuda_graphs).
        ``dense_weights``: auto, on or off: fp16 copies of the quantized linears beside their
        packed bytes for batched steps (deimos.models.gpu.placement; GPU only). ``experts``
        (MoE files on a GPU): auto, gpu or cpu: the routed experts on the GPU, or on the host
        with a GPU cache of slots (deimos.models.gpu.offload), sized from free memory and
        elastic, or fixed at ``expert_cache_gib``. ``speculative``: "ngram" (prompt lookup drafts,
        deimos.engine.speculate), "draft" (greedy drafts of ``draft_model``, a GGUF path or known
        name with this model's vocabulary), "mtp" (greedy drafts of the file's MTP layers,
        deimos.engine.mtp_draft; on the GPU eager steps) or None (off); ``spec_k``: the most drafts a step
        verifies (default: SpecConfig's). A SpecConfig may also come as ``spec``."""
        check_device(device)
        if draft_model is not None:
            draft_model = str(resolve(draft_model))
        spec = speculation(speculative, spec_k, draft_model)
        if spec is not None:
            if engine.get("spec") is not None:
                raise ValueError("give speculative (and spec_k) or spec, not both")
            engine["spec"] = spec
        if dense_weights not in ("auto", "on", "off"):
            raise ValueError(f"dense_weights must be auto, on or off, got {dense_weights!r}")
        if experts not in ("auto", "gpu", "cpu"):
            raise ValueError(f"experts must be auto, gpu or cpu, got {experts!r}")
        if expert_cache_gib is not None and not expert_cache_gib >= 0:
            raise ValueError(f"expert_cache_gib must be >= 0, got {expert_cache_gib!r}")
        if device.startswith("cuda:"):  # the kernels, events and memory queries use the current device
            import torch

            torch.cuda.set_device(torch.device(device))
        if device != "cpu":
            use_kernel_cache()
        self.path = resolve(model)
        self.file = GGUFFile(self.path)
        if n_ctx is not None:
            context_size(n_ctx, 0)  # a bad value fails before the weights load
        if progress is not None:
            progress("weights")
        self.offload = None
        self.dense = None
        if device == "cpu":
            self.model = load_model(self.file, device=device)
        else:
            self.model = self._load_gpu(device, n_ctx, experts, expert_cache_gib, engine)
        self.config = self.model.config
        self.tokenizer = Tokenizer.from_gguf(self.file)
        md = self.file.metadata
        tokens = md.get("tokenizer.ggml.tokens", [])
        self.template = ChatTemplate.from_metadata(md, tokens)
        self.stop_ids = end_of_generation_ids(self.tokenizer.vocab, self.template)
        spec = engine.get("spec")
        if spec is not None and spec.draft_model is not None:
            same_vocabulary(self.file, GGUFFile(spec.draft_model))
        n_ctx = context_size(n_ctx, self.config.context_length)
        if n_ctx > self.config.context_length:
            log.warning("context size %d is past %s's trained context of %d tokens: expect "
                        "the answers to degrade past %d", n_ctx, self.path.name,
                        self.config.context_length, self.config.context_length)
        if device == "cpu":
            engine.setdefault("max_seqs", 32)
        else:  # before the KV pool takes its share of the free memory
            from deimos.models.gpu.placement import place_dense

            # an offloaded model's memory is the expert cache's
            if self.offload is not None and dense_weights == "on":
                log.warning("dense weights: off for a model whose experts are offloaded (its free "
                            "memory is the expert cache's)")
            self.dense = place_dense(self.model, "off" if self.offload is not None else dense_weights)
        self.engine = Engine(self.model, EngineConfig(n_ctx=n_ctx, **engine))
        if self.offload is not None:  # the pool exists now: the cache keeps only a step's room free
            cfg_e = self.engine.cfg
            self.offload.set_step_bytes(step_bytes(self.config, cfg_e.max_batch_tokens))
        self.engine.warm(progress)  # CUDA graphs (and every kernel) before the first request

    def _load_gpu(self, device: str, n_ctx: int | None, experts: str, cache_gib: float | None,
                  engine: dict):
        """The model on the GPU, its routed experts placed first (deimos.models.gpu.placement):
        on the device, or on the host behind an expert cache (deimos.models.gpu.offload)."""
        import torch

        from deimos.models.config import ModelConfig
        from deimos.models.gpu.placement import offload_kv_tokens, plan_experts

        cfg = ModelConfig.from_gguf(self.file.metadata, source=str(self.file.path), tensors=self.file.tensors)
        if not cfg.is_moe:
            return load_model(self.file, device=device)
        ctx = context_size(n_ctx, cfg.context_length)
        seqs = engine.get("max_seqs", 64)
        # what is allocated after the experts: two contexts of KV (at least), the step's activations
        bpt = bytes_per_token(cfg, torch.float16)
        act = step_bytes(cfg, engine.get("max_batch_tokens", 2048))
        reserve = max(2 * ctx * bpt + act, min(seqs, 4) * ctx * bpt)
        spec = engine.get("spec")
        mtp = spec is not None and spec.method == "mtp"
        plan = plan_experts(self.file, experts, reserve_bytes=reserve, mtp=mtp)
        log.info("routed experts: %s", plan.reason)
        if mtp and plan.device == "cpu":  # said before the load, not after it (load_mtp's refusal)
            raise ValueError(f"{self.path.name}: MTP drafting needs the routed experts on the GPU, "
                             f"and they go to the host ({plan.reason}); use --speculative ngram, "
                             "or no speculation")
        if plan.device == "gpu":
            return load_model(self.file, device=device)
        from deimos.models.gpu.offload import ExpertOffload
        from deimos.runtime.expert_stream import RING

        if engine.get("kv_tokens") is None and engine.get("kv_gib") is None:
            # before loading: a context that cannot fit is said now, and the pool's share known
            free, _ = torch.cuda.mem_get_info(torch.device(device))
            ring = RING * -(-plan.expert_bytes // max(1, cfg.n_layer))  # a layer's experts a buffer
            engine["kv_tokens"] = offload_kv_tokens(ctx, bpt, plan.other_bytes, act, free,
                                                    self.path.name, stage_bytes=ring)
        kv = (engine["kv_tokens"] * bpt if engine.get("kv_tokens") is not None
              else int(engine["kv_gib"] * 2**30))
        reserve = kv + act  # what is allocated after the cache: the pool, the step's activations
        model = load_model(self.file, device=device, expert_device="cpu")
        self.offload = ExpertOffload(model, self.file, torch.device(device), reserve_bytes=reserve,
                                     cache_bytes=None if cache_gib is None else int(cache_gib * 2**30),
                                     max_rows=seqs)
        model.ops.attach_offload(self.offload)
        try:  # how a step's misses split between the CPU and the device
            self.offload.calibrate()
        except Exception as e:  # noqa: BLE001 - an optimisation: the load goes on without it
            log.warning("expert offload: the CPU/device split could not be measured (%s: %s): "
                        "every miss is computed on the CPU", type(e).__name__, e)
            self.offload.fix_share(0.0)
        return model

    @property
    def n_ctx(self) -> int:
        return self.engine.n_ctx

    @property
    def has_chat_template(self) -> bool:
        """The file carries its own chat template (else: a base model, or a default one)."""
        return bool(self.file.metadata.get("tokenizer.chat_template"))

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
        """``kw``: SamplingParams' fields, and ``loop_guard`` (a LoopGuard, or True for the
        default one: finish with reason "repetition" when the output cycles)."""
        guard = kw.pop("loop_guard", None)
        if guard is True:
            guard = LoopGuard()
        params = sampling or SamplingParams(**kw)
        return Request(prompt_ids, max_tokens, params, self.stop_ids, loop_guard=guard or None)

    def run(self, req: Request) -> Iterator[int]:
        """Generates ``req`` alone (the engine runs it with whatever else this thread added):
        yields each token id as it is chosen; sets ``req.finish_reason``. Closing the iterator
        early cancels the request (its blocks are free at once)."""
        seq = self.engine.add(req)
        try:
            while not seq.finished:
                for out in self.engine.step():
                    if out.seq is seq:
                        if out.error is not None:
                            raise out.error
                        yield out.token
        finally:
            self.engine.cancel(seq)

    def run_many(self, reqs: Sequence[Request]) -> list[Request]:
        """Generates every request of ``reqs`` together (continuous batching); returns them
        finished. A failed one raises its error after the others finished."""
        seqs = [self.engine.add(r) for r in reqs]
        errors: list[BaseException] = []
        try:
            while not all(s.finished for s in seqs):
                for out in self.engine.step():
                    if out.error is not None and out.seq in seqs:
                        errors.append(out.error)
        finally:
            for s in seqs:
                self.engine.cancel(s)
        if errors:
            raise errors[0]
        return list(reqs)

    def stream_ids(self, req: Request) -> Iterator[str]:
        """Text pieces of ``req``'s generated tokens (complete UTF-8 only; stop tokens not shown)."""
        dec = self.tokenizer.stream_decoder()
        for token in self.run(req):
            # the end-of-generation token (a step that chose several tokens has already
            # recorded the finish reason when the ones before it come out)
            if req.finish_reason == "stop" and token in req.stop_ids:
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

    def generate_many(self, prompts: Sequence[str], *, max_tokens: int = 256, raw: bool = False,
                      sampling: SamplingParams | None = None, **sampling_kw: Any) -> list[Completion]:
        """Every prompt answered, decoded together."""
        reqs = []
        for p in prompts:
            ids = self.encode_raw(p) if raw else self.encode_chat([{"role": "user", "content": p}])
            reqs.append(self._request(ids, max_tokens, sampling, dict(sampling_kw)))
        self.run_many(reqs)
        return [self._completion(r) for r in reqs]

    def _completion(self, req: Request) -> Completion:
        ids = [t for t in req.output_ids if not (req.finish_reason == "stop" and t in req.stop_ids)]
        return Completion(self.tokenizer.decode(ids), list(req.output_ids), len(req.prompt_ids),
                          req.cached_tokens, req.finish_reason or "length")

    def _complete(self, req: Request) -> Completion:
        text = "".join(self.stream_ids(req))
        return Completion(text, list(req.output_ids), len(req.prompt_ids), req.cached_tokens,
                          req.finish_reason or "length")
