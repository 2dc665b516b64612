"""The control API's messages, defined once: a typed dataclass and a validating parser per message.

Every message an agent (or an operator's curl) sends the master is parsed here before the master
applies anything from it: types, ranges, slots and ranks within the job's layout, sizes. A message
that fails is refused whole with a `MessageError` naming the field and what was wrong (the transport
answers its `code`, a 4xx); nothing of it is applied. The rules the master checks against its own
state (tokens, generations, versions) are in `Master`'s handlers and in docs/architecture.md
("Control API validation").

Parsers are pure functions of (payload, Job) and cheap: the heartbeat's runs 16K times a second.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from phoenixrun.faults import Signal
from phoenixrun.protocol.constants import (DEFAULT_POLL_TIMEOUT_S, MAX_CLOCK_SKEW_S, MAX_COUNT, MAX_GENERATION,
                                           MAX_ID, MAX_LIST, MAX_POLL_TIMEOUT, MAX_TEXT)
from phoenixrun.protocol.names import REPORT_KINDS, ReportKind
from phoenixrun.protocol.status import Status
from phoenixrun.redundancy import LayoutError, PeerSet

_ID = re.compile(r"[A-Za-z0-9._:@/+\-]+\Z")
FAULTS = ("crash-worker", "kill-node", "hang", "ecc", "partition", "comm-timeout", "nan")
ROLES = ("active", "spare", "unknown")


class MessageError(ValueError):
    """A message the master refuses whole: `code` is the HTTP status to answer (4xx, protocol/status.py)."""

    counted = True                    # in the master's rejection counters (control/rejections.py)

    def __init__(self, msg: str, code: int = Status.BAD_REQUEST, reason: str = "invalid"):
        super().__init__(msg)
        self.code = code
        self.reason = reason          # the category counted in the master's rejection counters


class UnknownNode(MessageError):
    """A call from a node id the master has no record of: a master that restarted since the node registered.
    Answered UNKNOWN_NODE (the node registers again, telling the master what it knows, then retries); not
    counted as a rejection: every agent of a job meets it once after a master restart."""

    counted = False

    def __init__(self, msg: str = "unknown node: register first"):
        super().__init__(msg, code=Status.UNKNOWN_NODE, reason="unknown_node")


@dataclass(frozen=True)
class Job:
    """What the parsers check ranges against."""
    nnodes: int
    nproc_per_node: int
    world_size: int


# ------------------------------------------------------------------ field readers
_MISSING: Any = object()


def _get(p: Mapping, name: str, default=_MISSING):
    if name in p:
        return p[name]
    if default is _MISSING:
        raise MessageError(f"missing field {name!r}")
    return default


def _int(v, name: str, lo: int, hi: int, none: bool = False) -> int | None:
    if v is None and none:
        return None
    if type(v) is not int:      # bool is an int subclass: refused; floats too (1e12 is not a generation)
        raise MessageError(f"{name} must be an integer, got {_show(v)}")
    if not lo <= v < hi:
        raise MessageError(f"{name} {v} is out of range [{lo}, {hi})")
    return v


def _num(v, name: str) -> float:
    if type(v) not in (int, float) or not math.isfinite(v):
        raise MessageError(f"{name} must be a finite number, got {_show(v)}")
    return float(v)


def _str(v, name: str, limit: int = MAX_ID, ident: bool = False, empty: bool = True) -> str:
    if v is None and empty:
        return ""
    if not isinstance(v, str):
        raise MessageError(f"{name} must be a string, got {_show(v)}")
    if ident:
        if len(v) > limit or (v and not _ID.match(v)):
            raise MessageError(f"{name} {v[:60]!r} is not a valid identifier (letters, digits, ._:@/+-, "
                               f"at most {limit} characters)")
    elif len(v) > limit:
        v = v[:limit]
    if not v and not empty:
        raise MessageError(f"{name} must not be empty")
    return v


def _bool(v, name: str) -> bool:
    if v is None:
        return False
    if type(v) is not bool:
        raise MessageError(f"{name} must be true or false, got {_show(v)}")
    return v


def _addr(v, name: str) -> str:
    s = _str(v, name, empty=False)
    host, sep, port = s.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise MessageError(f"{name} must be host:port, got {s[:60]!r}")
    return s


def _show(v) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def _rank_key(k, name: str, job: Job) -> int:
    """A JSON object key naming a rank ("3"), as inventories carry them."""
    if type(k) is str and k.isdigit() and len(k) < 12:
        r = int(k)
    elif type(k) is int and k >= 0:
        r = k
    else:
        raise MessageError(f"{name}: key {_show(k)} is not a rank")
    if r >= job.world_size:
        raise MessageError(f"{name}: rank {r} is outside the job (world size {job.world_size})")
    return r


_SCALARS = frozenset({int, float, bool, str, type(None)})


def inventory(v, name: str, job: Job) -> dict[int, list[int]]:
    """rank -> snapshot steps, as agents report them ({"0": [41, 42]})."""
    if not v:
        if v is None or v == {}:
            return {}
        raise MessageError(f"{name} must be an object of rank -> steps, got {_show(v)}")
    if type(v) is not dict:
        raise MessageError(f"{name} must be an object of rank -> steps, got {_show(v)}")
    out = {}
    for k, steps in v.items():
        r = _rank_key(k, name, job)
        if type(steps) is not list or len(steps) > MAX_LIST:
            raise MessageError(f"{name}[{r}] must be a list of steps, got {_show(steps)}")
        for s in steps:     # the heartbeat's hot loop: a handful of steps per rank
            if type(s) is not int or s < 0 or s >= MAX_COUNT:
                raise MessageError(f"{name}[{r}]: step {_show(s)} is not a non-negative integer")
        out[r] = steps
    return out


def _protection(v, job: Job) -> dict[int, dict]:
    """rank -> figures shown by status (flat JSON scalars)."""
    if not v:
        if v is None or v == {}:
            return {}
        raise MessageError(f"protection must be an object of rank -> figures, got {_show(v)}")
    if type(v) is not dict:
        raise MessageError(f"protection must be an object of rank -> figures, got {_show(v)}")
    out = {}
    for k, figs in v.items():
        r = _rank_key(k, "protection", job)
        if type(figs) is not dict or len(figs) > 64:
            raise MessageError(f"protection[{r}] must be an object of figures, got {_show(figs)}")
        for fk, fv in figs.items():
            if type(fv) not in _SCALARS or type(fk) is not str:
                raise MessageError(f"protection[{r}][{_show(fk)}] must be a number or string, got {_show(fv)}")
        out[r] = figs
    return out


def valid_fault(fault: str) -> bool:
    """A fault spec the agent can carry out (`phoenixrun inject --fault`; the master checks the same)."""
    if not isinstance(fault, str):
        return False
    name, sep, arg = fault.partition(":")
    if not sep:
        return fault in FAULTS
    if name == "xid":
        return arg.isdigit() and len(arg) < 10
    if name == "partition":
        try:
            return 0 < float(arg) < float("inf")
        except ValueError:
            return False
    if name == "slow":
        try:
            return 1 <= float(arg) <= 100
        except ValueError:
            return False
    return False


# ------------------------------------------------------------------ messages
@dataclass(frozen=True, slots=True)
class Rejoin:
    """What an agent tells a restarted master about itself (register's `rejoin`)."""
    role: str
    slot: int | None
    generation: int
    restart_count: int
    api: bool
    frozen: bool
    snapshots: dict[int, list[int]]
    replicas: dict[int, list[int]]
    world_slots: dict[int, str]      # slot -> peer address, as the agent knew its world


@dataclass(frozen=True, slots=True)
class Register:
    node_id: str
    host: str
    agent_pid: int
    peer_addr: str
    fault_domain: str
    rejoin: Rejoin | None = None
    node_rank: int | None = None   # --node-rank: the slot it asks for (>= nnodes: a spare)
    # a random value only this agent process holds, the same in each of its registrations: a retry or a rejoin
    # must carry it (what /v1/state shows of a node - host, pid, address - anyone holding the secret can read)
    nonce: str | None = field(default=None, repr=False)


# Heartbeat and Report are not frozen (the others are): with a frozen __init__ (and a generator over worker_pids)
# parse_heartbeat took 6.0 us of CPU, now 4.7 us (timeit, 4 ranks x 2 steps + protection figures); by_rank, what it
# replaces, took 1.6 us
@dataclass(slots=True)
class Heartbeat:
    node_id: str
    token: str | None
    worker_pids: list[int]
    snapshots: dict[int, list[int]]
    replicas: dict[int, list[int]]
    protection: dict[int, dict]
    api: bool
    warm_ready: bool = False      # a spare whose pre-started workers (and checkpoint I/O process) are up


@dataclass(slots=True)
class Report:
    node_id: str
    token: str | None
    kind: ReportKind
    generation: int | None
    event: dict = field(repr=False)   # the validated report as the controller reads it (a dict, as before)


@dataclass(frozen=True, slots=True)
class Inject:
    slot: int
    fault: str


@dataclass(frozen=True, slots=True)
class Drain:
    slot: int
    reason: str


@dataclass(frozen=True, slots=True)
class Poll:
    node_id: str
    token: str | None
    version: int
    timeout: float


def _obj(p) -> Mapping:
    if not isinstance(p, dict):
        raise MessageError(f"the body must be a JSON object, got {_show(p)}")
    return p


def _token(p: Mapping) -> str | None:
    t = p.get("token")
    return None if t is None else _str(t, "token", limit=128)


def _slot(v, name: str, job: Job, none: bool = True) -> int | None:
    if v is None and none:
        return None
    if type(v) is not int:
        raise MessageError(f"{name} must be a slot number, got {_show(v)}")
    if not 0 <= v < job.nnodes:
        raise MessageError(f"{name} {v} is outside the job's slots 0..{job.nnodes - 1}")
    return v


def parse_register(p, job: Job) -> Register:
    p = _obj(p)
    node_id = _str(_get(p, "node_id"), "node_id", ident=True, empty=False)
    nproc = p.get("nproc_per_node")
    if nproc is not None and _int(nproc, "nproc_per_node", 1, 1 << 16) != job.nproc_per_node:
        raise MessageError(f"this agent runs {nproc} workers per node but the job has {job.nproc_per_node}: "
                           "start it with the job's --nproc-per-node")
    r = p.get("rejoin")
    return Register(node_id=node_id, host=_str(_get(p, "host"), "host", empty=False),
                    agent_pid=_int(_get(p, "agent_pid"), "agent_pid", 0, 1 << 32),
                    peer_addr=_addr(_get(p, "peer_addr"), "peer_addr"),
                    fault_domain=_str(p.get("fault_domain"), "fault_domain") or node_id,
                    rejoin=parse_rejoin(r, job) if r else None,
                    node_rank=_int(p.get("node_rank"), "node_rank", 0, MAX_COUNT, none=True),
                    nonce=_nonce(p.get("nonce")))


def _nonce(v) -> str | None:
    if v is None:
        return None
    v = _str(v, "nonce", limit=128, ident=True)
    if len(v) < 16:
        raise MessageError(f"nonce must be 16 to 128 characters, got {len(v)}")
    return v


def parse_rejoin(r, job: Job) -> Rejoin:
    if not isinstance(r, dict):
        raise MessageError(f"rejoin must be an object, got {_show(r)}")
    role = r.get("role")
    if role not in ROLES:
        raise MessageError(f"rejoin.role must be one of {', '.join(ROLES)}, got {_show(role)}")
    slot = _slot(r.get("slot"), "rejoin.slot", job)
    if role == "active" and slot is None:
        raise MessageError("rejoin: an active node must name its slot")
    world = r.get("world") or {}
    if not isinstance(world, dict):
        raise MessageError(f"rejoin.world must be an object, got {_show(world)}")
    ws = world.get("slots") or {}
    if not isinstance(ws, dict):
        raise MessageError(f"rejoin.world.slots must be an object of slot -> address, got {_show(ws)}")
    world_slots = {}
    for k, a in ws.items():
        s = int(k) if isinstance(k, str) and k.isdigit() and len(k) < 12 else k
        world_slots[_slot(s, "rejoin.world.slots key", job, none=False)] = _addr(a, f"rejoin.world.slots[{k}]")
    return Rejoin(role=role, slot=slot if role == "active" else None,
                  generation=_int(r.get("generation", 0), "rejoin.generation", 0, MAX_GENERATION),
                  restart_count=_int(r.get("restart_count", 0), "rejoin.restart_count", 0, MAX_COUNT),
                  api=_bool(r.get("api"), "rejoin.api"), frozen=_bool(r.get("frozen"), "rejoin.frozen"),
                  snapshots=inventory(r.get("snapshots"), "rejoin.snapshots", job),
                  replicas=inventory(r.get("replicas"), "rejoin.replicas", job), world_slots=world_slots)


def parse_heartbeat(p, job: Job) -> Heartbeat:
    p = _obj(p)
    pids = p.get("worker_pids") or []
    if type(pids) is not list or len(pids) > MAX_LIST:
        raise MessageError(f"worker_pids must be a list of process ids, got {_show(pids)}")
    for x in pids:
        if type(x) is not int or x < 0:
            raise MessageError(f"worker_pids must be a list of process ids, got {_show(pids)}")
    return Heartbeat(node_id=_str(_get(p, "node_id"), "node_id", ident=True, empty=False), token=_token(p),
                     worker_pids=pids, snapshots=inventory(p.get("snapshots"), "snapshots", job),
                     replicas=inventory(p.get("replicas"), "replicas", job),
                     protection=_protection(p.get("protection"), job), api=_bool(p.get("api"), "api"),
                     warm_ready=_bool(p.get("warm_ready"), "warm_ready"))


# report kinds about one rank: they always carry `rank` (null if the agent could not tell)
_RANKED = frozenset({ReportKind.WORKER_EXIT, ReportKind.WORKER_HANG, ReportKind.COMM_ERROR, ReportKind.NAN_LOSS,
                     ReportKind.WORKER_ERROR})


def parse_report(p, job: Job, now: float, max_skew: float = MAX_CLOCK_SKEW_S) -> Report:
    """A report; its `event` is what the controller gets. `t` (the agent's clock) more than max_skew away
    from the master's is replaced by the master's: a wrong clock must not stretch incident windows."""
    p = _obj(p)
    node_id = _str(_get(p, "node_id"), "node_id", ident=True, empty=False)
    kind = _get(p, "kind")
    if kind not in REPORT_KINDS:
        raise MessageError(f"unknown report kind {_show(kind)} (one of {', '.join(sorted(REPORT_KINDS))})")
    kind = ReportKind(kind)
    ev: dict[str, Any] = {"node_id": node_id, "kind": kind}
    gen = _int(p.get("generation"), "generation", 0, MAX_GENERATION, none=True)
    if gen is not None:
        ev["generation"] = gen
    ev["slot"] = _slot(p.get("slot"), "slot", job)
    t = _num(p["t"], "t") if p.get("t") is not None else now
    ev["t"] = t if abs(t - now) <= max_skew else now
    if "rank" in p or kind in _RANKED:
        ev["rank"] = _int(p.get("rank"), "rank", 0, job.world_size, none=True)
    for name in ("detail", "text", "reason"):
        if name in p:
            ev[name] = _str(p[name], name, limit=MAX_TEXT)
    if "step" in p:
        ev["step"] = _int(p["step"], "step", 0, MAX_COUNT, none=True)
    if kind == ReportKind.WORKER_EXIT:
        ev["returncode"] = _int(p.get("returncode"), "returncode", -255, 256)
    elif kind == ReportKind.RESTORE_FAILED:
        if "persist_step" in p:
            ev["persist_step"] = _int(p["persist_step"], "persist_step", 0, MAX_COUNT, none=True)
        # the fetched state is not the lost rank's (checksum mismatch): the same plan cannot succeed
        ev["integrity"] = _bool(p.get("integrity"), "integrity")
        # the restored state's layout is not the script's (faults/mismatch.py): no retry can succeed
        ev["mismatch"] = _bool(p.get("mismatch"), "mismatch")
    elif kind == ReportKind.RESTORE_REFUSED:
        # an option of a restore source the agent refused (protocol/restore.py Refusal); it tries the next one
        part = _get(p, "part")
        if part not in ("private", "shared"):
            raise MessageError(f"part must be 'private' or 'shared', got {_show(part)}")
        ev["part"] = part
        ev["rank"] = _int(_get(p, "rank"), "rank", 0, job.world_size)
        ev["source_rank"] = _int(_get(p, "source_rank"), "source_rank", 0, job.world_size)
        ev["addr"] = _addr(_get(p, "addr"), "addr")
        ev["integrity"] = _bool(p.get("integrity"), "integrity")
    elif kind == ReportKind.RESUMED:
        timings = p.get("timings") or {}
        if not isinstance(timings, dict) or len(timings) > 64:
            raise MessageError(f"timings must be an object of phase -> seconds, got {_show(timings)}")
        ev["timings"] = {_str(k, "timings key"): _num(v, f"timings[{k!r}]") for k, v in timings.items()}
    elif kind == ReportKind.QUIESCED:
        ev["snapshots"] = inventory(p.get("snapshots"), "snapshots", job)
        ev["replicas"] = inventory(p.get("replicas"), "replicas", job)
        ev["next_step"] = _int(p.get("next_step", 0), "next_step", 0, MAX_COUNT)
    elif kind == ReportKind.PROTECTION_MODE:
        ev["every"] = _int(p.get("every"), "every", 1, MAX_COUNT)
    elif kind == ReportKind.HEALTH:
        ev["signal"] = _signal(p.get("signal"), job)
    elif kind == ReportKind.LAYOUT:
        ev["peers"] = _peers(p.get("peers"), job)
    return Report(node_id=node_id, token=_token(p), kind=kind, generation=gen, event=ev)


def _peers(v, job: Job) -> dict | None:
    """A job's DTensor peer set as rank 0 sends it (redundancy.PeerSet's wire form), or None (none: DTensor state
    is rank-private); the mesh must span exactly the job's ranks."""
    if v is None:
        return None
    if type(v) is not dict:
        raise MessageError(f"peers must be an object (a mesh and the dimensions its state varies along), got {_show(v)}")
    try:
        ps = PeerSet.from_wire(v)
    except LayoutError as e:
        raise MessageError(f"peers: {e}") from None
    if len(ps.mesh.ranks) != job.world_size or max(ps.mesh.ranks) != job.world_size - 1:
        raise MessageError(f"peers: a mesh of {len(ps.mesh.ranks)} ranks for a job of {job.world_size}")
    return v


def _signal(v, job: Job) -> dict:
    if not isinstance(v, dict):
        raise MessageError(f"signal must be an object, got {_show(v)}")
    try:
        sig = Signal.from_dict({k: x for k, x in v.items() if k != "node"})
    except (TypeError, ValueError) as e:
        raise MessageError(f"signal is not a valid health signal: {e}") from None
    if sig.code is not None and type(sig.code) is not int:
        raise MessageError(f"signal.code must be an integer, got {_show(sig.code)}")
    if sig.rank is not None:
        _int(sig.rank, "signal.rank", 0, job.world_size)
    _str(sig.detail, "signal.detail", limit=MAX_TEXT)
    _num(sig.timestamp, "signal.timestamp")
    return sig.to_dict()


def parse_inject(p, job: Job) -> Inject:
    p = _obj(p)
    slot = _slot(_get(p, "slot"), "slot", job, none=False)
    fault = _get(p, "fault")
    if not valid_fault(fault):
        raise MessageError(f"unknown fault {_show(fault)}: one of {' | '.join(FAULTS)} | xid:N | partition:SECONDS | slow:FACTOR")
    return Inject(slot=slot, fault=fault)


def parse_drain(p, job: Job) -> Drain:
    """`phoenixrun drain`: the node slot to move to a spare, and why (free text, for the events)."""
    p = _obj(p)
    slot = _slot(_get(p, "slot"), "slot", job, none=False)
    reason = _str(p.get("reason") or "operator request", "reason", limit=MAX_TEXT)
    return Drain(slot=slot, reason=reason)


def parse_poll(p, newest_version: int) -> Poll:
    """A directive long-poll. The version an agent holds is one the master issued: -1 (none yet) up to
    the newest it has set; anything else is refused (a poll holding a future version would never be
    answered with anything newer)."""
    p = _obj(p)
    version = p.get("version", -1)
    if type(version) is not int or not -1 <= version <= newest_version:
        raise MessageError(f"version {_show(version)} was never issued by this master (newest {newest_version})")
    timeout = _num(p.get("timeout", DEFAULT_POLL_TIMEOUT_S), "timeout")
    if not 0 <= timeout <= MAX_POLL_TIMEOUT:
        raise MessageError(f"timeout {timeout} is out of range [0, {MAX_POLL_TIMEOUT:g}]")
    return Poll(node_id=_str(p.get("node_id", ""), "node_id", ident=True), token=_token(p), version=version,
                timeout=timeout)
