"""The orders the master gives its agents: one frozen dataclass per `names.Command`, built by the master
(control/orders.py), encoded once at the edge (control/directives.py's board: `to_wire`), decoded once as an
agent receives it (`decode`: agents/master_link.py) - the master, the agents and sim/swarm.py share these types.

A directive on the wire is one JSON object: the order's fields, `command`, the envelope every directive carries
(`version`, `generation`, `store_prefix`, `master_epoch`) and what a node gets of its own (`Assignment`: its slot,
its world, the sources of a restore, a re-partition). Decoding ignores names it does not know (a master of
another version) and turns an unknown command into `Unknown` (nothing to do); a field of the wrong type is a
ValueError naming it."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Union

from phoenixrun.protocol.codec import int_keys
from phoenixrun.protocol.fields import optional as _absent
from phoenixrun.protocol.fields import wire_fields
from phoenixrun.protocol.names import Command
from phoenixrun.protocol.reshard import NodeReshard
from phoenixrun.protocol.restore import RankSource


def _opt_int(m: Mapping[str, Any], name: str) -> int | None:
    v = m.get(name)
    if v is None:
        return None
    if type(v) is not int:
        raise ValueError(f"directive field {name!r} must be an integer, got {v!r}")
    return v


@dataclass(frozen=True)
class World:
    """What a node needs of the world: the addresses of the slots holding its ranks' replicas (`slots`), which
    slots hold each of its ranks' replicas (`placement`: rank -> slots) and the master's store port."""
    slots: dict[int, str]
    placement: dict[int, list[int]]
    store_port: int | None = None

    def holders(self, rank: int) -> list[int]:
        return self.placement.get(rank, [])

    def to_wire(self) -> dict[str, Any]:
        return {"slots": self.slots, "placement": self.placement, "store_port": self.store_port}

    @classmethod
    def from_wire(cls, m: Mapping[str, Any]) -> World:
        return cls(int_keys(m.get("slots"), "world.slots"), int_keys(m.get("placement"), "world.placement"),
                   _opt_int(m, "store_port"))


@dataclass(frozen=True)
class Assignment:
    """What one node's directive carries of its own (the others of a broadcast share one encoding)."""
    slot: int | None = None
    world: World | None = None
    fetch: dict[int, RankSource] | None = None     # a restore: rank -> where to fetch its state from
    reshard: NodeReshard | None = None             # a restart that re-partitions (control/reshape.py's reshard_for)
    nnodes: int | None = None                      # the job shrank or grew

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.slot is not None:
            out["slot"] = self.slot
        if self.world is not None:
            out["world"] = self.world.to_wire()
        if self.fetch is not None:
            out["fetch"] = {r: s.to_wire() for r, s in self.fetch.items()}
        if self.reshard is not None:
            out["reshard"] = self.reshard.to_wire()
        if self.nnodes is not None:
            out["nnodes"] = self.nnodes
        return out

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Assignment:
        world, fetch = d.get("world"), d.get("fetch")
        sources: dict[int, Any] = int_keys(fetch, "fetch")
        return cls(slot=_opt_int(d, "slot"), world=World.from_wire(world) if isinstance(world, Mapping) else None,
                   fetch=None if fetch is None else {r: RankSource.from_wire(s) for r, s in sources.items()},
                   reshard=None if d.get("reshard") is None else NodeReshard.from_wire(d["reshard"]),
                   nnodes=_opt_int(d, "nnodes"))


@dataclass(frozen=True, kw_only=True)
class Order:
    COMMAND: ClassVar[Command]

    def to_wire(self) -> dict[str, Any]:
        return {"command": self.COMMAND.value, **wire_fields(self)}


@dataclass(frozen=True, kw_only=True)
class Noop(Order):
    """The long-poll expired with nothing new."""
    COMMAND = Command.NOOP


@dataclass(frozen=True, kw_only=True)
class Wait(Order):
    """A spare: stand by; `warm`: pre-start workers without a rank."""
    COMMAND = Command.WAIT
    warm: bool = False


@dataclass(frozen=True, kw_only=True)
class Run(Order):
    """Start this slot's workers (`resume`: keep them, a recovery is over)."""
    COMMAND = Command.RUN
    restart_count: int | None = _absent()
    restore_step: int | None = _absent()
    resume: bool | None = _absent()


@dataclass(frozen=True, kw_only=True)
class Restart(Order):
    """Kill and start the workers: from `restore_step` on disk (None: from scratch), on `store_port` if given."""
    COMMAND = Command.RESTART
    restart_count: int | None = _absent()
    restore_step: int | None = None
    store_port: int | None = _absent()


@dataclass(frozen=True, kw_only=True)
class Quiesce(Order):
    """Recovery phase 1: stop after the current step (a drain's: at step boundary `at_step`), report `quiesced`."""
    COMMAND = Command.QUIESCE
    at_step: int | None = _absent()


@dataclass(frozen=True, kw_only=True)
class Restore(Order):
    """Recovery phase 2: fetch the plan's state (the node's `Assignment.fetch`), rebuild, report `resumed`."""
    COMMAND = Command.RESTORE
    restart_count: int | None = _absent()
    restore_step: int


@dataclass(frozen=True, kw_only=True)
class Stop(Order):
    """Exit with `exit_code`; `fenced`: replaced while away, never rejoin; `job_end`: the job is over."""
    COMMAND = Command.STOP
    exit_code: int = 0
    reason: str | None = _absent()
    job_end: bool | None = _absent()
    fenced: bool | None = _absent()


@dataclass(frozen=True, kw_only=True)
class Unknown(Order):
    """A command this agent does not know (a newer master's): nothing to do."""
    COMMAND = Command.NOOP
    name: str = ""


ORDERS: dict[Command, type[Order]] = {o.COMMAND: o for o in (Noop, Wait, Run, Restart, Quiesce, Restore, Stop)}
AnyOrder = Union[Noop, Wait, Run, Restart, Quiesce, Restore, Stop, Unknown]


@dataclass(frozen=True)
class Directive:
    """A directive as an agent received it: the order, its envelope and what the node got of its own."""
    order: Order
    version: int = -1
    generation: int | None = None
    store_prefix: str | None = None
    master_epoch: int | None = None
    own: Assignment = field(default_factory=Assignment)

    @property
    def command(self) -> Command:
        return self.order.COMMAND


def decode(d: Mapping[str, Any]) -> Directive:
    """A directive off the wire (a JSON object) as the agent's readers want it."""
    name = d.get("command")
    cls = next((o for c, o in ORDERS.items() if c.value == name), None)
    if cls is None:
        order: Order = Unknown(name=str(name))
    else:
        known = {f.name for f in dataclasses.fields(cls)}
        try:
            order = cls(**{k: v for k, v in d.items() if k in known})
        except TypeError as e:
            raise ValueError(f"directive {name!r}: {e}") from None
    prefix = d.get("store_prefix")
    version = _opt_int(d, "version")
    return Directive(order, version=-1 if version is None else version, generation=_opt_int(d, "generation"),
                     store_prefix=prefix if isinstance(prefix, str) else None,
                     master_epoch=_opt_int(d, "master_epoch"), own=Assignment.from_wire(d))
