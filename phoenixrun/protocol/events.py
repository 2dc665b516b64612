"""The event log's records: one frozen dataclass per `names.Event`, the only way the master writes an event
(control/events.py's `EventLog.emit` takes one). docs/design.md, "Event contract", names every field; a field
whose default is `ABSENT` is left out of the record when not given (the table's "where reported" fields), every
other field is always written (null when unknown), so the five places that detect a fault write the same shape.

Pure data: no I/O. `fields()` is what goes to the log (with `t`, `event` and `generation` added by the log)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from phoenixrun.protocol.fields import optional as _absent
from phoenixrun.protocol.fields import renamed, wire_fields
from phoenixrun.protocol.names import Event


@dataclass(frozen=True, kw_only=True)
class EventRecord:
    NAME: ClassVar[Event]

    def fields(self) -> dict[str, Any]:
        """The record's fields as the log writes them (optional ones only when given)."""
        return wire_fields(self)


@dataclass(frozen=True, kw_only=True)
class MasterStarted(EventRecord):
    NAME = Event.MASTER_STARTED
    endpoint: str
    pid: int
    nnodes: int
    nproc_per_node: int
    epoch: int


@dataclass(frozen=True, kw_only=True)
class MasterStandby(EventRecord):
    NAME = Event.MASTER_STANDBY
    pid: int
    endpoint: str
    holder_epoch: int | None
    holder_endpoint: str | None


@dataclass(frozen=True, kw_only=True)
class MasterTakeover(EventRecord):
    NAME = Event.MASTER_TAKEOVER
    epoch: int
    endpoint: str
    previous_epoch: int
    previous_endpoint: str
    reason: str
    waited_s: float


@dataclass(frozen=True, kw_only=True)
class MasterDeposed(EventRecord):
    NAME = Event.MASTER_DEPOSED
    epoch: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class MasterRecovered(EventRecord):
    NAME = Event.MASTER_RECOVERED
    nodes: int
    missing_slots: list[int]
    restart_count: int


@dataclass(frozen=True, kw_only=True)
class MasterStalled(EventRecord):
    NAME = Event.MASTER_STALLED
    seconds: float


@dataclass(frozen=True, kw_only=True)
class NodeJoined(EventRecord):
    NAME = Event.NODE_JOINED
    node: str
    host: str
    role: str
    slot: int | None
    agent_pid: int
    fault_domain: str | None


@dataclass(frozen=True, kw_only=True)
class NodeRefused(EventRecord):
    NAME = Event.NODE_REFUSED
    node: str
    host: str
    node_rank: int | None
    reason: str


@dataclass(frozen=True, kw_only=True)
class NodeRejoined(EventRecord):
    NAME = Event.NODE_REJOINED
    node: str
    role: str
    slot: int | None
    agent_generation: int
    interrupted: bool


@dataclass(frozen=True, kw_only=True)
class NodeFenced(EventRecord):
    """A replaced node talked to the master: `slot` (a rejoin refused) or `via` (the call it made)."""
    NAME = Event.NODE_FENCED
    node: str
    reason: str
    slot: int | None = _absent()
    via: str | None = _absent()


@dataclass(frozen=True, kw_only=True)
class SpareLost(EventRecord):
    NAME = Event.SPARE_LOST
    node: str


@dataclass(frozen=True, kw_only=True)
class SparePromoted(EventRecord):
    NAME = Event.SPARE_PROMOTED
    slot: int
    node: str
    replaces: str | None


@dataclass(frozen=True, kw_only=True)
class JobStarted(EventRecord):
    NAME = Event.JOB_STARTED
    world_size: int
    slots: dict[int, str]


@dataclass(frozen=True, kw_only=True)
class JobFinished(EventRecord):
    NAME = Event.JOB_FINISHED
    exit_code: int
    reason: str
    restarts: int
    recoveries: int
    committed_step: int | None
    newest_snapshot: int | None


@dataclass(frozen=True, kw_only=True)
class JobResized(EventRecord):
    """`job_shrunk` (`lost_nodes`, `cause`) and `job_grown` (`added`): the job re-partitioned."""
    nnodes: int
    world_size: int
    was_nnodes: int
    was_world_size: int
    restored_step: int
    replayed_steps: int
    steps_completed_before: int
    slot_map: dict[int, int]
    duration_s: float
    lost_nodes: dict[int, str] | None = _absent()
    cause: str | None = _absent()
    added: str | None = _absent()


@dataclass(frozen=True, kw_only=True)
class JobShrunk(JobResized):
    NAME = Event.JOB_SHRUNK


@dataclass(frozen=True, kw_only=True)
class JobGrown(JobResized):
    NAME = Event.JOB_GROWN


@dataclass(frozen=True, kw_only=True)
class DirectiveSent(EventRecord):
    NAME = Event.DIRECTIVE_SENT
    command: str
    version: int
    nodes: int
    seconds: float


@dataclass(frozen=True, kw_only=True)
class FaultInjected(EventRecord):
    NAME = Event.FAULT_INJECTED
    node: str
    slot: int
    fault: str


@dataclass(frozen=True, kw_only=True)
class FaultDetected(EventRecord):
    """A fault classified and acted on. Every detection writes the same fields (null when the report did not
    carry them); `kind` repeats `class` (older readers). The optional ones say how it was found: an incident's
    correlation (`verdict`, `reporters`, `symptoms`), a stop by escalation (`repeats`), a fault during a recovery
    (`during_recovery`), a node lost with a torchrun-style failure (`symptom_of_loss`)."""
    NAME = Event.FAULT_DETECTED
    node: str | None
    slot: int | None
    signal: str | None
    rank: int | None
    returncode: int | None
    detail: str
    fault_class: str = renamed("class")
    action: str
    step: int | None
    verdict: str | None = _absent()
    reporters: list[str] | None = _absent()
    symptoms: list[str] | None = _absent()
    repeats: int | None = _absent()
    during_recovery: bool | None = _absent()
    symptom_of_loss: bool | None = _absent()

    def fields(self) -> dict[str, Any]:
        return {**super().fields(), "kind": self.fault_class}


@dataclass(frozen=True, kw_only=True)
class ProtectionMode(EventRecord):
    NAME = Event.PROTECTION_MODE
    every: int
    step: int | None
    reason: str


@dataclass(frozen=True, kw_only=True)
class RecoveryStarted(EventRecord):
    """A hot swap, local reset or drain begins (`generation`: the one it starts); a drain's has `reason`, `at_step`."""
    NAME = Event.RECOVERY_STARTED
    failed_node: str
    slot: int | None
    cause: str
    action: str
    reason: str | None = _absent()
    at_step: int | None = _absent()


@dataclass(frozen=True, kw_only=True)
class RecoveryPlanned(EventRecord):
    NAME = Event.RECOVERY_PLAN
    restore_step: int
    replaced_slots: dict[int, str]
    fetch: dict[int, dict[str, Any]]
    cause: str | None = _absent()


@dataclass(frozen=True, kw_only=True)
class RecoveryDone(EventRecord):
    NAME = Event.RECOVERY_DONE
    restored_step: int
    replayed_steps: int
    steps_completed_before: int
    duration_s: float
    detect_to_done_s: float
    replaced_slots: dict[int, str]
    attempts: int
    phases: dict[str, float]
    cause: str | None = _absent()
    drained_node: str | None = _absent()


@dataclass(frozen=True, kw_only=True)
class RecoveryFailed(EventRecord):
    NAME = Event.RECOVERY_FAILED
    reason: str


@dataclass(frozen=True, kw_only=True)
class RestoreRefused(EventRecord):
    NAME = Event.RESTORE_REFUSED
    node: str | None
    rank: int | None
    part: str | None
    addr: str | None
    source_rank: int | None
    integrity: bool | None
    reason: str | None


@dataclass(frozen=True, kw_only=True)
class Restarted(EventRecord):
    NAME = Event.RESTART
    restart_count: int
    reason: str
    store_port: int


@dataclass(frozen=True, kw_only=True)
class FallbackRestart(EventRecord):
    NAME = Event.FALLBACK_RESTART
    restore_step: int
    reason: str
    fallbacks: int
    checkpoint: str


@dataclass(frozen=True, kw_only=True)
class FallbackDone(EventRecord):
    NAME = Event.FALLBACK_DONE
    restore_step: int
    duration_s: float


@dataclass(frozen=True, kw_only=True)
class CheckpointRejected(EventRecord):
    NAME = Event.CHECKPOINT_REJECTED
    step: int | None
    reason: str


@dataclass(frozen=True, kw_only=True)
class RejectedRequest(EventRecord):
    NAME = Event.REJECTED_REQUEST
    peer: str
    reason: str
    path: str
    detail: str
    count: int
    suppressed_since_last: int


@dataclass(frozen=True, kw_only=True)
class DrainRequested(EventRecord):
    NAME = Event.DRAIN_REQUESTED
    node: str
    slot: int | None
    reason: str
    by: str
    accepted: bool
    refusal: str | None = _absent()


@dataclass(frozen=True, kw_only=True)
class Straggler(EventRecord):
    NAME = Event.STRAGGLER
    node: str
    slot: int | None
    ratio: float | None
    compute_s: float | None
    window: int
    threshold: float
    replace: bool


RECORDS: dict[Event, type[EventRecord]] = {
    r.NAME: r for r in (MasterStarted, MasterStandby, MasterTakeover, MasterDeposed, MasterRecovered, MasterStalled,
                        NodeJoined, NodeRefused, NodeRejoined, NodeFenced, SpareLost, SparePromoted, JobStarted,
                        JobFinished, JobShrunk, JobGrown, DirectiveSent, FaultInjected, FaultDetected, ProtectionMode,
                        RecoveryStarted, RecoveryPlanned, RecoveryDone, RecoveryFailed, RestoreRefused, Restarted,
                        FallbackRestart, FallbackDone, CheckpointRejected, RejectedRequest, DrainRequested, Straggler)}
