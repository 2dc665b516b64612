"""A recovery's phases as the ranks measure them, one type from the worker to the `recovery_done` event: a worker
reports its own (runtime/recovery_client.py), its agent adds the fetch and keeps the slowest of its workers
(agents/phases.py), the master keeps the slowest of the agents' (control/cycle.py). Every field measured is one
the master records: nothing is read that no one sends, nothing sent is dropped.

On the wire (the `resumed` worker message and report) a JSON object of the fields measured; names it does not
know (a peer of another version) are ignored."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class Timings:
    """Seconds per phase; None: not measured (a survivor fetches nothing, a re-partition loads no snapshot)."""
    rebuild_s: float | None = None          # worker: its process group of the new generation
    state_s: float | None = None            # worker: model and optimizer state loaded from the node's snapshot (one call)
    reshard_s: float | None = None          # worker: the old ranks' state re-partitioned into it (shrink, grow)
    worker_recovery_s: float | None = None  # worker: from its restore to resumed, all of it
    setup_s: float | None = None            # worker: a replacement's, from its assignment to its restore (the script
                                            # building its model and optimizer: overlaps the agent's fetch)
    state_wait_s: float | None = None       # worker: a replacement's restore waiting for its agent's fetch to end
    fetch_s: float | None = None            # agent: a replacement's fetch of its ranks' state from the plan's sources
    params_fetch_s: float | None = None     # agent: of fetch_s, the shared (model) parts from data-parallel peers
    install_s: float | None = None          # agent: of fetch_s, writing the fetched state into the node's slots

    def slowest(self, other: Timings) -> Timings:
        """Each phase's slowest of the two (a phase one of them did not measure: the other's)."""
        return Timings(**{f: max(v) if len(v := [x for x in (getattr(self, f), getattr(other, f)) if x is not None])
                          else None for f in FIELDS})

    def to_wire(self) -> dict[str, float]:
        return {f: round(v, 4) for f in FIELDS if (v := getattr(self, f)) is not None}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Timings:
        """From a message already checked (protocol/messages.py: an object of finite numbers); unknown names ignored."""
        return cls(**{f: float(d[f]) for f in FIELDS if d.get(f) is not None})


FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Timings))
