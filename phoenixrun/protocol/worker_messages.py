"""What a worker tells its agent over the worker channel (runtime/ -> agents/worker_ops.py), one frozen dataclass
per op: the runtime builds them, AgentLink.send / request encode them at the edge, and the agent's op table
decodes each into the same type before its handler runs (`decode`). The agent's orders the other way are
protocol/worker_orders.py."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Mapping, TypeVar, Union, cast

from phoenixrun.protocol.fields import optional
from phoenixrun.protocol.figures import Figures
from phoenixrun.protocol.names import WorkerOp
from phoenixrun.protocol.timings import Timings
from phoenixrun.protocol.worker_orders import ChannelMessage, Paths, Reply, SlotGrant, decode_from

R = TypeVar("R", bound=Reply)


@dataclass(frozen=True, kw_only=True)
class WorkerMessage(ChannelMessage):
    """A worker's message to its agent."""


@dataclass(frozen=True, kw_only=True)
class Hello(WorkerMessage):
    """A worker announces its local rank and pid (`api`: it uses the phoenixrun API)."""
    OP = WorkerOp.HELLO
    local_rank: int
    pid: int | None = None
    api: bool = False


@dataclass(frozen=True, kw_only=True)
class Request(WorkerMessage, Generic[R]):
    """A message the agent answers with a reply of type `REPLY` carrying its `id` (AgentLink.request sets it)."""
    REPLY: ClassVar[type[Reply]] = Reply
    id: int | None = None

    def decode_reply(self, msg: Mapping[str, Any]) -> R:
        """The agent's answer off the channel as this request's reply type (a ValueError if it is not one)."""
        reply = decode_from({WorkerOp.REPLY.value: self.REPLY}, msg)
        if reply is None:
            raise ValueError(f"worker channel: {msg.get('op')!r} where the reply to {self.OP.value!r} was expected")
        return cast(R, reply)       # REPLY is R by the subclass's declaration (Alloc(Request[Paths]): REPLY = Paths)


@dataclass(frozen=True, kw_only=True)
class Alloc(Request[Paths]):
    """Request: shared-memory snapshot slots for this many bytes (reply: `Paths`)."""
    OP = WorkerOp.ALLOC
    REPLY = Paths
    nbytes: int


@dataclass(frozen=True, kw_only=True)
class Slots(Request[Paths]):
    """Request: the paths of the slots already allocated (reply: `Paths`)."""
    OP = WorkerOp.SLOTS
    REPLY = Paths


@dataclass(frozen=True, kw_only=True)
class Write(Request[SlotGrant]):
    """Request: a slot to write the next snapshot into (reply: `SlotGrant`)."""
    OP = WorkerOp.WRITE
    REPLY = SlotGrant
    nbytes: int = 0


@dataclass(frozen=True, kw_only=True)
class Written(WorkerMessage):
    """A snapshot of `step` is in slot `slot`: replicate and commit it."""
    OP = WorkerOp.WRITTEN
    slot: int
    step: int
    stats: Figures = field(default_factory=Figures)

    def __post_init__(self) -> None:
        if isinstance(self.stats, Mapping):     # off the wire
            object.__setattr__(self, "stats", Figures.from_wire(self.stats))

    def to_wire(self) -> dict[str, Any]:
        return {**super().to_wire(), "stats": self.stats.to_wire()}


@dataclass(frozen=True, kw_only=True)
class Progress(WorkerMessage):
    """A step began; `step_s`: the longest step since the last progress (the quiesce grace's input)."""
    OP = WorkerOp.PROGRESS
    step: int
    step_s: float | None = optional()


@dataclass(frozen=True, kw_only=True)
class Pong(WorkerMessage):
    """The answer to a ping (the hang watchdog)."""
    OP = WorkerOp.PONG


@dataclass(frozen=True, kw_only=True)
class Quiesced(WorkerMessage):
    """Stopped for the recovery of `generation`; `next_step`: the step it would run next."""
    OP = WorkerOp.QUIESCED
    generation: int
    next_step: int = 0


@dataclass(frozen=True, kw_only=True)
class Resumed(WorkerMessage):
    """Rebuilt in `generation`, with the phases it measured."""
    OP = WorkerOp.RESUMED
    generation: int | None = None
    timings: Timings = field(default_factory=Timings)

    def __post_init__(self) -> None:
        if isinstance(self.timings, Mapping):     # off the wire
            object.__setattr__(self, "timings", Timings.from_wire(self.timings))

    def to_wire(self) -> dict[str, Any]:
        return {**super().to_wire(), "timings": self.timings.to_wire()}


@dataclass(frozen=True, kw_only=True)
class Observed(WorkerMessage):
    """A fault the worker saw itself, at `step`: a collective failed, a non-finite loss, the script's exception."""
    OP = WorkerOp.ERROR
    text: str = ""
    step: int | None = None


@dataclass(frozen=True, kw_only=True)
class CommError(Observed):
    OP = WorkerOp.COMM_ERROR


@dataclass(frozen=True, kw_only=True)
class NanLoss(Observed):
    OP = WorkerOp.NAN_LOSS


@dataclass(frozen=True, kw_only=True)
class ScriptError(Observed):
    OP = WorkerOp.ERROR


@dataclass(frozen=True, kw_only=True)
class ProtectionMode(WorkerMessage):
    """The adaptive protection interval changed to `every`, from `step` on."""
    OP = WorkerOp.PROTECTION_MODE
    every: int
    step: int | None = None


@dataclass(frozen=True, kw_only=True)
class Layout(WorkerMessage):
    """Rank 0 at protect(): the job's DTensor peer set (redundancy.PeerSet's wire form), or None."""
    OP = WorkerOp.LAYOUT
    peers: dict[str, Any] | None = None


MESSAGES: dict[str, type[WorkerMessage]] = {
    m.OP.value: m for m in (Hello, Alloc, Slots, Write, Written, Progress, Pong, Quiesced, Resumed, CommError,
                            NanLoss, ScriptError, ProtectionMode, Layout)}
AnyWorkerMessage = Union[Hello, Alloc, Slots, Write, Written, Progress, Pong, Quiesced, Resumed, CommError, NanLoss,
                         ScriptError, ProtectionMode, Layout]


def decode(msg: Mapping[str, Any]) -> WorkerMessage | None:
    """A worker's message off the channel as its type; None for an op that is not one of them."""
    return decode_from(MESSAGES, msg)
