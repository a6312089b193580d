"""A bounded memo of long texts' token ids, so that a chat's earlier messages, sent again with
every turn, are not tokenized again: an agent session's 30k-token prompt took 120 ms of the
server's time to first token on the H200 host (pure-Python BPE), nearly all of it in messages
the previous turn had already tokenized.

Exact: a text's ids depend only on the text and the two flags (the tokenizer is a pure
function), so a hit returns what ``encode`` would. Least recently used entries go first once
the cached texts pass ``max_chars`` or their number ``max_entries``; texts shorter than
``min_chars`` are not kept (they cost less to tokenize than to look up and store). The
template's text between two messages (``<|im_end|>\n<|im_start|>user\n`` and the like) is
short but comes back every turn, and a short text is not cheap to tokenize (every special
token of the vocabulary is looked for in it): kept from 64 characters, a 39-turn agent
session's tokenization took 215 -> 117 ms on a 2-core CPU. Safe to share between threads.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable

Key = tuple[str, bool, bool]


class EncodeCache:
    def __init__(self, max_chars: int = 8_000_000, min_chars: int = 64, max_entries: int = 65_536):
        if max_chars < 0 or min_chars < 1 or max_entries < 0:
            raise ValueError(f"EncodeCache: max_chars {max_chars} and max_entries {max_entries} "
                             f"must be >= 0 and min_chars {min_chars} >= 1")
        self.max_chars = max_chars
        self.min_chars = min_chars
        self.max_entries = max_entries
        self._entries: OrderedDict[Key, array] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def chars(self) -> int:
        """The characters of the texts held."""
        return self._chars

    def get(self, key: Key, encode: Callable[[], list[int]]) -> list[int]:
        """``key``'s ids from the cache, else ``encode()``'s (kept when the text is long
        enough); a new list either way, the caller may change it."""
        text = key[0]
        if len(text) < self.min_chars or len(text) > self.max_chars:
            return encode()
        with self._lock:
            ids = self._entries.get(key)
            if ids is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return ids.tolist()
            self.misses += 1
        out = encode()
        packed = array("q", out)
        with self._lock:
            if key not in self._entries:
                self._entries[key] = packed
                self._chars += len(text)
                while self._chars > self.max_chars or len(self._entries) > self.max_entries:
                    (old, _, _), _ = self._entries.popitem(last=False)
                    self._chars -= len(old)
        return out
