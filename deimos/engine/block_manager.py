"""KV blocks: who holds which, and the prefix cache that lets sequences share full blocks.

The pool's blocks (deimos.runtime.kv_pool; block 0 is scratch, never handed out) are in one of
three states:
- held: referenced by one or more sequences' block tables (``ref > 0``);
- cached: no sequence holds it, but it is a *full* block whose contents are known: its key is
  a hash chained over the whole token prefix up to its end, so equal keys mean equal prefixes
  (the tokens are compared too, so a hash collision cannot alias). Kept for reuse, evicted
  least recently used first when a free block is needed;
- free: nothing worth keeping.

A sequence's prompt is matched block by block against the cache (``allocate``): every leading
full block found is shared (its reference count grows) and its tokens need no prefill. A block
becomes cacheable once every token in it has been computed (``seal``), prompt or output alike,
so an agent's next turn (the whole conversation again) finds the last answer's blocks too.
The last prompt token is always recomputed (its logits are needed), so a match stops one token
short of the prompt's end.

The scheduler sees only block counts; nothing here touches tensors.
"""

from __future__ import annotations

import hashlib
import operator
import struct
import sys
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass

from deimos.runtime.kv_pool import SCRATCH_BLOCK


class OutOfBlocks(RuntimeError):
    """No free or evictable block is left (the scheduler preempts before this happens)."""


@dataclass(slots=True)
class _Sealed:
    key: bytes
    tokens: bytes  # the block's token ids, packed (``pack_tokens``)
    state: object | None = None  # a hybrid model's recurrent state after this block's last token
    state_shared: bool = False  # another sequence started from it: kept when its maker moves on
    # the chain keys of the sequence that sealed it (its ``keys``: entry i is its block i's,
    # this one among them): where a later prompt continues the same sequence, ``match``
    # finds its next blocks' keys here and checks their tokens instead of hashing them
    chain: list[bytes] | None = None
    # the block that ``_by_key`` names for its key (the copy of these contents that match()
    # finds), fixed when it is sealed: free() reads it instead of looking the key up
    canonical: bool = False


def chain_key(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    """The cache key of a full block: a hash of the parent block's key and this block's tokens."""
    return _key(parent, struct.pack("<I", len(tokens)), pack_tokens(tokens))


def _key(parent: bytes, header: bytes, packed: bytes) -> bytes:
    """``chain_key`` of a block given as its header (``<I`` its length) and its packed tokens."""
    return hashlib.blake2b(parent + header + packed, digest_size=16).digest()


_U32 = next(t for t in "IL" if array(t).itemsize == 4)  # array's 4-byte unsigned type


def pack_tokens(tokens) -> bytes:
    """Token ids as little-endian uint32 bytes, what the chain keys hash: one C loop over the
    list (a 20k-token prompt in ~0.1 ms, against ~1 us a block for a tuple and a struct.pack).
    Raises OverflowError for an id outside [0, 2**32), TypeError for one that is not an
    integer (a float or a string is not truncated or parsed)."""
    try:
        a = array(_U32, tokens)
    except TypeError:  # ids that are not Python ints: numpy integers pass, floats do not
        a = array(_U32, map(operator.index, tokens))
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


class BlockManager:
    def __init__(self, n_blocks: int, block_size: int, prefix_cache: bool = True,
                 needs_state: bool = False, max_states: int = 64) -> None:
        """``needs_state``: a hybrid model's cache: a prefix is reusable only up to a block that
        holds a snapshot of the recurrent state there (``attach_state``); a recurrent state
        cannot start anywhere else. At most ``max_states`` snapshots are kept (the least
        recently attached or used dropped first): a snapshot is a whole recurrent state (tens
        of MB for a 4B model), not a block's worth."""
        if n_blocks < 2:
            raise ValueError(f"BlockManager: needs at least 2 blocks, got {n_blocks}")
        self.block_size = block_size
        self.n_blocks = n_blocks
        self.prefix_cache = prefix_cache
        self.needs_state = needs_state
        self.max_states = max(1, max_states)
        self._states: OrderedDict[int, None] = OrderedDict()  # blocks holding a snapshot, oldest first
        self._ref = [0] * n_blocks
        self._sealed: list[_Sealed | None] = [None] * n_blocks
        self._by_key: dict[bytes, int] = {}
        self._free: deque[int] = deque(b for b in range(n_blocks) if b != SCRATCH_BLOCK)
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks, oldest first
        # statistics (the server's /metrics)
        self.hit_tokens = 0
        self.query_tokens = 0

    # ---- counts -------------------------------------------------------------------------

    @property
    def usable(self) -> int:
        return self.n_blocks - 1

    @property
    def n_free(self) -> int:
        """Blocks that can be handed out now (free, or cached and evictable)."""
        return len(self._free) + len(self._lru)

    @property
    def n_used(self) -> int:
        return self.usable - self.n_free

    @property
    def n_cached(self) -> int:
        return len(self._lru)

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    # ---- allocation ---------------------------------------------------------------------

    def _take(self) -> int:
        if self._free:
            b = self._free.popleft()
        elif self._lru:
            b, _ = self._lru.popitem(last=False)
            sealed = self._sealed[b]
            if sealed is not None and sealed.canonical:
                del self._by_key[sealed.key]
            self._sealed[b] = None
            self._states.pop(b, None)
        else:
            raise OutOfBlocks("no free KV block")
        self._ref[b] = 1
        return b

    def match(self, tokens: list[int], keys: list[bytes] | None = None,
              packed: bytes | None = None) -> list[int]:
        """The cached blocks that hold a leading part of ``tokens`` (at most all but its last
        token), in order; nothing is held yet. With ``needs_state``: up to the last of them
        that holds a state snapshot. ``keys``: the chain keys of ``tokens``' leading full
        blocks known so far (a sequence's memo: its tokens only grow), extended with the ones
        computed here (every block looked at past it, the first one not found included);
        ``packed``: ``pack_tokens`` of a leading part of ``tokens`` (the prompt), used where
        it reaches.

        A block's key comes from the memo, else from the chain of the sequence that sealed
        the previous block, else is hashed; the block under it must hold the same tokens.
        Keys already known (the memo's, a chain's) are checked a span at a time (``_run``):
        an agent's next turn re-sends the whole conversation, 20k tokens = 1,250 blocks, and
        a Python step per block lands on its time to first token."""
        if not self.prefix_cache:
            return []
        bs = self.block_size
        n = (len(tokens) - 1) // bs
        if n <= 0:
            return []
        w = 4 * bs
        if packed is None or len(packed) < n * w:
            packed = pack_tokens(tokens[: n * bs])
        if keys is None:
            keys = []
        by_key, sealed_of = self._by_key, self._sealed
        out: list[int] = []
        parent = b""
        s = None  # the last matched block's _Sealed
        i = min(len(keys), n)
        if i:  # the memo's keys: a miss or other tokens there ends the match
            out = self._run(keys, 0, i, packed, w)
            if len(out) < i:
                return self._usable(out)
            s, parent = sealed_of[out[-1]], keys[i - 1]
        # past the memo (i == len(keys) from here on): every key looked at joins it
        key_of, header = _key, struct.pack("<I", bs)
        failed = None  # the chain whose run just ended at block i (it would end there again)
        while i < n:
            # the keys the sequence that sealed the last block gave its next blocks: where the
            # blocks under them hold these tokens, they are these blocks' keys too (the same
            # parent key and the same tokens), and no hash is needed. The chain is followed
            # as far as it holds, whoever sealed the blocks on the way: a key is the hash of
            # the whole prefix, so any chain that reaches a block gives it the same key
            chain = s.chain if s is not None else None
            if (chain is not None and chain is not failed and len(chain) > i
                    and chain[i - 1] == parent):  # fmt: skip
                got = self._run(chain, i, min(n, len(chain)), packed, w)
                failed = chain
                if got:
                    out += got
                    keys += chain[i : i + len(got)]
                    i += len(got)
                    s, parent = sealed_of[got[-1]], keys[-1]
                    continue  # the next block: on the last one's chain if it goes on, or hashed
            block = packed[i * w : (i + 1) * w]
            key = key_of(parent, header, block)
            keys.append(key)
            b = by_key.get(key)
            if b is None:
                break
            s = sealed_of[b]
            if s is None or s.tokens != block:
                break
            out.append(b)
            parent = key
            i += 1
            failed = None
        return self._usable(out)

    def _run(self, ks: list[bytes], i: int, stop: int, packed: bytes, w: int) -> list[int]:
        """The blocks under keys ``ks[i:stop]`` (of blocks i.. of ``packed``, ``w`` bytes
        each), as long as each is cached and holds its block's tokens.

        Spans of blocks are checked at once (``_span``), not a Python step per block. They
        grow from 32 blocks, doubling; a span that fails is halved down to its first bad
        block (the good half kept each time), so a run costs about twice its length in C
        loops wherever it ends, and a few lookups where its first block is bad."""
        out: list[int] = []
        step = 32
        while i < stop:
            j = min(stop, i + step)
            span = self._span(ks, i, j, packed, w)
            if span is None:  # a bad block in [i, j), every one before i good
                if self._span(ks, i, i + 1, packed, w) is None:
                    return out  # block i itself (mostly where a chain just entered ends)
                while j - i > 1:
                    h = (i + j) // 2
                    span = self._span(ks, i, h, packed, w)
                    if span is None:
                        j = h
                    else:
                        out += span
                        i = h
                return out
            out += span
            i = j
            step *= 2
        return out

    def _span(self, ks: list[bytes], i: int, j: int, packed: bytes, w: int) -> list[int] | None:
        """The blocks under keys ``ks[i:j]`` if every one is cached and holds its block's
        tokens, else None: C loops (the lookups, then one ``bytes`` comparison of their
        joined tokens: a sealed block's tokens are ``w`` bytes, so equal joins mean equal
        blocks)."""
        sealed_of = self._sealed
        try:
            span = list(map(self._by_key.__getitem__, ks[i:j]))
            if b"".join([sealed_of[b].tokens for b in span]) == packed[i * w : j * w]:
                return span
        except (KeyError, AttributeError):  # a key not cached (or, never, a block not sealed)
            pass
        return None

    def _usable(self, out: list[int]) -> list[int]:
        """``out``, the blocks matched; with ``needs_state`` only up to the last of them that
        holds a state snapshot (a recurrent state can start nowhere else)."""
        if self.needs_state:
            sealed_of = self._sealed
            for k in range(len(out) - 1, -1, -1):  # the latest snapshot is mostly near the end
                if sealed_of[out[k]].state is not None:
                    return out[: k + 1]
            return []
        return out

    def state_at(self, block: int):
        """The recurrent state snapshot a cached block holds (None if none); a use keeps it."""
        sealed = self._sealed[block]
        if sealed is None or sealed.state is None:
            return None
        self._states.move_to_end(block, last=True)
        sealed.state_shared = True
        return sealed.state

    @property
    def n_states(self) -> int:
        return sum(1 for b in self._states if self._sealed[b] is not None and self._sealed[b].state is not None)

    def attach_state(self, block: int, state, previous: int | None = None) -> int:
        """Keep ``state`` (a snapshot after ``block``'s last token) with the sealed ``block``;
        the snapshot ``previous`` (the same sequence's last one) is dropped: a sequence keeps
        one, at its latest full block. Returns the block that holds it now (the cached copy
        of ``block``'s contents when another block had them first)."""
        prev = self._sealed[previous] if previous is not None and previous != block else None
        if prev is not None and not prev.state_shared:  # a snapshot others use stays (LRU-capped)
            prev.state = None
            self._states.pop(previous, None)
        sealed = self._sealed[block]
        if sealed is None:
            raise RuntimeError(f"BlockManager: block {block} is not sealed")
        canon = self._by_key.get(sealed.key, block)  # the block that match() finds
        if self._sealed[canon].state is not None:  # the same tokens' state is already kept
            return canon
        self._sealed[canon].state = state
        self._states[canon] = None
        self._states.move_to_end(canon, last=True)
        while len(self._states) > self.max_states:  # the oldest snapshots go
            old, _ = self._states.popitem(last=False)
            if self._sealed[old] is not None:
                self._sealed[old].state = None
        return canon

    def can_allocate(self, n_new_tokens: int, hit: list[int]) -> bool:
        """Whether ``allocate(tokens, n_new_tokens, hit)`` would find its blocks, ``hit``
        being ``match(tokens)`` with nothing changed since."""
        need = self.blocks_for(n_new_tokens) - len(hit)
        ref = self._ref
        evictable_hits = len(hit) - sum(map(bool, map(ref.__getitem__, hit)))
        return need <= self.n_free - evictable_hits

    def allocate(self, tokens: list[int], n_new_tokens: int, hit: list[int] | None = None
                 ) -> tuple[list[int], int]:
        """Blocks for the first ``n_new_tokens`` positions of a sequence of ``tokens``: the
        prefix-cache hits first, then fresh blocks. Returns (table, tokens already cached).
        ``hit``: as in ``can_allocate``."""
        if hit is None:
            hit = self.match(tokens)
        ref, lru = self._ref, self._lru
        for b in hit:  # held: out of the LRU (a 20k-token hit holds 1,250 blocks: one loop)
            if not ref[b]:
                lru.pop(b, None)
            ref[b] += 1
        table = list(hit)
        try:
            while len(table) < self.blocks_for(n_new_tokens):
                table.append(self._take())
        except OutOfBlocks:
            self.free(table)
            raise
        cached = len(hit) * self.block_size
        self.query_tokens += len(tokens)
        self.hit_tokens += cached
        return table, cached

    def grow(self, table: list[int], n_tokens: int) -> None:
        """Extend ``table`` so that it covers ``n_tokens`` positions."""
        while len(table) < self.blocks_for(n_tokens):
            table.append(self._take())

    def blocks_to_grow(self, table: list[int], n_tokens: int) -> int:
        return max(0, self.blocks_for(n_tokens) - len(table))

    def seal(self, table: list[int], tokens: list[int], n_computed: int, n_sealed: int,
             keys: list[bytes] | None = None) -> int:
        """Register the full blocks among the first ``n_computed`` computed tokens (those past
        block ``n_sealed``) in the prefix cache; returns the new count of sealed blocks.
        ``keys``: the sequence's memo of its blocks' chain keys (as in ``match``)."""
        bs = self.block_size
        end = n_computed // bs
        if not self.prefix_cache or end <= n_sealed:
            return end
        w = 4 * bs
        header = struct.pack("<I", bs)
        packed = pack_tokens(tokens[n_sealed * bs : end * bs])
        parent = self._sealed[table[n_sealed - 1]].key if n_sealed else b""
        for i in range(n_sealed, end):
            b = table[i]
            block = packed[(i - n_sealed) * w : (i - n_sealed + 1) * w]
            if keys is not None and i < len(keys):
                key = keys[i]
            else:
                key = _key(parent, header, block)
                if keys is not None and i == len(keys):
                    keys.append(key)
            if self._sealed[b] is None:
                other = self._by_key.get(key)
                if other is None:  # a block with these contents already cached: keep that one
                    self._by_key[key] = b
                chain = keys if keys is not None and i < len(keys) else None
                self._sealed[b] = _Sealed(key, block, chain=chain, canonical=other is None)
            parent = self._sealed[b].key
        return end

    def free(self, table: list[int]) -> None:
        """A sequence lets go of its blocks: full sealed ones become cached, others free."""
        ref, sealed_of, lru = self._ref, self._sealed, self._lru
        for b in reversed(table):  # the deepest blocks of a prefix are evicted first
            r = ref[b] - 1
            ref[b] = r
            if r > 0:
                continue
            if r < 0:
                raise RuntimeError(f"BlockManager: block {b} freed more often than held")
            sealed = sealed_of[b]
            if sealed is not None and sealed.canonical:
                lru[b] = None  # newest; of one table the shallowest is newest
            else:
                sealed_of[b] = None
                self._states.pop(b, None)
                self._free.append(b)
        table.clear()

    def check(self) -> None:
        """Invariants (tests): every block is held, cached or free, exactly once; a sealed
        block is ``canonical`` exactly when ``_by_key`` names it."""
        free, lru = set(self._free), set(self._lru)
        assert not free & lru
        for b in range(self.n_blocks):
            if b == SCRATCH_BLOCK:
                continue
            held = self._ref[b] > 0
            sealed = self._sealed[b]
            if sealed is not None:
                assert sealed.canonical == (self._by_key.get(sealed.key) == b), f"block {b}"
            assert held + (b in free) + (b in lru) == 1, f"block {b}: ref {self._ref[b]}"
