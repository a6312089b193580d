"""One sequence's state in the engine: its tokens, its block table, how much of it the cache
holds, and the request it serves (sampler, outputs, finish reason).

``tokens`` is the prompt followed by every output so far; the cache holds the keys and values
of ``tokens[:n_computed]``. A sequence that is decoding has exactly one token not yet computed:
its last output, fed at the next step. Preemption drops the blocks and the count; the next
admission recomputes (mostly from the prefix cache) and carries on from the same tokens.
Drafts (speculative decoding) are never in ``tokens``: an accepted one is appended as an output,
and n_computed moves past it only then.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deimos.engine.request import Request

if TYPE_CHECKING:
    from deimos.engine.speculate import SpecState


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    id: int
    request: Request
    tokens: list[int]
    status: SeqStatus = SeqStatus.WAITING
    table: list[int] = field(default_factory=list)
    n_computed: int = 0  # tokens whose keys and values are in the cache
    n_sealed: int = 0  # leading full blocks registered in the prefix cache
    admitted: bool = False  # admitted once (the prompt's cache hits are counted then)
    state: object | None = None  # a hybrid's recurrent state: RecurrentState, or a SlotState in the engine's state pool
    snap_block: int | None = None  # the block holding this sequence's latest state snapshot
    snap_pos: int = 0  # the position of that snapshot (within the prompt: kept for others)
    spec: SpecState | None = None  # speculative decoding's state (None: it decodes plainly)
    # the prefix cache's chain keys of its leading full blocks, as far as known (tokens only
    # grow, so they never change): admission and sealing hash each block once
    keys: list[bytes] = field(default_factory=list)
    packed: bytes | None = None  # the prompt's ids packed (block_manager.pack_tokens), or None

    @property
    def n_prompt(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def remaining(self) -> int:
        """Tokens not yet in the cache (1 while decoding)."""
        return len(self.tokens) - self.n_computed

    @property
    def decoding(self) -> bool:
        return self.remaining == 1 and self.n_computed >= self.n_prompt

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
