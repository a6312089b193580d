"""SentencePiece-style tokenization (llama.cpp llm_tokenizer_spm_session).

The fragment (spaces already escaped to U+2581) starts as one symbol per code point.
Adjacent pairs whose concatenation is a vocab token merge, highest token score first
(ties: leftmost). A final symbol that is not a token is split back along the merges that
built it; a single character that is not a token becomes its UTF-8 byte tokens <0xXX>.
"""

from __future__ import annotations

import heapq

from .vocab import Vocab


class SPMEncoder:
    def __init__(self, vocab: Vocab):
        assert vocab.kind == "spm"
        self.vocab = vocab

    def encode(self, text: str) -> list[int]:
        t2i = self.vocab.token_to_id
        scores = self.vocab.scores
        syms = list(text)
        n = len(syms)
        if n == 0:
            return []
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        heap: list[tuple[float, int, int, int]] = []  # (-score, left, right, merged length)
        rev_merge: dict[str, tuple[int, int]] = {}

        def push(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            s = syms[left] + syms[right]
            tid = t2i.get(s)
            if tid is None:
                return
            heapq.heappush(heap, (-scores[tid], left, right, len(s)))
            rev_merge[s] = (left, right)

        for i in range(1, n):
            push(i - 1, i)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            a, b = syms[left], syms[right]
            if not a or not b or len(a) + len(b) != size:
                continue
            syms[left] = a + b
            syms[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            push(prv[left], left)
            push(left, nxt[left])

        out: list[int] = []
        i = 0
        while i != -1:
            self._resegment(syms, i, rev_merge, out)
            i = nxt[i]
        return out

    def _resegment(self, syms: list[str], i: int, rev_merge: dict[str, tuple[int, int]], out: list[int]) -> None:
        text = syms[i]
        tid = self.vocab.token_to_id.get(text)
        if tid is not None:
            out.append(tid)
            return
        pair = rev_merge.get(text)
        if pair is None:
            out.extend(self.vocab.byte_to_token(b) for b in text.encode("utf-8"))
            return
        # as in llama.cpp, recurse on the symbols recorded for this text (by now merged)
        self._resegment(syms, pair[0], rev_merge, out)
        self._resegment(syms, pair[1], rev_merge, out)
