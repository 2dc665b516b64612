"""The orders an agent gives its workers over the worker channel (agents/ipc.py -> runtime/agent_link.py), one
frozen dataclass each: the agent builds them (agents/supervisor.py, agents/executor.py), `to_wire` is the JSON
line it sends, and the worker's reader decodes each into the same type (`decode`) for the training thread
(runtime/api.py, runtime/recovery_client.py). Fields a worker does not know are ignored; a missing one is a
ValueError naming the order."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, TypeVar, Union

from phoenixrun.protocol.fields import optional, wire_fields
from phoenixrun.protocol.names import WorkerOp


@dataclass(frozen=True, kw_only=True)
class ChannelMessage:
    """A message of the worker channel, either way (protocol/worker_messages.py: the worker's to its agent)."""
    OP: ClassVar[WorkerOp]

    def to_wire(self) -> dict[str, Any]:
        return {"op": self.OP.value, **wire_fields(self)}


M = TypeVar("M", bound=ChannelMessage)


def decode_from(table: Mapping[str, type[M]], msg: Mapping[str, Any]) -> M | None:
    """`msg` as the type `table` names for its op; None for another op. Unknown fields are ignored, a missing
    one is a ValueError naming the message."""
    cls = table.get(str(msg.get("op")))
    if cls is None:
        return None
    known = {f.name for f in dataclasses.fields(cls)}
    try:
        return cls(**{k: v for k, v in msg.items() if k in known})
    except TypeError as e:
        raise ValueError(f"worker channel {msg.get('op')!r}: {e}") from None


@dataclass(frozen=True, kw_only=True)
class WorkerOrder(ChannelMessage):
    """An agent's order to its worker."""


@dataclass(frozen=True, kw_only=True)
class Assign(WorkerOrder):
    """A worker's rank and world: where its generation's process groups rendezvous and what it starts from."""
    OP = WorkerOp.ASSIGN
    rank: int
    local_rank: int
    slot: int
    nnodes: int
    nproc_per_node: int
    world_size: int
    generation: int
    store_prefix: str | None
    restart_count: int
    restore_step: int | None
    master_addr: str
    master_port: int
    tp: int
    pp: int
    run_id: str
    reshard: dict[str, Any] | None = None      # a shrink or grow's restart (runtime/reshard.py)


@dataclass(frozen=True, kw_only=True)
class Rebuild(WorkerOrder):
    """Recovery phase 2 for a live worker: join `generation` (the store moves with the master), restore the step."""
    OP = WorkerOp.REBUILD
    generation: int
    restore_step: int
    store_prefix: str | None
    master_addr: str
    master_port: int


@dataclass(frozen=True, kw_only=True)
class Quiesce(WorkerOrder):
    """Recovery phase 1: stop after the current step (a drain's: at step boundary `at_step`)."""
    OP = WorkerOp.QUIESCE
    generation: int
    at_step: int | None = optional()


@dataclass(frozen=True, kw_only=True)
class ChannelClosed(WorkerOrder):
    """Inside the worker: its link to the agent closed."""
    OP = WorkerOp.AGENT_GONE


ORDERS: dict[str, type[WorkerOrder]] = {o.OP.value: o for o in (Assign, Rebuild, Quiesce, ChannelClosed)}
AnyWorkerOrder = Union[Assign, Rebuild, Quiesce, ChannelClosed]


def decode(msg: Mapping[str, Any]) -> WorkerOrder | None:
    """An order off the channel as its type; None for an op that is not one of these orders."""
    return decode_from(ORDERS, msg)
