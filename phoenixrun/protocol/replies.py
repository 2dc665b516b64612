"""The master's answers to an agent's registration and heartbeats, one frozen dataclass each: the master builds them
(control/handlers.py), `to_wire` is the JSON it sends (the same fields as before they were types), and the agent
decodes each into the same type (agents/master_link.py) - nothing reads a reply as a dict past that edge.

- `Admitted`: a registration the job has a place for: the node's role and slot, the token its later calls carry,
  the job's terms (`JobTerms`);
- `TurnedAway`: no place for it (a taken --node-rank, spares enough), or a node replaced while it was away
  (`fenced`: its agent stops its workers and exits, whatever it asked - control/state.py::fence_reply);
- `HeartbeatReply`: alive and heard; faults to inject, the directive tree (`RelayLink`) and the ring neighbours
  to watch (`watch`);
- `Heard`: a report taken (or `ignored`, with why: one about workers of a generation already replaced);
- `Injected`, `Draining`: an operator's `phoenixrun inject` / `phoenixrun drain` taken (decoded by the CLI).

Every answer an agent acts on names the master's lease epoch (`master_epoch`): agents ignore a deposed master's.
A reply with a field of the wrong type is a ValueError naming it (the agent logs it and asks again)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

FAILED = "failed"       # the role a turned-away node gets (control/state.py Role.FAILED)
ROLES = ("active", "spare")
Watch = tuple[tuple[str, str], ...]     # (node id, peer address) of each ring neighbour a node pings


def _typed(m: Mapping[str, Any], name: str, kind: type | tuple[type, ...], where: str, *, none: bool = False) -> Any:
    v = m.get(name)
    if (v is None and none) or (isinstance(v, kind) and not (isinstance(v, bool) and kind is int)):
        return v
    raise ValueError(f"{where}: {name} must be {getattr(kind, '__name__', kind)}{' or null' if none else ''}, "
                     f"got {v!r}")


def _object(m: Any, where: str) -> Mapping[str, Any] | None:
    """An optional nested object of a reply: None if absent, else a mapping (a ValueError naming it otherwise)."""
    if m is not None and not isinstance(m, Mapping):
        raise ValueError(f"{where} must be an object, got {m!r}")
    return m


def _epoch(m: Mapping[str, Any], where: str) -> int | None:
    v: int | None = _typed(m, "master_epoch", int, where, none=True)
    return v


@dataclass(frozen=True)
class PersistTerms:
    """--persist-every's checkpoints, as each agent writes its ranks' part (agents/persister.py)."""
    dir: str
    every: int
    keep: int
    world_size: int

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, raw: Any) -> PersistTerms | None:
        w = "registration reply persist"
        m = _object(raw, w)
        if m is None:
            return None
        return cls(_typed(m, "dir", str, w), _typed(m, "every", int, w), _typed(m, "keep", int, w),
                   _typed(m, "world_size", int, w))


@dataclass(frozen=True)
class JobTerms:
    """What every node of the job is told when it registers; `nnodes` changes when the job shrinks or grows
    (a directive says so: agents/node.py)."""
    run_id: str
    store_port: int
    nnodes: int
    nproc_per_node: int
    tp: int
    pp: int
    max_restarts: int
    persist: PersistTerms | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "store_port": self.store_port, "nnodes": self.nnodes,
                "nproc_per_node": self.nproc_per_node, "tp": self.tp, "pp": self.pp,
                "max_restarts": self.max_restarts, "persist": None if self.persist is None else self.persist.to_wire()}

    @classmethod
    def from_wire(cls, m: Mapping[str, Any]) -> JobTerms:
        w = "registration reply"
        return cls(_typed(m, "run_id", str, w), _typed(m, "store_port", int, w), _typed(m, "nnodes", int, w),
                   _typed(m, "nproc_per_node", int, w), _typed(m, "tp", int, w), _typed(m, "pp", int, w),
                   _typed(m, "max_restarts", int, w), PersistTerms.from_wire(m.get("persist")))


@dataclass(frozen=True)
class Admitted:
    role: str                   # "active" | "spare"
    slot: int | None
    token: str
    terms: JobTerms
    master_epoch: int | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"role": self.role, "slot": self.slot, "token": self.token, **self.terms.to_wire(),
                "master_epoch": self.master_epoch}


@dataclass(frozen=True)
class TurnedAway:
    reason: str
    exit_code: int | None = None    # what the agent exits with (None: 0 on a rejoin, 2 on a first registration)
    fenced: bool = False            # replaced while away: a stop order too (its directive poll gets one)
    master_epoch: int | None = None

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": FAILED, "slot": None, "reason": self.reason}
        if self.fenced:
            out.update(fenced=True, command="stop")
        if self.exit_code is not None:
            out["exit_code"] = self.exit_code
        if self.master_epoch is not None:
            out["master_epoch"] = self.master_epoch
        return out

    @classmethod
    def from_wire(cls, m: Mapping[str, Any]) -> TurnedAway:
        w = "refusal"
        return cls(str(m.get("reason") or "refused by the master"), _typed(m, "exit_code", int, w, none=True),
                   m.get("fenced") is True, _epoch(m, w))


def registration_reply(m: Any) -> Admitted | TurnedAway:
    """The master's answer to a registration or a rejoin, decoded."""
    if not isinstance(m, Mapping):
        raise ValueError(f"registration reply must be an object, got {m!r}")
    if m.get("role") == FAILED or m.get("fenced") is True:
        return TurnedAway.from_wire(m)
    if m.get("role") not in ROLES:
        raise ValueError(f"registration reply: role must be one of {', '.join(ROLES)} or {FAILED}, "
                         f"got {m.get('role')!r}")
    w = "registration reply"
    return Admitted(m["role"], _typed(m, "slot", int, w, none=True), _typed(m, "token", str, w), JobTerms.from_wire(m),
                    _epoch(m, w))


@dataclass(frozen=True)
class RelayLink:
    """This node's place in the directive tree (control/relaying.py): its relay's peer address (None: it polls
    the master) and node id, and whether it serves children of its own. beats: how long a child may go without the
    master confirming a heartbeat it sent through its relay before it heartbeats the master directly (None: it
    heartbeats the master directly; protocol/relay.py's beat_route)."""
    parent: str | None
    via: str | None
    serves: bool
    beats: float | None = None

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"parent": self.parent, "via": self.via, "serves": self.serves}
        if self.beats is not None:
            out["beats"] = self.beats
        return out

    @classmethod
    def from_wire(cls, raw: Any) -> RelayLink | None:
        w = "heartbeat reply relay"
        m = _object(raw, w)
        if m is None:
            return None
        parent = _typed(m, "parent", str, w, none=True)
        beats = _typed(m, "beats", (int, float), w, none=True)
        return cls(parent or None, _typed(m, "via", str, w, none=True), m.get("serves") is True,
                   float(beats) if beats is not None and beats > 0 else None)


@dataclass(frozen=True)
class HeartbeatReply:
    role: str
    inject: tuple[str, ...] = ()                # faults `phoenixrun inject` queued for this node
    relay: RelayLink | None = None              # None while relaying has never been on
    watch: Watch = ()                           # the ring neighbours it pings (agents/neighbour_watch.py)
    master_epoch: int | None = None

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ok": True, "role": self.role, "inject": list(self.inject),
                               "master_epoch": self.master_epoch, "watch": [list(w) for w in self.watch]}
        if self.relay is not None:
            out["relay"] = self.relay.to_wire()
        return out

    @classmethod
    def from_wire(cls, m: Mapping[str, Any]) -> HeartbeatReply:
        w = "heartbeat reply"
        inject, watch = m.get("inject") or [], m.get("watch") or []
        if not isinstance(inject, list) or not all(isinstance(f, str) for f in inject):
            raise ValueError(f"{w}: inject must be a list of fault names, got {inject!r}")
        if not isinstance(watch, list) or not all(isinstance(x, list) and len(x) == 2
                                                  and all(isinstance(s, str) for s in x) for x in watch):
            raise ValueError(f"{w}: watch must be a list of [node id, peer address], got {watch!r}")
        return cls(str(m.get("role", "")), tuple(inject), RelayLink.from_wire(m.get("relay")),
                   tuple((x[0], x[1]) for x in watch), _epoch(m, w))


def heartbeat_reply(m: Any) -> HeartbeatReply | TurnedAway:
    """The master's answer to a heartbeat, decoded: heard, or fenced."""
    if not isinstance(m, Mapping):
        raise ValueError(f"heartbeat reply must be an object, got {m!r}")
    if m.get("fenced") is True:
        return TurnedAway.from_wire(m)
    return HeartbeatReply.from_wire(m)


@dataclass(frozen=True)
class Heard:
    ignored: str | None = None      # why a report was moot (a stale generation's), None: taken in

    def to_wire(self) -> dict[str, Any]:
        return {"ok": True} if self.ignored is None else {"ok": True, "ignored": self.ignored}


def report_reply(m: Any) -> Heard | TurnedAway:
    """The master's answer to a report, decoded: heard, or fenced."""
    if not isinstance(m, Mapping):
        raise ValueError(f"report reply must be an object, got {m!r}")
    if m.get("fenced") is True:
        return TurnedAway.from_wire(m)
    if m.get("ok") is not True:
        raise ValueError(f"report reply: neither ok nor fenced: {m!r}")
    return Heard(_typed(m, "ignored", str, "report reply", none=True))


@dataclass(frozen=True)
class Injected:
    """`phoenixrun inject` taken: the fault is queued for `node`, which gets it with its next heartbeat reply."""
    node: str

    def to_wire(self) -> dict[str, Any]:
        return {"ok": True, "node": self.node}

    @classmethod
    def from_wire(cls, m: Any) -> Injected:
        if not isinstance(m, Mapping):
            raise ValueError(f"inject reply must be an object, got {m!r}")
        return cls(_typed(m, "node", str, "inject reply"))


@dataclass(frozen=True)
class Draining:
    """`phoenixrun drain` accepted: `node`'s ranks (slot `slot`) move to a spare at a step boundary."""
    node: str
    slot: int

    def to_wire(self) -> dict[str, Any]:
        return {"ok": True, "node": self.node, "slot": self.slot}

    @classmethod
    def from_wire(cls, m: Any) -> Draining:
        if not isinstance(m, Mapping):
            raise ValueError(f"drain reply must be an object, got {m!r}")
        return cls(_typed(m, "node", str, "drain reply"), _typed(m, "slot", int, "drain reply"))
