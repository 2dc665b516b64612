"""What agents report to the master, and what the master queues for its controller itself: one frozen dataclass
per `names.ReportKind`, shared by the agents (which build them: agents/reporter.py sends `to_wire()`), the
master (control/: the inbox carries them, the controller reads attributes) and the load generator (sim/swarm.py).

Every report has the header the agent's reporter fills in (`node_id`, `generation`, `slot`, `t`) and may carry
what the wire has always allowed on any report (`rank`, `step`, `detail`, `text`, `reason`); each kind adds its
own fields. On the wire a report is one JSON object: the header, `kind`, `token` (the envelope: `Sent`) and the
fields. `parse_report` is the master's edge: it validates a payload whole (types, ranges, ranks and slots within
the job's layout) and refuses anything else with a `MessageError` naming the field - an unknown kind, a kind the
master only queues itself, a field of the wrong type - never an exception of another type.

`encode -> decode` is the identity for every kind an agent sends (tests/test_reports.py), with one exception by
design: the master replaces a `t` more than `MAX_CLOCK_SKEW_S` away from its own clock by its own.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Mapping, Union

from phoenixrun.faults import Signal
from phoenixrun.protocol.constants import MAX_CLOCK_SKEW_S, MAX_COUNT, MAX_GENERATION, MAX_TEXT
from phoenixrun.protocol.messages import (Job, MessageError, addr_field, bool_field, get_field, int_field,
                                          inventory, num_field, obj, show, slot_field, str_field, token_field)
from phoenixrun.protocol.names import ReportKind
from phoenixrun.protocol.timings import Timings
from phoenixrun.redundancy import LayoutError, PeerSet

MAX_SILENT_S = 3600.0                    # a suspect's silence beyond an hour is not a measurement
TEXTS = ("detail", "text", "reason")     # free text any report may carry (cut to MAX_TEXT)


@dataclass(frozen=True, kw_only=True, slots=True)
class Report:
    """The fields every report has (see the module docstring)."""
    KIND: ClassVar[ReportKind]
    RANKED: ClassVar[bool] = False       # about one rank: `rank` always on the wire (null if the agent cannot tell)
    node_id: str = ""
    generation: int | None = None        # the generation the agent was in (None: it did not say)
    slot: int | None = None
    t: float | None = None               # when it happened (the agent's clock; checked against the master's)
    rank: int | None = None
    step: int | None = None
    detail: str = ""
    text: str = ""
    reason: str = ""

    @property
    def kind(self) -> ReportKind:
        return self.KIND

    def described(self) -> str:
        """What the report says happened (its detail, else its text)."""
        return self.detail or self.text

    def at(self, default: float) -> float:
        """Its time, or `default` for a report that has none (the master's own, queued without one)."""
        return default if self.t is None else self.t

    def sent_by(self, node_id: str, generation: int | None, slot: int | None, now: float) -> Report:
        """The report with its sender's header, as the agent's reporter sends it (a `t` already set is kept)."""
        return replace(self, node_id=node_id, generation=generation, slot=slot, t=now if self.t is None else self.t)

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"node_id": self.node_id, "kind": self.KIND.value, "generation": self.generation,
                               "slot": self.slot, "t": self.t}
        if self.rank is not None or self.RANKED:
            out["rank"] = self.rank
        if self.step is not None:
            out["step"] = self.step
        for name in TEXTS:
            if getattr(self, name):
                out[name] = getattr(self, name)
        out.update(self._own_wire())
        return out

    def _own_wire(self) -> dict[str, Any]:
        return {}

    @classmethod
    def _own(cls, p: Mapping[str, Any], job: Job) -> dict[str, Any]:
        """The kind's own fields of payload p, validated."""
        return {}


# ---------------------------------------------------------------- sent by agents
@dataclass(frozen=True, kw_only=True, slots=True)
class Left(Report):
    """The agent leaves (it got a signal): its slot is handled as a lost node."""
    KIND = ReportKind.LEFT


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkersDone(Report):
    """Every worker of the node finished the script."""
    KIND = ReportKind.WORKERS_DONE


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerExit(Report):
    KIND = ReportKind.WORKER_EXIT
    RANKED = True
    returncode: int        # Popen's: negative, killed by that signal

    def _own_wire(self) -> dict[str, Any]:
        return {"returncode": self.returncode}

    @classmethod
    def _own(cls, p: Mapping[str, Any], job: Job) -> dict[str, Any]:
        return {"returncode": int_field(p.get("returncode"), "returncode", -255, 256)}


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerHang(Report):
    KIND = ReportKind.WORKER_HANG
    RANKED = True


@dataclass(frozen=True, kw_only=True, slots=True)
class CommError(Report):
    """A collective failed (a symptom: some peer failed)."""
    KIND = ReportKind.COMM_ERROR
    RANKED = True


@dataclass(frozen=True, kw_only=True, slots=True)
class NanLoss(Report):
    KIND = ReportKind.NAN_LOSS
    RANKED = True


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerError(Report):
    """The script's own exception, before the worker exits."""
    KIND = ReportKind.WORKER_ERROR
    RANKED = True


@dataclass(frozen=True, kw_only=True, slots=True)
class RestoreFailed(Report):
    KIND = ReportKind.RESTORE_FAILED
    persist_step: int | None = None    # the persistent checkpoint it failed to load (a fallback's)
    integrity: bool = False            # the fetched state is not the lost rank's (checksum): the same plan cannot succeed
    mismatch: bool = False             # the restored state's layout is not the script's (faults/mismatch.py): no retry can

    def _own_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"integrity": self.integrity, "mismatch": self.mismatch}
        if self.persist_step is not None:
            out["persist_step"] = self.persist_step
        return out

    @classmethod
    def _own(cls, p: Mapping[str, Any], job: Job) -> dict[str, Any]:
        return {"persist_step": int_field(p.get("persist_step"), "persist_step", 0, MAX_COUNT, none=True),
                "integrity": bool_field(p.get("integrity"), "integrity"),
                "mismatch": bool_field(p.get("mismatch"), "mismatch")}


PARTS = ("private", "shared")


@dataclass(frozen=True, kw_only=True, slots=True)
class RestoreRefused(Report):
    """An option of a restore source the agent refused (protocol/restore.py Refusal); it tries the next one.
    `rank` is required here."""
    KIND = ReportKind.RESTORE_REFUSED
    part: str                 # "private" | "shared"
    source_rank: int
    addr: str
    integrity: bool = False

    def _own_wire(self) -> dict[str, Any]:
        return {"rank": self.rank, "part": self.part, "source_rank": self.source_rank, "addr": self.addr,
                "integrity": self.integrity}

    @classmethod
    def _own(cls, p: Mapping[str, Any], job: Job) -> dict[str, Any]:
        part = get_field(p, "part")
        if part not in PARTS:
            raise MessageError(f"part must be 'private' or 'shared', got {show(part)}")
        return {"part": part, "rank": int_field(get_field(p, "rank"), "rank", 0, job.world_size),
                "source_rank": int_field(get_field(p, "source_rank"), "source_rank", 0, job.world_size),
                "addr": addr_field(get_field(p, "addr"), "addr"), "integrity": bool_field(p.get("integrity"), "integrity")}


@dataclass(frozen=True, kw_only=True, slots=True)
class Resumed(Report):
    """Recovery phase 2's ack: the node's workers rebuilt; the slowest of its ranks' phases."""
    KIND = ReportKind.RESUMED
    timings: Timings = field(default_factory=Timings)

    def _own_wire(self) -> dict[str, Any]:
        return {"timings": self.timings.to_wire()}

    @classmethod
    def _own(cls, p: Mapping[str, Any], job: Job) -> dict[str, Any]:
        timings = p.get("timings") or {}
        if not isinstance(timings, dict) or len(timings) > 64:
            raise MessageError(f"timings must be an object of phase -> seconds, got {show(timings)}")
        return {"timings": Timings.from_wire({str_field(k, "timings key"): num_field(v, f"timings[{k!r}]")
                                              for k, v in timings.items()})}


@dataclass(frozen=True, kw_only=True, slots=True)
class Quiesced(Report):
    """Recovery phase 1's ack: the node's workers stopped; its snapshot inventory (rank -> steps) then."""
    KIND = ReportKind.QUIESCED
    snapshots: dict[int, list[int]] = field(default_factory=dict)
    replicas: dict[int, list[int]] = field(default_factory=dict)
    next_step: int = 0          # the step its workers would run next

    def _own_wire(self) -> dict[str, Any]:
        return {"snapshots": self.snapshots, "replicas": self.replicas, "next_step": self.next_step}

    @classmethod
    def _own(cls, p: Mapping[str, Any], job: Job) -> dict[str, Any]:
        return {"snapshots": inventory(p.get("snapshots"), "snapshots", job),
                "replicas": inventory(p.get("replicas"), "replicas", job),
                "next_step": int_field(p.get("next_step", 0), "next_step", 0, MAX_COUNT)}


@dataclass(frozen=True, kw_only=True, slots=True)
class ProtectionMode(Report):
    """The adaptive protection interval changed: a snapshot every `every` steps."""
    KIND = ReportKind.PROTECTION_MODE
    every: int

    def _own_wire(self) -> dict[str, Any]:
        return {"every": self.every}

    @classmethod
    def _own(cls, p: Mapping[str, Any], job: Job) -> dict[str, Any]:
        return {"every": int_field(p.get("every"), "every", 1, MAX_COUNT)}


@dataclass(frozen=True, kw_only=True, slots=True)
class Health(Report):
    """A health signal the agent saw (an Xid, snapshot space): `signal.node` is the master's to fill in."""
    KIND = ReportKind.HEALTH
    signal: Signal

    def _own_wire(self) -> dict[str, Any]:
        return {"signal": self.signal.to_dict()}

    @classmethod
    def _own(cls, p: Mapping[str, Any], job: Job) -> dict[str, Any]:
        return {"signal": _signal(p.get("signal"), job)}


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout(Report):
    """Where the job's DTensor state has identical copies (None: it is rank-private), sent once by rank 0."""
    KIND = ReportKind.LAYOUT
    peers: PeerSet | None = None

    def _own_wire(self) -> dict[str, Any]:
        return {"peers": None if self.peers is None else self.peers.to_wire()}

    @classmethod
    def _own(cls, p: Mapping[str, Any], job: Job) -> dict[str, Any]:
        return {"peers": _peers(p.get("peers"), job)}


DRAIN_BY = ("agent", "operator", "straggler")


@dataclass(frozen=True, kw_only=True, slots=True)
class Drain(Report):
    """Move the node's ranks to a spare: its agent got SIGTERM (`by` agent, the only one on the wire), or the master
    queued it for `phoenixrun drain` (operator) or --replace-stragglers (straggler)."""
    KIND = ReportKind.DRAIN
    by: str = "agent"


@dataclass(frozen=True, kw_only=True, slots=True)
class Suspect(Report):
    """A ring watcher's: its neighbour `suspect` has not answered its pings for `silent_for` seconds (the watcher's
    own clock: a duration, so no skew between hosts enters). The master's watch desk judges it
    (control/watch_desk.py); protocol/suspect.py is the master's edge for it."""
    KIND = ReportKind.SUSPECT
    suspect: str = ""
    silent_for: float = 0.0

    def _own_wire(self) -> dict[str, Any]:
        return {"suspect": self.suspect, "silent_for": self.silent_for}

    @classmethod
    def _own(cls, p: Mapping[str, Any], job: Job) -> dict[str, Any]:
        silent = num_field(p.get("silent_for"), "silent_for")
        if not 0 <= silent <= MAX_SILENT_S:
            raise MessageError(f"silent_for must be seconds in [0, {MAX_SILENT_S:g}], got {silent!r}")
        return {"suspect": str_field(p.get("suspect"), "suspect", ident=True, empty=False), "silent_for": silent}


# ---------------------------------------------------------------- queued by the master itself, never on the wire
@dataclass(frozen=True, kw_only=True, slots=True)
class Joined(Report):
    """A node registered (`interrupted`: it rejoined a restarted master in the middle of a recovery)."""
    KIND = ReportKind.JOINED
    interrupted: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeLost(Report):
    """A node's agent is gone: silent past --node-timeout, or its port refuses connections."""
    KIND = ReportKind.NODE_LOST


@dataclass(frozen=True, kw_only=True, slots=True)
class AttemptCheck(Report):
    """A torchrun-style restart attempt's deadline (`generation`: the attempt's; `joined`: ranks seen last time)."""
    KIND = ReportKind.ATTEMPT_CHECK
    joined: int | None = None


SENT = (Left, WorkersDone, WorkerExit, WorkerHang, CommError, NanLoss, WorkerError, RestoreFailed, RestoreRefused,
        Resumed, Quiesced, ProtectionMode, Health, Layout, Drain, Suspect)
KINDS: dict[ReportKind, type[Report]] = {c.KIND: c for c in SENT}     # what an agent may send
AnyReport = Union[Left, WorkersDone, WorkerExit, WorkerHang, CommError, NanLoss, WorkerError, RestoreFailed,
                  RestoreRefused, Resumed, Quiesced, ProtectionMode, Health, Layout, Drain, Suspect, Joined, NodeLost,
                  AttemptCheck]
_BY_VALUE = {k.value: c for k, c in KINDS.items()}


@dataclass(frozen=True, slots=True)
class Sent:
    """A report as it arrived: the registration token it carried, and the report."""
    token: str | None
    report: Report


def parse_report(p: Any, job: Job, now: float, max_skew: float = MAX_CLOCK_SKEW_S) -> Sent:
    """A report off the wire, validated whole (MessageError otherwise). `t` (the agent's clock) more than max_skew
    away from the master's is replaced by the master's: a wrong clock must not stretch incident windows."""
    p = obj(p)
    node_id = str_field(get_field(p, "node_id"), "node_id", ident=True, empty=False)
    kind = get_field(p, "kind")
    cls = _BY_VALUE.get(kind) if type(kind) is str else None
    if cls is None:
        raise MessageError(f"unknown report kind {show(kind)} (one of {', '.join(sorted(_BY_VALUE))})")
    t = num_field(p["t"], "t") if p.get("t") is not None else now
    fields: dict[str, Any] = {
        "node_id": node_id, "generation": int_field(p.get("generation"), "generation", 0, MAX_GENERATION, none=True),
        "slot": slot_field(p.get("slot"), "slot", job), "t": t if abs(t - now) <= max_skew else now,
        "rank": int_field(p.get("rank"), "rank", 0, job.world_size, none=True),
        "step": int_field(p.get("step"), "step", 0, MAX_COUNT, none=True)}
    for name in TEXTS:
        fields[name] = str_field(p.get(name), name, limit=MAX_TEXT)
    fields.update(cls._own(p, job))
    return Sent(token_field(p), cls(**fields))


def _peers(v: Any, job: Job) -> PeerSet | None:
    """A job's DTensor peer set as rank 0 sends it (redundancy.PeerSet's wire form), or None (none: DTensor state
    is rank-private); the mesh must span exactly the job's ranks."""
    if v is None:
        return None
    if type(v) is not dict:
        raise MessageError(f"peers must be an object (a mesh and the dimensions its state varies along), got {show(v)}")
    try:
        ps = PeerSet.from_wire(v)
    except LayoutError as e:
        raise MessageError(f"peers: {e}") from None
    if len(ps.mesh.ranks) != job.world_size or max(ps.mesh.ranks) != job.world_size - 1:
        raise MessageError(f"peers: a mesh of {len(ps.mesh.ranks)} ranks for a job of {job.world_size}")
    return ps


def _signal(v: Any, job: Job) -> Signal:
    if not isinstance(v, dict):
        raise MessageError(f"signal must be an object, got {show(v)}")
    try:
        sig = Signal.from_dict({k: x for k, x in v.items() if k != "node"})
    except (TypeError, ValueError) as e:
        raise MessageError(f"signal is not a valid health signal: {e}") from None
    if sig.code is not None and type(sig.code) is not int:
        raise MessageError(f"signal.code must be an integer, got {show(sig.code)}")
    if sig.rank is not None:
        int_field(sig.rank, "signal.rank", 0, job.world_size)
    return replace(sig, detail=str_field(sig.detail, "signal.detail", limit=MAX_TEXT),
                   timestamp=num_field(sig.timestamp, "signal.timestamp"))
