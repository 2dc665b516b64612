"""One rank's protection figures: what its worker measured of its last snapshot (runtime/protection.py, sent with
`written`), what its agent adds once the snapshot is committed (agents/replicator.py), carried to the master in
every heartbeat (protocol/messages.py) for `phoenixrun status` and the straggler check (control/telemetry.py).

Every field is optional: a rank reports what it has measured so far. On the wire a flat JSON object, None fields
left off; decoding ignores names it does not know (an agent of another version) and refuses a value of the wrong
type with a ValueError naming the field (the master's edge turns it into a MessageError)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

SECONDS = ("step_s", "compute_s", "d2h_s", "h2h_s", "stall_s")
COUNTS = ("every", "committed_step", "slot_bytes", "replicated_bytes", "replica_store_bytes")


# Not frozen, like messages.Heartbeat: the master builds one per rank per heartbeat (its hot path at 16K nodes)
@dataclass(slots=True)
class Figures:
    every: int | None = None                # the protection interval in force (steps)
    committed_step: int | None = None       # the newest step whose snapshot is committed (agent)
    step_s: float | None = None             # the step's wall time, snapshot submit to submit (worker)
    compute_s: float | None = None          # its forward/backward/optimizer time (worker; the straggler check's input)
    d2h_s: float | None = None              # the snapshot's copy into host memory (worker)
    h2h_s: float | None = None              # its replication to the peers' agents (agent)
    stall_s: float | None = None            # how long optimizer.step() waited for the previous commit (worker)
    slot_bytes: int | None = None           # one snapshot slot's size (worker)
    replicated_bytes: int | None = None     # the bytes of it sent to each replica holder (agent)
    replica_store_bytes: int | None = None  # what this node's agent holds of its peers' replicas (agent)

    def to_wire(self) -> dict[str, Any]:
        return {name: v for name in FIELDS if (v := getattr(self, name)) is not None}

    def committed(self, step: int, h2h_s: float, replicated_bytes: int, replica_store_bytes: int) -> Figures:
        """These figures with what the agent adds once the snapshot of `step` is committed."""
        return dataclasses.replace(self, committed_step=step, h2h_s=h2h_s, replicated_bytes=replicated_bytes,
                                   replica_store_bytes=replica_store_bytes)

    @classmethod
    def from_wire(cls, m: Mapping[str, Any]) -> Figures:
        # the master's heartbeat path: one pass, no float() for a value already a float (timeit, 10 figures:
        # 1.09 us against 1.35 us for a dict lookup per name and a conversion per value)
        out = cls()
        for name, v in m.items():
            t = type(v)
            if name in _SECONDS:
                if t is float:
                    setattr(out, name, v)
                elif t is int:
                    setattr(out, name, float(v))
                else:
                    raise ValueError(f"{name} must be a number, got {_show(v)}")
            elif name in _COUNTS:
                if t is not int or v < 0:
                    raise ValueError(f"{name} must be a non-negative integer, got {_show(v)}")
                setattr(out, name, v)
        return out


def _show(v: Any) -> str:
    r = repr(v)    # bounded: the value may be a hostile caller's
    return r if len(r) <= 40 else r[:37] + "..."


FIELDS = tuple(f.name for f in dataclasses.fields(Figures))
_SECONDS, _COUNTS = frozenset(SECONDS), frozenset(COUNTS)
assert set(FIELDS) == _SECONDS | _COUNTS, "every figure is a duration or a count"
