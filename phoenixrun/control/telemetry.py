"""What the master measures of a running job, for status and the straggler detector: throughput samples, each
node's newest snapshot step, each node's compute per step. Nothing here decides a recovery.

Called with JobState.cv held (control/jobstate.py), like the rest of the master's data.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable, Iterable

from phoenixrun.control.decide import STRAGGLER_WINDOWS, stragglers
from phoenixrun.control.state import NodeRecord


class Telemetry:
    def __init__(self) -> None:
        self.progress: list[tuple[float, int]] = []
        self.progress_at = 0.0
        self.node_step: dict[str, int | None] = {}   # node id -> its ranks' oldest newest snapshot
        # stragglers: node id -> its slowest rank's compute per step (one sample per committed step), newest last
        self.compute: dict[str, deque[float]] = {}
        self.compute_step: dict[str, int] = {}
        self.compute_generation = 0
        self.stragglers_at = 0.0
        self.stragglers_every = 0.5     # seconds between straggler decisions (new_stragglers: grows with the job)

    def note_compute(self, node: NodeRecord, generation: int, window: int) -> None:
        """One straggler sample per committed step of a node: its slowest rank's compute (from its heartbeat);
        `window`: --straggler-window."""
        vals = [p.compute_s for p in node.protection.values() if p.compute_s is not None]
        step = max((p.committed_step for p in node.protection.values() if p.committed_step is not None), default=None)
        if not vals or step is None or self.compute_step.get(node.node_id) == step:
            return
        if self.compute_generation != generation:
            # a recovery disturbed every node's steps, and a promoted spare's first ones are slow (measured: a
            # spare just drained to flagged at 2.55x its peers at load 31): every window starts again
            self.compute_generation = generation
            self.compute.clear()
            self.compute_step.clear()
        first = node.node_id not in self.compute_step
        self.compute_step[node.node_id] = step
        if first:
            return        # the first step seen: warming up, or measured across the recovery
        self.compute.setdefault(node.node_id, deque(maxlen=window * STRAGGLER_WINDOWS)).append(max(vals))

    def new_stragglers(self, list_actives: Callable[[], list[NodeRecord]], running: bool, ratio: float,
                       window: int) -> list[NodeRecord]:
        """Of the active nodes, those that just became stragglers (decide.stragglers; each node's `straggler`
        kept up to date). O(nodes): at most twice a second, and only while the job runs - the active nodes are
        listed only then (called per heartbeat, listing them first was O(nodes) a heartbeat: issue 32's 4K runs
        spent 46% of the master's samples there and registered 3,477 of 4,097 agents in 107 s)."""
        now = time.time()
        if now - self.stragglers_at < self.stragglers_every or not running:
            return []
        self.stragglers_at = now
        actives = list_actives()
        # the decision costs ~18 us a node (measured: 0.072 s at 4,096 nodes with the default window's 60 samples
        # each): looked at less often as the job grows, so that it stays ~2% of a core - a straggler is judged over
        # 3 windows of steps anyway (60 by default)
        self.stragglers_every = max(0.5, len(actives) / 1024)
        found = stragglers({n.slot: list(self.compute.get(n.node_id, ())) for n in actives if n.slot is not None},
                           ratio, window)
        newly = []
        for n in actives:
            r = found.get(n.slot) if n.slot is not None else None
            if r is not None and n.straggler is None:
                newly.append(n)
            n.straggler = r
        return newly

    def note_progress(self, node_ids: Iterable[str]) -> None:
        """Throughput samples for status, from the nodes holding slots: O(nodes), so at most twice a second, not
        per heartbeat - `node_ids` is walked only then (a list built per heartbeat before the rate limit was 28% of
        the master's samples while 16K agents heartbeated, issue 32)."""
        now = time.time()
        if now - self.progress_at < 0.5:
            return
        self.progress_at = now
        steps = [s for s in map(self.node_step.get, node_ids) if s is not None]
        if steps:
            self.progress.append((now, min(steps)))
            self.progress = self.progress[-50:]

    def steps_per_s(self) -> float | None:
        pts = [p for p in self.progress if p[0] > time.time() - 10]
        if len(pts) < 2 or pts[-1][0] <= pts[0][0]:
            return None
        return round(max(0, pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0]), 3)
