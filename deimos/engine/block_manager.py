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
import struct
from collections import OrderedDict, deque
from dataclasses import dataclass

from deimos.runtime.kv_pool import SCRATCH_BLOCK


class OutOfBlocks(RuntimeError):
    """No free or evictable block is left (the scheduler preempts before this happens)."""


@dataclass(slots=True)
class _Sealed:
    key: bytes
    tokens: tuple[int, ...]
    state: object | None = None  # a hybrid model's recurrent state after this block's last token
    state_shared: bool = False  # another sequence started from it: kept when its maker moves on


def chain_key(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    """The cache key of a full block: a hash of the parent block's key and this block's tokens."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(struct.pack(f"<I{len(tokens)}I", len(tokens), *tokens))
    return h.digest()


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
            if sealed is not None and self._by_key.get(sealed.key) == b:
                del self._by_key[sealed.key]
            self._sealed[b] = None
            self._states.pop(b, None)
        else:
            raise OutOfBlocks("no free KV block")
        self._ref[b] = 1
        return b

    def _hold(self, b: int) -> None:
        if self._ref[b] == 0:
            self._lru.pop(b, None)
        self._ref[b] += 1

    def match(self, tokens: list[int]) -> list[int]:
        """The cached blocks that hold a leading part of ``tokens`` (at most all but its last
        token), in order; nothing is held yet. With ``needs_state``: up to the last of them
        that holds a state snapshot."""
        if not self.prefix_cache:
            return []
        bs = self.block_size
        out: list[int] = []
        parent = b""
        usable = 0
        for i in range((len(tokens) - 1) // bs):
            block = tuple(tokens[i * bs : (i + 1) * bs])
            key = chain_key(parent, block)
            b = self._by_key.get(key)
            if b is None or self._sealed[b] is None or self._sealed[b].tokens != block:
                break
            out.append(b)
            if self._sealed[b].state is not None:
                usable = len(out)
            parent = key
        return out[:usable] if self.needs_state else out

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

    def can_allocate(self, tokens: list[int], n_new_tokens: int, hit: list[int] | None = None) -> bool:
        """Whether ``allocate(tokens, n_new_tokens)`` would find its blocks. ``hit``:
        ``match(tokens)`` if the caller has it (nothing changed since: a 20k-token prompt's
        match hashes 1,250 blocks, ~1.4 ms of Python)."""
        if hit is None:
            hit = self.match(tokens)
        need = self.blocks_for(n_new_tokens) - len(hit)
        evictable_hits = sum(1 for b in hit if self._ref[b] == 0)
        return need <= self.n_free - evictable_hits

    def allocate(self, tokens: list[int], n_new_tokens: int, hit: list[int] | None = None
                 ) -> tuple[list[int], int]:
        """Blocks for the first ``n_new_tokens`` positions of a sequence of ``tokens``: the
        prefix-cache hits first, then fresh blocks. Returns (table, tokens already cached).
        ``hit``: as in ``can_allocate``."""
        if hit is None:
            hit = self.match(tokens)
        for b in hit:
            self._hold(b)
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

    def seal(self, table: list[int], tokens: list[int], n_computed: int, n_sealed: int) -> int:
        """Register the full blocks among the first ``n_computed`` computed tokens (those past
        block ``n_sealed``) in the prefix cache; returns the new count of sealed blocks."""
        if not self.prefix_cache:
            return n_computed // self.block_size
        bs = self.block_size
        parent = self._sealed[table[n_sealed - 1]].key if n_sealed else b""
        for i in range(n_sealed, n_computed // bs):
            b = table[i]
            block = tuple(tokens[i * bs : (i + 1) * bs])
            key = chain_key(parent, block)
            if self._sealed[b] is None:
                other = self._by_key.get(key)
                if other is None:  # a block with these contents already cached: keep that one
                    self._by_key[key] = b
                self._sealed[b] = _Sealed(key, block)
            parent = self._sealed[b].key
        return n_computed // bs

    def free(self, table: list[int]) -> None:
        """A sequence lets go of its blocks: full sealed ones become cached, others free."""
        for b in reversed(table):  # the deepest blocks of a prefix are evicted first
            self._ref[b] -= 1
            if self._ref[b] < 0:
                raise RuntimeError(f"BlockManager: block {b} freed more often than held")
            if self._ref[b] == 0:
                sealed = self._sealed[b]
                if sealed is not None and self._by_key.get(sealed.key) == b:
                    self._lru[b] = None  # newest; of one table the shallowest is newest
                else:
                    self._sealed[b] = None
                    self._states.pop(b, None)
                    self._free.append(b)
        table.clear()

    def check(self) -> None:
        """Invariants (tests): every block is held, cached or free, exactly once."""
        free, lru = set(self._free), set(self._lru)
        assert not free & lru
        for b in range(self.n_blocks):
            if b == SCRATCH_BLOCK:
                continue
            held = self._ref[b] > 0
            assert held + (b in free) + (b in lru) == 1, f"block {b}: ref {self._ref[b]}"
