"""The orders an agent gives its workers over the worker channel (agents/ipc.py -> runtime/agent_link.py), one
frozen dataclass each: the agent builds them (agents/supervisor.py, agents/executor.py), `to_wire` is the JSON
line it sends, and the worker's reader decodes each into the same type (`decode`) for the training thread
(runtime/api.py, runtime/recovery_client.py). Fields a worker does not know are ignored; a missing one is a
ValueError naming the order."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, TypeVar, Union

from phoenixrun.protocol.fields import optional, wire_fields
from phoenixrun.protocol.names import WorkerOp
from phoenixrun.protocol.reshard import WorkerReshard


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
    reshard: WorkerReshard | None = None       # a shrink or grow's restart (runtime/reshard.py)

    def __post_init__(self) -> None:
        if self.reshard is not None and not isinstance(self.reshard, WorkerReshard):     # off the wire
            object.__setattr__(self, "reshard", WorkerReshard.from_wire(self.reshard))

    def to_wire(self) -> dict[str, Any]:
        return {**super().to_wire(), "reshard": None if self.reshard is None else self.reshard.to_wire()}


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


@dataclass(frozen=True, kw_only=True)
class Committed(WorkerOrder):
    """The snapshot of `step` is sealed in its slot and replicated (`h2h_s`: the replication's time)."""
    OP = WorkerOp.COMMITTED
    step: int
    h2h_s: float | None = optional()
    replicated_bytes: int = 0


@dataclass(frozen=True, kw_only=True)
class CommitFailed(WorkerOrder):
    """The snapshot of `step` could not be committed (its replication failed, or a recovery froze the node)."""
    OP = WorkerOp.COMMIT_FAILED
    step: int
    error: str = "replication failed"


@dataclass(frozen=True, kw_only=True)
class Ping(WorkerOrder):
    """The hang watchdog's liveness probe: answered with a pong from the worker's reader thread."""
    OP = WorkerOp.PING


@dataclass(frozen=True, kw_only=True)
class AbortComm(WorkerOrder):
    """Fault drill (`phoenixrun inject --fault comm-timeout|partition`): this worker's collectives fail for real."""
    OP = WorkerOp.ABORT_COMM


@dataclass(frozen=True, kw_only=True)
class PoisonLoss(WorkerOrder):
    """Fault drill (`--fault nan`): the next loss the script hands to job.observe_loss() is NaN."""
    OP = WorkerOp.POISON_LOSS


@dataclass(frozen=True, kw_only=True)
class Slow(WorkerOrder):
    """Fault drill (`--fault slow:FACTOR`): each step's compute takes `factor` times as long (a straggler)."""
    OP = WorkerOp.SLOW
    factor: float = 1.0


# ------------------------------------------------------------------ replies to a worker's requests
@dataclass(frozen=True, kw_only=True)
class Reply(WorkerOrder):
    """The answer to a worker's request (protocol/worker_messages.py's `Request`), carrying its `id`; `error`: it
    was refused (`unavailable`: the state it asks for will not come from the fetch under way). Each request names
    the reply type it is answered with (`Request.REPLY`); the worker decodes the reply as that type."""
    OP = WorkerOp.REPLY
    id: int | None = None
    error: str | None = optional()
    unavailable: bool | None = optional()


@dataclass(frozen=True, kw_only=True)
class Paths(Reply):
    """The answer to `alloc` and `slots`: the paths of the rank's snapshot slots."""
    paths: list[str] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class SlotGrant(Reply):
    """The answer to `write`: the slot to write the next snapshot into, at `path`, `nbytes` large."""
    slot: int = -1
    path: str = ""
    nbytes: int = 0


ORDERS: dict[str, type[WorkerOrder]] = {o.OP.value: o for o in (Assign, Rebuild, Quiesce, ChannelClosed, Committed,
                                                                 CommitFailed, Ping, AbortComm, PoisonLoss, Slow)}
AnyWorkerOrder = Union[Assign, Rebuild, Quiesce, ChannelClosed, Committed, CommitFailed, Ping, AbortComm, PoisonLoss,
                       Slow]


def decode(msg: Mapping[str, Any]) -> WorkerOrder | None:
    """An order off the channel as its type; None for an op that is not one of these orders (a reply is decoded
    by its request, as the reply type it names: worker_messages.Request.decode_reply)."""
    return decode_from(ORDERS, msg)

