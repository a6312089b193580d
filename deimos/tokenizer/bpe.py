"""Byte-level BPE (llama.cpp llm_tokenizer_bpe_session).

A text fragment is split into words by the vocab's pre-tokenizer; each word (GPT-2
byte-encoded, or raw UTF-8 for SPM-style BPE like Gemma 4) starts as one symbol per code
point, and adjacent symbols merge lowest merge-rank first (ties: leftmost), until no
adjacent pair has a rank.
"""

from __future__ import annotations

import heapq

from .unicode import RegexSplitter, byte_encode
from .vocab import Vocab

_WORD_CACHE_MAX = 1 << 16


class BPEEncoder:
    def __init__(self, vocab: Vocab):
        assert vocab.kind == "bpe" and vocab.pre is not None
        self.vocab = vocab
        self.pre = vocab.pre
        self.splitter = RegexSplitter(vocab.pre.regexes)
        self.ranks = vocab.bpe_ranks
        self._cache: dict[str, tuple[int, ...]] = {}

    def encode(self, text: str) -> list[int]:
        """Token ids of a text fragment that holds no special tokens."""
        if self.pre.escape_whitespaces:
            text = text.replace(" ", "\u2581")
        out: list[int] = []
        cache = self._cache
        for word in self.splitter.split(text):
            ids = cache.get(word)
            if ids is None:
                ids = self._encode_word(word)
                if len(cache) >= _WORD_CACHE_MAX:
                    cache.clear()
                cache[word] = ids
            out.extend(ids)
        return out

    def _encode_word(self, word: str) -> tuple[int, ...]:
        vocab = self.vocab
        if self.pre.byte_encode:
            word = byte_encode(word)
        t2i = vocab.token_to_id
        if self.pre.ignore_merges and word in t2i:
            return (t2i[word],)
        if self.pre.name == "gemma4" and word.strip("\n") == "" and word in t2i:
            return (t2i[word],)  # a run of newlines that is one token (llama.cpp PR 21343)
        ids: list[int] = []
        for sym in self._merge(word):
            tid = t2i.get(sym)
            if tid is not None:
                ids.append(tid)
                continue
            # no token for the symbol: fall back to its bytes, dropping those without one
            for b in sym.encode("utf-8"):
                if self.pre.byte_encode:
                    tid = t2i.get(chr(b)) if b < 0x80 else None
                else:
                    tid = t2i.get(f"<0x{b:02X}>")
                if tid is not None:
                    ids.append(tid)
        return tuple(ids)

    def _merge(self, word: str) -> list[str]:
        syms = list(word)
        n = len(syms)
        if n < 2:
            return syms
        ranks = self.ranks
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        heap: list[tuple[int, int, int, str]] = []  # (rank, left, right, merged text)

        def push(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            r = ranks.get(syms[left] + " " + syms[right])
            if r is not None:
                heap.append((r, left, right, syms[left] + syms[right]))

        for i in range(n - 1):
            push(i, i + 1)
        heapq.heapify(heap)
        while heap:
            _, left, right, text = heapq.heappop(heap)
            a, b = syms[left], syms[right]
            # stale entry: one side was merged away or changed since it was pushed
            if not a or not b or a + b != text:
                continue
            syms[left] = text
            syms[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            for l2, r2 in ((prv[left], left), (left, nxt[left])):
                if l2 >= 0 and r2 >= 0:
                    r = ranks.get(syms[l2] + " " + syms[r2])
                    if r is not None:
                        heapq.heappush(heap, (r, l2, r2, syms[l2] + syms[r2]))
        return [s for s in syms if s]
