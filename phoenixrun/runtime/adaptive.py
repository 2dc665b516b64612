"""Adaptive protection: how often to snapshot so that the exposed stall stays under a bound.

The D2H copy must finish before the next optimizer step (it reads live tensors); the H2H
replication reads the agent's shared-memory slot, so with a snapshot every n steps it may run
on through n-1 more steps. The PHOENIX paper protects every step; when replication cannot hide
behind one compute window, snapshotting every n-th step trades replay (up to n steps) for
overhead. Pure function: every rank feeds it its figures and the job takes the max (allreduce).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Sample:
    d2h_s: float       # local snapshot copy
    h2h_s: float       # replication to the holders, until committed
    window_s: float    # compute between snapshot submit and the next optimizer step
    step_s: float      # a whole iteration


def choose_interval(samples: list[Sample], bound: float = 0.02, max_every: int = 16) -> int:
    """Smallest n whose expected exposed stall is <= bound x step time."""
    if not samples:
        return 1
    d2h = statistics.median(s.d2h_s for s in samples)
    h2h = statistics.median(s.h2h_s for s in samples)
    window = statistics.median(s.window_s for s in samples)
    step = max(1e-9, statistics.median(s.step_s for s in samples))
    budget = bound * step - max(0.0, d2h - window)       # D2H beyond the window cannot be hidden by any n
    overflow = d2h + h2h - window - max(0.0, budget)      # replication left over after one window
    if overflow <= 0:
        return 1
    return min(max_every, 1 + math.ceil(overflow / step))
