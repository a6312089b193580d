"""Speculative decoding: drafts of a sequence's next tokens, verified in one batched step.

    engine = Engine(model, EngineConfig(n_ctx=4096, spec=SpecConfig("ngram", k_max=6)))

A drafter (``Drafter.propose(seq, k)``) guesses up to k tokens that follow a decoding sequence.
The scheduler packs the sequence's last token and its drafts into the step beside the other
sequences' decodes and prompt chunks (k + 1 rows with logits at each; deimos.engine.runner),
and the engine walks those rows in order (``Engine._verify``):
- at row j the token is chosen from the distribution the plain sampler uses there (penalties
  counting the tokens accepted before it, top-k/top-p/min-p, temperature, the request's seed
  stream), and the draft d is accepted: greedy, when d is that token; sampled, by the standard
  rejection rule for a deterministic draft (q one-hot at d; deimos.engine.sampling.accept_draft):
  with probability p(d), and on the first rejection the token is drawn from p with d removed
  and renormalized, so that every emitted token follows p exactly;
- the accepted drafts and then the correction (or, after k accepted drafts, a bonus token drawn
  at the last row) go out through the plain path one by one: a stop token, max_tokens, the loop
  guard or a full context ends the run at that token;
- the cache keeps the accepted prefix: the sequence's n_computed ends there, the rows of
  rejected drafts are overwritten later, blocks taken only for them go back, and only computed
  (accepted) tokens are ever sealed into the prefix cache.
A verification gives 1 (a plain decode's one token) to k + 1 tokens; how many drafts a sequence
asks for adapts to what it accepted (``SpecState``). A sequence asking for none decodes plainly
(on a GPU, in the chained decode graphs).

Drafters: ``NgramDrafter`` (prompt lookup: the tokens that followed the most recent earlier
occurrence of the sequence's last n tokens, n from ``ngram_max`` down to ``ngram_min``, in its
own prompt and outputs); ``DraftModelDrafter`` (greedy drafts of a smaller model with the same
vocabulary, on a KV pool of its own); ``MTPDrafter`` (deimos.engine.mtp_draft: greedy drafts of
the model's own MTP layers, fed the main model's hidden rows of each step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from deimos.engine.block_manager import BlockManager
from deimos.models.batch import Batch, SeqLayout
from deimos.runtime.kv_pool import KVPool, bytes_per_token

if TYPE_CHECKING:
    from deimos.engine.sequence import Sequence
    from deimos.models.blocks import DecoderModel

METHODS = ("ngram", "draft", "mtp")
K_LIMIT = 16  # drafts a verification may carry
NGRAM_LIMIT = 16
BACKOFF_MIN, BACKOFF_MAX = 4, 64  # plain tokens after a failed probe of one draft (doubling)
MISS_MAX = 16  # plain tokens after the drafter had nothing (doubling from 1)
DRAFT_KV_BYTES = 2 * 2**30  # the most a draft model's KV pool takes
DRAFT_CHUNK = 512  # tokens a draft model's catch-up step feeds at most


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding's settings: ``method`` (ngram: prompt lookup; draft: a draft model,
    the GGUF file ``draft_model``, with the target's vocabulary; mtp: the model's MTP layers), ``k_max`` (the most drafts one
    verification carries), the n-gram lengths the lookup tries (longest first)."""

    method: str = "ngram"
    k_max: int = 6
    ngram_min: int = 2
    ngram_max: int = 4
    draft_model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, "
                             f"got {self.method!r}")
        for name, lo, hi in (("k_max", 1, K_LIMIT), ("ngram_min", 1, NGRAM_LIMIT),
                             ("ngram_max", 1, NGRAM_LIMIT)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"{name} must be an integer in {lo}..{hi}, got {v!r}")
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must be <= ngram_max ({self.ngram_max})")
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError("speculative method draft needs a draft_model (a GGUF file with the "
                             "model's vocabulary), and only it takes one")


@dataclass(slots=True)
class SpecState:
    """One sequence's speculation. ``k``: the drafts it asks for next; ``resume_at``: the
    output length before which it asks for none (decoding plainly); ``drafter``: the drafter's
    state for it (the n-gram index). The rule: after k accepted drafts ask for one more (up to
    k_max); after a partial run, one more than it accepted; after none, half as many; at zero,
    decode ``backoff`` tokens plainly (doubling while probes of one draft keep failing), then
    probe with one. A lookup that finds nothing waits 1, 2, 4, ... tokens before the next.
    ``rollback``: a hybrid model's recurrent state as it was before the verification in flight
    (its step advances the state over every draft; after a rejection it goes back to this one
    and the accepted tokens are recomputed, deimos.engine.engine)."""

    k: int
    resume_at: int = 0
    backoff: int = BACKOFF_MIN
    miss_skip: int = 1
    drafter: object | None = None
    rollback: object | None = None  # a hybrid's recurrent state before its verification

    def wanted(self, n_out: int) -> int:
        """Drafts to ask for when the output holds ``n_out`` tokens (0: decode plainly)."""
        return self.k if n_out >= self.resume_at else 0

    def found(self, n_drafts: int, n_out: int) -> None:
        """The drafter gave ``n_drafts`` drafts (0: it had none) at output length ``n_out``."""
        if n_drafts:
            self.miss_skip = 1
        else:
            self.resume_at = n_out + self.miss_skip
            self.miss_skip = min(MISS_MAX, 2 * self.miss_skip)

    def verified(self, drafted: int, accepted: int, n_out: int, k_max: int) -> None:
        """``accepted`` of ``drafted`` drafts were accepted; the output holds ``n_out`` now."""
        if accepted:
            self.backoff = BACKOFF_MIN
            self.k = min(k_max, self.k + 1) if accepted == drafted else accepted + 1
            return
        self.k //= 2
        if not self.k:
            self.k = 1
            self.resume_at = n_out + self.backoff
            self.backoff = min(BACKOFF_MAX, 2 * self.backoff)


class Drafter(Protocol):
    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to ``k`` tokens guessed to follow ``seq.tokens`` (fewer, or none: no guess).
        Per-sequence state lives in ``seq.spec.drafter``, never in the drafter."""
        ...

    def release(self, seq: Sequence) -> None:
        """``seq`` finished: what the drafter holds for it goes back."""
        ...


class NgramIndex:
    """Where each n-gram (n_min..n_max) of a growing token list last ended: one dict per n,
    token tuple -> end (exclusive), extended incrementally (each token indexed once)."""

    __slots__ = ("ends", "n_max", "n_min", "upto")

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min = n_min
        self.n_max = n_max
        self.ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(n_min, n_max + 1)]
        self.upto = 0  # every n-gram ending at or before this position is indexed

    def extend(self, tokens: list[int], end: int) -> None:
        """Index the n-grams of ``tokens`` that end after ``upto`` and at or before ``end``."""
        for n, table in zip(range(self.n_min, self.n_max + 1), self.ends):
            lo = max(self.upto + 1, n)
            if lo > end:
                continue
            # the grams tokens[e - n : e] for e in lo..end, built by zip (no Python loop)
            grams = zip(*(tokens[lo - n + i : end - n + i + 1] for i in range(n)))
            table.update(zip(grams, range(lo, end + 1)))
        self.upto = max(self.upto, end)

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """The ``k`` tokens that followed the most recent earlier occurrence of the longest
        n-gram ending ``tokens`` that occurred before; past the end of ``tokens`` the proposal
        continues from itself (a repeating span repeats on). Empty when none occurred."""
        n_tok = len(tokens)
        self.extend(tokens, n_tok - 1)  # earlier occurrences: ending before the last token
        for n in range(min(self.n_max, n_tok - 1), self.n_min - 1, -1):
            e = self.ends[n - self.n_min].get(tuple(tokens[n_tok - n :]))
            if e is not None:
                out: list[int] = []
                for i in range(k):
                    j = e + i
                    out.append(tokens[j] if j < n_tok else out[j - n_tok])
                return out
        return []


class NgramDrafter:
    """Prompt lookup: drafts copied from the sequence's own tokens (``NgramIndex``)."""

    def __init__(self, n_min: int = 2, n_max: int = 4) -> None:
        self.n_min = n_min
        self.n_max = n_max

    def propose(self, seq: Sequence, k: int) -> list[int]:
        st = seq.spec
        if st.drafter is None:
            st.drafter = NgramIndex(self.n_min, self.n_max)
        return st.drafter.lookup(seq.tokens, k)

    def release(self, seq: Sequence) -> None:
        pass  # the index goes with the sequence


@dataclass(slots=True)
class DraftCache:
    """A sequence's state in the draft model's cache: its block table and the tokens whose keys
    and values it holds (``fed``: the sequence's first ``agreed`` tokens, then drafts)."""

    table: list[int] = field(default_factory=list)
    fed: list[int] = field(default_factory=list)
    agreed: int = 0


class DraftModelDrafter:
    """Greedy drafts from a smaller model with the target's vocabulary, on a KV pool of its own
    (``kv_tokens`` positions shared by the sequences through block tables). Before proposing
    for a sequence it rolls its cache back to the longest prefix the sequence still agrees with
    (rejected drafts go), feeds what the sequence gained since (chunks of ``DRAFT_CHUNK``), then
    takes k - 1 more greedy steps. A sequence the pool cannot hold gets no drafts; its blocks
    go back when it finishes (``release``). Each sequence's draft steps run alone (eagerly)."""

    def __init__(self, model: DecoderModel, n_ctx: int, kv_tokens: int, block_size: int = 16) -> None:
        if model.config.is_hybrid:
            raise ValueError(f"a draft model must not be hybrid ({model.config.arch}: its "
                             "recurrent state cannot be rolled back)")
        self.model = model
        self.block_size = block_size
        n_blocks = -(-max(kv_tokens, n_ctx) // block_size) + 1  # and the scratch block
        self.pool = KVPool(model.config, n_blocks, block_size, model.device)
        self.blocks = BlockManager(n_blocks, block_size, prefix_cache=False)
        self.max_blocks = -(-n_ctx // block_size)

    @staticmethod
    def pool_tokens(model: DecoderModel, n_ctx: int, max_seqs: int) -> int:
        """A context per running sequence, at most DRAFT_KV_BYTES (at least one context)."""
        dtype = torch.float32 if model.device.type == "cpu" else torch.float16
        per = bytes_per_token(model.config, dtype)
        return max(n_ctx, min(n_ctx * max_seqs, DRAFT_KV_BYTES // per))

    def propose(self, seq: Sequence, k: int) -> list[int]:
        st = seq.spec.drafter
        if st is None:
            st = seq.spec.drafter = DraftCache()
        tokens = seq.tokens
        n_tok = len(tokens)
        n = min(st.agreed, n_tok - 1)  # tokens never change: only drafts fed after them may differ
        top = min(len(st.fed), n_tok - 1)  # the last token is fed below in any case
        while n < top and st.fed[n] == tokens[n]:
            n += 1
        del st.fed[n:]
        need = n_tok + k - 1  # the sequence's tokens and every draft but the last
        if self.blocks.blocks_to_grow(st.table, need) > self.blocks.n_free:
            return []
        self.blocks.grow(st.table, need)
        with torch.inference_mode():
            while n < n_tok:  # catch up (the whole prompt at a sequence's first proposal)
                c = min(DRAFT_CHUNK, n_tok - n)
                logits = self._step(st.table, tokens[n : n + c], n)
                n += c
            st.fed.extend(tokens[len(st.fed) :])
            st.agreed = n_tok
            drafts = [int(torch.argmax(logits))]
            for i in range(k - 1):
                logits = self._step(st.table, drafts[-1:], n_tok + i)
                drafts.append(int(torch.argmax(logits)))
        st.fed.extend(drafts[:-1])
        return drafts

    def release(self, seq: Sequence) -> None:
        st = seq.spec.drafter if seq.spec is not None else None
        if isinstance(st, DraftCache):
            self.blocks.free(st.table)
            seq.spec.drafter = None

    def _step(self, table: list[int], tokens: list[int], start: int) -> torch.Tensor:
        """The draft model on ``tokens`` at positions ``start``...: the logits [V] after the last."""
        dev = self.model.device
        n, bs = len(tokens), self.block_size
        pos = np.arange(start, start + n, dtype=np.int64)
        slots = np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs
        tables = np.zeros((1, self.max_blocks), dtype=np.int32)
        tables[0, : len(table)] = table

        def put(a) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(dev)

        i32 = np.int32
        layout = SeqLayout([n], [start], 1 if n == 1 else 0, put(slots), put(tables),
                           put(np.asarray([start], i32)), put(np.asarray([0, n], i32)))
        batch = Batch(put(np.asarray(tokens, np.int64)), put(pos), self.pool, layout,
                      put(np.asarray([n - 1], np.int64)))
        return self.model.step(batch)[0]


def make_drafter(cfg: SpecConfig, model: DecoderModel, n_ctx: int, max_seqs: int) -> Drafter:
    """The drafter of ``cfg`` for the target ``model`` (a draft model loads here, on its
    device; its vocabulary size must be the target's)."""
    if cfg.method == "ngram":
        return NgramDrafter(cfg.ngram_min, cfg.ngram_max)
    if cfg.method == "draft":
        from deimos.gguf import GGUFFile
        from deimos.models import load_model

        draft = load_model(GGUFFile(cfg.draft_model), device=str(model.device))
        if draft.config.n_vocab != model.config.n_vocab:
            raise ValueError(f"the draft model {cfg.draft_model} has {draft.config.n_vocab} "
                             f"tokens, the model {model.config.n_vocab}: a draft model needs "
                             "the model's vocabulary")
        return DraftModelDrafter(draft, n_ctx, DraftModelDrafter.pool_tokens(draft, n_ctx, max_seqs))
    if cfg.method == "mtp":
        from deimos.engine.mtp_draft import MTPDrafter

        return MTPDrafter(model, n_ctx, cfg.k_max)
    raise ValueError(f"speculative method {cfg.method!r} has no drafter")
