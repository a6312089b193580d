"""The device's share of an offloaded decode step's missed experts, tuned while it runs.

A captured MoE layer splits its missed experts between the CPU (ggml on the host copy) and the
device reading the same pinned host copy over PCIe (deimos.models.gpu.offload). Both sides read
the host's memory at once, so each slows the other, and what the CPU does besides (Python
around ggml, the host's spinning on the mailbox) counts too: the split measured at load with
each side alone (``ExpertOffload.calibrate``) is a starting point, not the answer (measured on
the H200's host: calibrated 0.56, the CPU then the step's slower side).

``ShareTuner.observe(seconds, misses)`` after each step: the steps' time per missed expert,
the median over a window of steps (one slow step, a collection pause or a step that also
promoted more experts, moves a window's mean but not its median: in a simulation of 390 steps
with 3-5% such steps, the mean's hill climb ended up to 0.23 from the best share, stuck near
where it started, the median's within 0.03-0.1), compared between the current share and a
trial share beside it (windows alternate: centre, trial, centre, ...; a centre measured next
to each trial, so a
drift of the hit rate or the machine's load affects both alike). A trial that is faster by
more than ``min_gain`` becomes the centre and the search goes on that way; after a slower trial
the other side is tried, and after both sides were slower the step halves, down to
``min_step``, where it stays probing (a machine whose load changes moves the optimum).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class TunerConfig:
    window: int = 6  # steps with misses a measurement
    step: float = 0.1  # the first trial's distance from the centre
    min_step: float = 0.025
    min_gain: float = 0.02  # a trial must be this much faster (relative) to move the centre


class ShareTuner:
    """Hill climbing on the measured time per missed expert (module docstring)."""

    def __init__(self, share: float, config: TunerConfig = TunerConfig()):
        if config.window < 1 or not 0 < config.min_step <= config.step or config.min_gain < 0:
            raise ValueError(f"ShareTuner: bad config {config}")
        self.config = config
        self.centre = min(1.0, max(0.0, float(share)))
        self.step = config.step
        self.direction = 1.0
        self.failed = 0  # slower trials in a row at this step size
        self.trying = False  # measuring the trial (else the centre)
        self.centre_cost: float | None = None
        self._costs: list[float] = []  # the window's seconds per miss, a step each
        self.moves = 0

    @property
    def share(self) -> float:
        """The share the next step runs with."""
        return self.trial if self.trying else self.centre

    @property
    def trial(self) -> float:
        t = self.centre + self.direction * self.step
        if not 0.0 <= t <= 1.0:  # at an edge: the other side
            t = self.centre - self.direction * self.step
        return min(1.0, max(0.0, t))

    def observe(self, seconds: float, misses: int) -> float:
        """A finished step: its seconds and its missed experts (both sides'). Returns the share
        for the next step. Steps without misses say nothing about the split: not counted."""
        if misses <= 0 or seconds <= 0:
            return self.share
        self._costs.append(seconds / misses)
        if len(self._costs) < self.config.window:
            return self.share
        cost = statistics.median(self._costs)
        self._costs = []
        if not self.trying:
            self.centre_cost = cost
            self.trying = True
            return self.share
        self.trying = False
        if cost < self.centre_cost * (1 - self.config.min_gain):
            self.centre = self.trial  # keep going this way
            self.failed = 0
            self.moves += 1
        else:  # the other side next (at an edge both trials are the same: the step halves)
            self.direction = -self.direction
            self.failed += 1
            if self.failed >= 2:
                self.step = max(self.config.min_step, self.step / 2)
                self.failed = 0
        return self.share
