"""Continuous batching: which sequences run at the next step, and how many tokens each.

Every step (``schedule``):
1. every running sequence that is decoding gets its one token, oldest first; when the pool has
   no block for a sequence's next position, the newest running sequence is preempted (its
   blocks dropped, back to the front of the queue, recomputed later: never failed);
2. with speculative decoding (deimos.engine.speculate), a decoding sequence the engine has
   drafts for verifies them in the same step: its last token and its drafts (``propose(seq,
   room)``: at most ``room``), as many as the step's budget and the free blocks hold after
   every decode has its token; drafts never preempt anything;
3. running sequences still prefilling get the next chunk of their prompt, within what is left
   of the step's token budget (``max_batch_tokens``), so a long prompt is prefilled over many
   steps while the other streams keep decoding;
4. waiting sequences are admitted in arrival order while the budget, ``max_seqs`` and the
   pool allow: the prefix cache is matched first (deimos.engine.block_manager), and only the
   rest of the prompt is prefilled.

A hybrid model's prefix cache needs the recurrent state at a block boundary: a chunk crossing
one gets a snapshot row there (``StepPlan.snap_at``: the step stores the state after those
rows as well), at most ``step_snapshots`` a step; past them the chunk ends on its last
boundary instead (the rest is the next step's).

The scheduler sees blocks and token counts only, never tensors. A plan lists the decode
sequences first, then the verifications, then the prefill chunks: the order the step packs
them in.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from deimos.engine.block_manager import BlockManager
from deimos.engine.sequence import SeqStatus, Sequence


@dataclass(frozen=True)
class SchedulerConfig:
    max_seqs: int = 64  # sequences running at once (the largest decode batch)
    max_batch_tokens: int = 2048  # tokens a step computes, decodes and prefill chunks together

    def __post_init__(self) -> None:
        if self.max_seqs < 1:
            raise ValueError(f"max_seqs must be >= 1, got {self.max_seqs}")
        if self.max_batch_tokens < self.max_seqs:
            raise ValueError(f"max_batch_tokens ({self.max_batch_tokens}) must be >= max_seqs "
                             f"({self.max_seqs}): every running sequence decodes at each step")


@dataclass
class StepPlan:
    decode: list[Sequence] = field(default_factory=list)
    verify: list[tuple[Sequence, list[int]]] = field(default_factory=list)  # (sequence, drafts)
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, chunk tokens)
    preempted: list[Sequence] = field(default_factory=list)
    # a prefill chunk's snapshot row: its state after that many of its tokens is kept too
    snap_at: dict[Sequence, int] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.verify and not self.prefill

    @property
    def n_tokens(self) -> int:
        return (len(self.decode) + sum(1 + len(d) for _, d in self.verify)
                + sum(n for _, n in self.prefill))


class Scheduler:
    def __init__(self, blocks: BlockManager, cfg: SchedulerConfig,
                 propose: Callable[[Sequence, int], list[int]] | None = None,
                 step_snapshots: int = 0) -> None:
        """``propose(seq, room)``: at most ``room`` drafts of a decoding sequence's next tokens
        (speculative decoding; None: off). ``step_snapshots``: how many prefill chunks of a
        step can snapshot a hybrid model's state inside them (the model runner's capacity)."""
        self.blocks = blocks
        self.cfg = cfg
        self.propose = propose
        self.step_snapshots = step_snapshots
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """``seq`` is done (or cancelled): its blocks go back, it leaves every queue."""
        self.blocks.free(seq.table)
        seq.status = SeqStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _chunk(self, seq: Sequence, start: int, remaining: int, budget: int, plan: StepPlan) -> int:
        """Tokens of ``seq``'s prompt to prefill now from position ``start``: all that is left
        within the budget. For a hybrid model the recurrent state is kept at the last block
        boundary the chunk crosses (a later prompt sharing the prefix starts from it): a
        snapshot row there (``plan.snap_at``) while the step has room for one, else the chunk
        ends on that boundary."""
        n = min(remaining, budget)
        if self.blocks.needs_state and self.blocks.prefix_cache:
            bs = self.blocks.block_size
            aligned = (start + n) // bs * bs - start
            if 0 < aligned < n:
                if len(plan.snap_at) < self.step_snapshots:
                    plan.snap_at[seq] = aligned
                else:
                    n = aligned
        return n

    def preempt(self, seq: Sequence) -> None:
        """Running ``seq`` back to the front of the queue, its blocks dropped, to be recomputed
        from its cached prefix when it is admitted again (never failed)."""
        self.blocks.free(seq.table)
        seq.n_computed = 0
        seq.n_sealed = 0
        seq.status = SeqStatus.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.preempt(seq)
        plan.preempted.append(seq)

    def _drafts(self, plan: StepPlan, budget: int) -> int:
        """Move the decodes that get drafts to ``plan.verify``; returns the budget left."""
        bs = self.blocks.block_size
        plain = []
        for seq in plan.decode:
            # positions the table and the free blocks hold past the sequence's last token
            room = min(budget, (len(seq.table) + self.blocks.n_free) * bs - len(seq.tokens))
            drafts = self.propose(seq, room)[:room] if room > 0 else []
            if drafts:
                self.blocks.grow(seq.table, len(seq.tokens) + len(drafts))
                plan.verify.append((seq, drafts))
                budget -= len(drafts)
            else:
                plain.append(seq)
        plan.decode = plain
        return budget

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.cfg.max_batch_tokens
        scheduled: set[int] = set()
        # 1. decodes, oldest first; preempt the newest when a next position has no block
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING or not seq.decoding:
                continue
            need = self.blocks.blocks_to_grow(seq.table, len(seq.tokens))
            while need > self.blocks.n_free:
                victim = next((s for s in reversed(self.running) if id(s) not in scheduled), None)
                if victim is None:
                    break
                self._preempt(victim, plan)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING or need > self.blocks.n_free:
                continue
            self.blocks.grow(seq.table, len(seq.tokens))
            plan.decode.append(seq)
            scheduled.add(id(seq))
            budget -= 1
        # 2. drafts to verify, within what the budget and the free blocks leave
        if self.propose is not None and plan.decode:
            budget = self._drafts(plan, budget)
        # 3. running prefills continue
        for seq in self.running:
            if id(seq) in scheduled or budget <= 0:
                continue
            n = self._chunk(seq, seq.n_computed, seq.remaining, budget, plan)
            if self.blocks.blocks_to_grow(seq.table, seq.n_computed + n) > self.blocks.n_free:
                plan.snap_at.pop(seq, None)
                continue  # waits for blocks (decodes free them as they finish)
            self.blocks.grow(seq.table, seq.n_computed + n)
            plan.prefill.append((seq, n))
            scheduled.add(id(seq))
            budget -= n
        # 4. admissions, in arrival order (a preempted sequence is at the front)
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_seqs:
            seq = self.waiting[0]
            # the prompt's chain keys are computed once (seq.keys), not at each step it waits
            blocks = self.blocks.match(seq.tokens, seq.keys, seq.packed)
            hit = len(blocks) * self.blocks.block_size
            n = self._chunk(seq, hit, len(seq.tokens) - hit, budget, plan)
            if not self.blocks.can_allocate(hit + n, blocks):
                plan.snap_at.pop(seq, None)
                break
            seq.table, cached = self.blocks.allocate(seq.tokens, hit + n, blocks)
            seq.n_computed = cached
            seq.n_sealed = cached // self.blocks.block_size
            if self.blocks.needs_state:  # the recurrent state from the cached prefix's snapshot
                seq.state = self.blocks.state_at(seq.table[seq.n_sealed - 1]).clone() if cached else None
                seq.snap_block, seq.snap_pos = None, 0
            if not seq.admitted:
                seq.request.cached_tokens = cached
                seq.admitted = True
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            if seq.decoding:  # everything but the last token was cached (a resumed sequence)
                plan.decode.append(seq)
                budget -= 1
            else:
                plan.prefill.append((seq, n))
                budget -= n
            scheduled.add(id(seq))
        return plan
