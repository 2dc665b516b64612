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
from typing import Any, Literal, Mapping, overload

from phoenixrun.protocol.constants import (DEFAULT_POLL_TIMEOUT_S, MAX_COUNT, MAX_GENERATION, MAX_ID, MAX_LIST,
                                           MAX_POLL_TIMEOUT, MAX_TEXT)
from phoenixrun.protocol.figures import Figures
from phoenixrun.protocol.status import Status

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


def get_field(p: Mapping[str, Any], name: str, default: Any = _MISSING) -> Any:
    if name in p:
        return p[name]
    if default is _MISSING:
        raise MessageError(f"missing field {name!r}")
    return default


@overload
def int_field(v: Any, name: str, lo: int, hi: int, none: Literal[False] = False) -> int: ...


@overload
def int_field(v: Any, name: str, lo: int, hi: int, none: bool) -> int | None: ...


def int_field(v: Any, name: str, lo: int, hi: int, none: bool = False) -> int | None:
    if v is None and none:
        return None
    if type(v) is not int:      # bool is an int subclass: refused; floats too (1e12 is not a generation)
        raise MessageError(f"{name} must be an integer, got {show(v)}")
    if not lo <= v < hi:
        raise MessageError(f"{name} {v} is out of range [{lo}, {hi})")
    return v


def num_field(v: Any, name: str) -> float:
    if type(v) not in (int, float) or not math.isfinite(v):
        raise MessageError(f"{name} must be a finite number, got {show(v)}")
    return float(v)


def str_field(v: Any, name: str, limit: int = MAX_ID, ident: bool = False, empty: bool = True) -> str:
    if v is None and empty:
        return ""
    if not isinstance(v, str):
        raise MessageError(f"{name} must be a string, got {show(v)}")
    if ident:
        if len(v) > limit or (v and not _ID.match(v)):
            raise MessageError(f"{name} {v[:60]!r} is not a valid identifier (letters, digits, ._:@/+-, "
                               f"at most {limit} characters)")
    elif len(v) > limit:
        v = v[:limit]
    if not v and not empty:
        raise MessageError(f"{name} must not be empty")
    out: str = v
    return out


def bool_field(v: Any, name: str) -> bool:
    if v is None:
        return False
    if type(v) is not bool:
        raise MessageError(f"{name} must be true or false, got {show(v)}")
    return v


def addr_field(v: Any, name: str) -> str:
    s = str_field(v, name, empty=False)
    host, sep, port = s.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise MessageError(f"{name} must be host:port, got {s[:60]!r}")
    return s


def show(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def _rank_key(k: Any, name: str, job: Job) -> int:
    """A JSON object key naming a rank ("3"), as inventories carry them."""
    if type(k) is str and k.isdigit() and len(k) < 12:
        r = int(k)
    elif type(k) is int and k >= 0:
        r = k
    else:
        raise MessageError(f"{name}: key {show(k)} is not a rank")
    if r >= job.world_size:
        raise MessageError(f"{name}: rank {r} is outside the job (world size {job.world_size})")
    return r




def inventory(v: Any, name: str, job: Job) -> dict[int, list[int]]:
    """rank -> snapshot steps, as agents report them ({"0": [41, 42]})."""
    if not v:
        if v is None or v == {}:
            return {}
        raise MessageError(f"{name} must be an object of rank -> steps, got {show(v)}")
    if type(v) is not dict:
        raise MessageError(f"{name} must be an object of rank -> steps, got {show(v)}")
    out = {}
    for k, steps in v.items():
        r = _rank_key(k, name, job)
        if type(steps) is not list or len(steps) > MAX_LIST:
            raise MessageError(f"{name}[{r}] must be a list of steps, got {show(steps)}")
        for s in steps:     # the heartbeat's hot loop: a handful of steps per rank
            if type(s) is not int or s < 0 or s >= MAX_COUNT:
                raise MessageError(f"{name}[{r}]: step {show(s)} is not a non-negative integer")
        out[r] = steps
    return out


def _protection(v: Any, job: Job) -> dict[int, Figures]:
    """rank -> its protection figures (protocol/figures.py)."""
    if not v:
        if v is None or v == {}:
            return {}
        raise MessageError(f"protection must be an object of rank -> figures, got {show(v)}")
    if type(v) is not dict:
        raise MessageError(f"protection must be an object of rank -> figures, got {show(v)}")
    out = {}
    for k, figs in v.items():
        r = _rank_key(k, "protection", job)
        if type(figs) is not dict or len(figs) > 64:
            raise MessageError(f"protection[{r}] must be an object of figures, got {show(figs)}")
        try:
            out[r] = Figures.from_wire(figs)
        except ValueError as e:
            raise MessageError(f"protection[{r}].{e}") from None
    return out


def valid_fault(fault: Any) -> bool:
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

    def to_wire(self) -> dict[str, Any]:
        """What the agent sends (agents/agent.py builds it; parse_rejoin reads it back)."""
        return {"role": self.role, "slot": self.slot, "generation": self.generation,
                "restart_count": self.restart_count, "api": self.api, "frozen": self.frozen,
                "snapshots": self.snapshots, "replicas": self.replicas, "world": {"slots": self.world_slots}}


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
    nproc_per_node: int | None = None   # checked against the job's (a mismatch is refused by name)

    def to_wire(self) -> dict[str, Any]:
        """What the agent sends (agents/master_link.py; parse_register reads it back)."""
        out: dict[str, Any] = {"node_id": self.node_id, "host": self.host, "agent_pid": self.agent_pid,
                               "peer_addr": self.peer_addr, "fault_domain": self.fault_domain,
                               "rejoin": None if self.rejoin is None else self.rejoin.to_wire(), "nonce": self.nonce}
        if self.node_rank is not None:
            out["node_rank"] = self.node_rank
        if self.nproc_per_node is not None:
            out["nproc_per_node"] = self.nproc_per_node
        return out


# Heartbeat is not frozen (the others are): with a frozen __init__ (and a generator over worker_pids)
# parse_heartbeat took 6.0 us of CPU, now 4.7 us (timeit, 4 ranks x 2 steps + protection figures); by_rank, what it
# replaces, took 1.6 us
@dataclass(slots=True)
class Heartbeat:
    node_id: str
    token: str | None
    worker_pids: list[int]
    snapshots: dict[int, list[int]]
    replicas: dict[int, list[int]]
    protection: dict[int, Figures]
    api: bool
    warm_ready: bool = False      # a spare whose pre-started workers (and checkpoint I/O process) are up

    def to_wire(self) -> dict[str, Any]:
        """What the agent sends (agents/agent.py builds it; parse_heartbeat reads it back)."""
        out: dict[str, Any] = {"node_id": self.node_id, "token": self.token, "worker_pids": self.worker_pids,
                               "snapshots": self.snapshots, "replicas": self.replicas,
                               "protection": {r: f.to_wire() for r, f in self.protection.items()}, "api": self.api}
        if self.warm_ready:
            out["warm_ready"] = True
        return out


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


def obj(p: Any) -> Mapping[str, Any]:
    if not isinstance(p, dict):
        raise MessageError(f"the body must be a JSON object, got {show(p)}")
    return p


def token_field(p: Mapping[str, Any]) -> str | None:
    t = p.get("token")
    return None if t is None else str_field(t, "token", limit=128)


@overload
def slot_field(v: Any, name: str, job: Job, none: Literal[False]) -> int: ...


@overload
def slot_field(v: Any, name: str, job: Job, none: bool = True) -> int | None: ...


def slot_field(v: Any, name: str, job: Job, none: bool = True) -> int | None:
    if v is None and none:
        return None
    if type(v) is not int:
        raise MessageError(f"{name} must be a slot number, got {show(v)}")
    if not 0 <= v < job.nnodes:
        raise MessageError(f"{name} {v} is outside the job's slots 0..{job.nnodes - 1}")
    return v


def parse_register(p: Any, job: Job) -> Register:
    p = obj(p)
    node_id = str_field(get_field(p, "node_id"), "node_id", ident=True, empty=False)
    nproc = p.get("nproc_per_node")
    if nproc is not None and int_field(nproc, "nproc_per_node", 1, 1 << 16) != job.nproc_per_node:
        raise MessageError(f"this agent runs {nproc} workers per node but the job has {job.nproc_per_node}: "
                           "start it with the job's --nproc-per-node")
    r = p.get("rejoin")
    return Register(node_id=node_id, host=str_field(get_field(p, "host"), "host", empty=False),
                    agent_pid=int_field(get_field(p, "agent_pid"), "agent_pid", 0, 1 << 32),
                    peer_addr=addr_field(get_field(p, "peer_addr"), "peer_addr"),
                    fault_domain=str_field(p.get("fault_domain"), "fault_domain") or node_id,
                    rejoin=parse_rejoin(r, job) if r else None,
                    node_rank=int_field(p.get("node_rank"), "node_rank", 0, MAX_COUNT, none=True),
                    nonce=_nonce(p.get("nonce")), nproc_per_node=None if nproc is None else job.nproc_per_node)


def _nonce(v: Any) -> str | None:
    if v is None:
        return None
    nonce = str_field(v, "nonce", limit=128, ident=True)
    if len(nonce) < 16:
        raise MessageError(f"nonce must be 16 to 128 characters, got {len(nonce)}")
    return nonce


def parse_rejoin(r: Any, job: Job) -> Rejoin:
    if not isinstance(r, dict):
        raise MessageError(f"rejoin must be an object, got {show(r)}")
    role = r.get("role")
    if role not in ROLES:
        raise MessageError(f"rejoin.role must be one of {', '.join(ROLES)}, got {show(role)}")
    slot = slot_field(r.get("slot"), "rejoin.slot", job)
    if role == "active" and slot is None:
        raise MessageError("rejoin: an active node must name its slot")
    world = r.get("world") or {}
    if not isinstance(world, dict):
        raise MessageError(f"rejoin.world must be an object, got {show(world)}")
    ws = world.get("slots") or {}
    if not isinstance(ws, dict):
        raise MessageError(f"rejoin.world.slots must be an object of slot -> address, got {show(ws)}")
    world_slots = {}
    for k, a in ws.items():
        s = int(k) if isinstance(k, str) and k.isdigit() and len(k) < 12 else k
        world_slots[slot_field(s, "rejoin.world.slots key", job, none=False)] = addr_field(a, f"rejoin.world.slots[{k}]")
    return Rejoin(role=role, slot=slot if role == "active" else None,
                  generation=int_field(r.get("generation", 0), "rejoin.generation", 0, MAX_GENERATION),
                  restart_count=int_field(r.get("restart_count", 0), "rejoin.restart_count", 0, MAX_COUNT),
                  api=bool_field(r.get("api"), "rejoin.api"), frozen=bool_field(r.get("frozen"), "rejoin.frozen"),
                  snapshots=inventory(r.get("snapshots"), "rejoin.snapshots", job),
                  replicas=inventory(r.get("replicas"), "rejoin.replicas", job), world_slots=world_slots)


def parse_heartbeat(p: Any, job: Job) -> Heartbeat:
    p = obj(p)
    pids = p.get("worker_pids") or []
    if type(pids) is not list or len(pids) > MAX_LIST:
        raise MessageError(f"worker_pids must be a list of process ids, got {show(pids)}")
    for x in pids:
        if type(x) is not int or x < 0:
            raise MessageError(f"worker_pids must be a list of process ids, got {show(pids)}")
    return Heartbeat(node_id=str_field(get_field(p, "node_id"), "node_id", ident=True, empty=False), token=token_field(p),
                     worker_pids=pids, snapshots=inventory(p.get("snapshots"), "snapshots", job),
                     replicas=inventory(p.get("replicas"), "replicas", job),
                     protection=_protection(p.get("protection"), job), api=bool_field(p.get("api"), "api"),
                     warm_ready=bool_field(p.get("warm_ready"), "warm_ready"))


def parse_inject(p: Any, job: Job) -> Inject:
    p = obj(p)
    slot = slot_field(get_field(p, "slot"), "slot", job, none=False)
    fault = get_field(p, "fault")
    if not valid_fault(fault):
        raise MessageError(f"unknown fault {show(fault)}: one of {' | '.join(FAULTS)} | xid:N | partition:SECONDS | slow:FACTOR")
    return Inject(slot=slot, fault=fault)


def parse_drain(p: Any, job: Job) -> Drain:
    """`phoenixrun drain`: the node slot to move to a spare, and why (free text, for the events)."""
    p = obj(p)
    slot = slot_field(get_field(p, "slot"), "slot", job, none=False)
    reason = str_field(p.get("reason") or "operator request", "reason", limit=MAX_TEXT)
    return Drain(slot=slot, reason=reason)


def parse_poll(p: Any, newest_version: int) -> Poll:
    """A directive long-poll. The version an agent holds is one the master issued: -1 (none yet) up to
    the newest it has set; anything else is refused (a poll holding a future version would never be
    answered with anything newer)."""
    p = obj(p)
    version = p.get("version", -1)
    if type(version) is not int or not -1 <= version <= newest_version:
        raise MessageError(f"version {show(version)} was never issued by this master (newest {newest_version})")
    timeout = num_field(p.get("timeout", DEFAULT_POLL_TIMEOUT_S), "timeout")
    if not 0 <= timeout <= MAX_POLL_TIMEOUT:
        raise MessageError(f"timeout {timeout} is out of range [0, {MAX_POLL_TIMEOUT:g}]")
    return Poll(node_id=str_field(p.get("node_id", ""), "node_id", ident=True), token=token_field(p), version=version,
                timeout=timeout)
