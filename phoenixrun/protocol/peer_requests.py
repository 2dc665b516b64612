"""What agents ask each other over the peer port, one frozen dataclass per request: the asking agent builds it and
agents/peer.py's client frames its `to_header()`; the serving agent's handler decodes the header once
(`from_header`) before it acts. A header that is not one (a field missing or of the wrong type) is a ValueError
naming the field, which the peer server answers as a refusal - the asking agent sees it, the serving agent goes on.

- `SlotRequest`: a replica to store (`put`, the payload is the replicated prefix of the rank's slot) or a rank's
  private or shared state of a step to send back (`get_private`, `get_shared`: agents/replicator.py);
- `RelayPoll` / `RelayReply`: a child's directive long-poll at its relay and the relay's answer
  (agents/relay.py; the protocol: protocol/relay.py);
- `RelayReport` / `RelayReportReply`: a child's ack sent through its relay, and the master's reply to it;
- `Ping`: are you running (agents/neighbour_watch.py's ring watch; the reply says `pong`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Protocol

from phoenixrun.protocol.names import PeerOp
from phoenixrun.protocol.relay import BEAT_OP, RELAY_OP, RELAY_POLL_S, REPORT_OP

SLOT_OPS = (PeerOp.PUT, PeerOp.GET_PRIVATE, PeerOp.GET_SHARED)


class PeerRequest(Protocol):
    """Anything agents/peer.py's client sends: its frame's header (the client adds the secret and the size)."""
    def to_header(self) -> dict[str, Any]: ...


def _int(h: Mapping[str, Any], name: str, low: int) -> int:
    v = h.get(name)
    if type(v) is not int or v < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {str(v)[:40]!r}")
    return v


@dataclass(frozen=True)
class SlotRequest:
    op: PeerOp
    rank: int
    step: int

    def to_header(self) -> dict[str, Any]:
        return {"op": self.op.value, "rank": self.rank, "step": self.step}

    @classmethod
    def from_header(cls, h: Mapping[str, Any]) -> SlotRequest:
        op = next((o for o in SLOT_OPS if o.value == h.get("op")), None)
        if op is None:
            raise ValueError(f"op must be one of {', '.join(SLOT_OPS)}, got {str(h.get('op'))[:40]!r}")
        return cls(op, _int(h, "rank", 0), _int(h, "step", 0))


@dataclass(frozen=True)
class RelayPoll:
    OP: ClassVar[str] = RELAY_OP
    node_id: str
    key: str                # the child's poll key (protocol/relay.py's poll_key), not its token
    version: int            # the newest directive version it holds (-1: none)
    timeout: float = RELAY_POLL_S

    def to_header(self) -> dict[str, Any]:
        return {"op": self.OP, "node_id": self.node_id, "key": self.key, "version": self.version,
                "timeout": self.timeout}

    @classmethod
    def from_header(cls, h: Mapping[str, Any]) -> RelayPoll:
        node_id, key, timeout = h.get("node_id"), h.get("key"), h.get("timeout", RELAY_POLL_S)
        if not isinstance(node_id, str) or not isinstance(key, str):
            raise ValueError("node_id and key must be strings")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout:
            raise ValueError(f"timeout must be a number >= 0, got {str(timeout)[:40]!r}")
        return cls(node_id, key, _int(h, "version", -1), float(timeout))


@dataclass(frozen=True)
class RelayReply:
    """A relay's answer: the directive's version and the master's seal of its bytes (the frame's payload), or
    nothing newer came within the poll's timeout (version None)."""
    version: int | None = None
    mac: str | None = None

    def to_header(self) -> dict[str, Any]:
        return {"noop": True} if self.version is None else {"version": self.version, "mac": self.mac}

    @classmethod
    def from_header(cls, h: Mapping[str, Any]) -> RelayReply:
        if h.get("noop"):
            return cls()
        mac = h.get("mac")
        return cls(_int(h, "version", 0), mac if isinstance(mac, str) else None)


@dataclass(frozen=True)
class RelayReport:
    """A child's ack for its relay to send on (the frame's payload: the report's wire bytes, sealed by `mac`)."""
    OP: ClassVar[str] = REPORT_OP
    node_id: str
    key: str                # the child's poll key, as in RelayPoll
    mac: str                # protocol/relay.py's report_seal of the payload, under the child's token

    def to_header(self) -> dict[str, Any]:
        return {"op": self.OP, "node_id": self.node_id, "key": self.key, "mac": self.mac}

    @classmethod
    def from_header(cls, h: Mapping[str, Any]) -> RelayReport:
        node_id, key, mac = h.get("node_id"), h.get("key"), h.get("mac")
        if not isinstance(node_id, str) or not isinstance(key, str) or not isinstance(mac, str):
            raise ValueError("node_id, key and mac must be strings")
        return cls(node_id, key, mac)


@dataclass(frozen=True)
class RelayReportReply:
    """The relay's answer: the master's reply to that one report (protocol/replies.py's report reply, or
    {"error", "reason"}: the master refused it)."""
    reply: dict[str, Any]

    def to_header(self) -> dict[str, Any]:
        return {"reply": self.reply}

    @classmethod
    def from_header(cls, h: Mapping[str, Any]) -> RelayReportReply:
        reply = h.get("reply")
        if not isinstance(reply, dict):
            raise ValueError(f"reply must be an object, got {str(reply)[:40]!r}")
        return cls(reply)


@dataclass(frozen=True)
class RelayBeat:
    """A child's heartbeat for its relay to send on (the payload: the heartbeat's wire bytes, `seq` in them)."""
    OP: ClassVar[str] = BEAT_OP
    node_id: str
    key: str                # the child's poll key, as in RelayPoll
    seq: int                # the payload's `seq` (the relay keeps the newest)
    mac: str                # protocol/relay.py's beat_seal of the payload, under the child's token

    def to_header(self) -> dict[str, Any]:
        return {"op": self.OP, "node_id": self.node_id, "key": self.key, "seq": self.seq, "mac": self.mac}

    @classmethod
    def from_header(cls, h: Mapping[str, Any]) -> RelayBeat:
        node_id, key, seq, mac = h.get("node_id"), h.get("key"), h.get("seq"), h.get("mac")
        if not isinstance(node_id, str) or not isinstance(key, str) or not isinstance(mac, str):
            raise ValueError("node_id, key and mac must be strings")
        if type(seq) is not int or seq < 0:
            raise ValueError(f"seq must be a non-negative integer, got {str(seq)[:40]!r}")
        return cls(node_id, key, seq, mac)


@dataclass(frozen=True)
class RelayBeatReply:
    """The relay's answer, at once: the highest `seq` of this child's the master confirmed (-1: none yet) and the
    master's reply to it if not handed over before (None otherwise; {"error", "reason"}: the master refused it)."""
    confirmed: int
    reply: dict[str, Any] | None = None

    def to_header(self) -> dict[str, Any]:
        return {"confirmed": self.confirmed, "reply": self.reply}

    @classmethod
    def from_header(cls, h: Mapping[str, Any]) -> RelayBeatReply:
        confirmed, reply = h.get("confirmed"), h.get("reply")
        if type(confirmed) is not int or (reply is not None and not isinstance(reply, dict)):
            raise ValueError("want confirmed (an integer) and reply (an object or null)")
        return cls(confirmed, reply)


@dataclass(frozen=True)
class Ping:
    OP: ClassVar[str] = PeerOp.PING.value

    def to_header(self) -> dict[str, Any]:
        return {"op": self.OP}
