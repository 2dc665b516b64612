"""An agent's part in the directive fan-out (protocol/relay.py): as a relay, the cache of its children's sealed
directives that it serves them over the peer transport, and the batcher that sends the master their acks in one
request; as a child, the poll of its relay, which accepts only what the master sealed for this node, and the
send of its acks through it.

The relay forwards bytes: it reads the version and generation the master put beside each directive, never the
directive itself, and it cannot forge one (the seal is keyed by the child's token, which it does not hold).
"""
from __future__ import annotations

import hmac
import json
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from phoenixrun.protocol.peer_requests import RelayPoll, RelayReply, RelayReport, RelayReportReply
from phoenixrun.protocol.relay import (ACK_TIMEOUT_S, MAX_RELAYED_REPORT, RELAY_POLL_S, Batch, batch_size, poll_key,
                                       report_seal, sealed)
from phoenixrun.testing import pause_point
from phoenixrun.agents.peer import PeerClient, PeerError


@dataclass(frozen=True)
class Sealed:
    version: int
    generation: int
    body: bytes
    mac: str


class RelayCache:
    """What a relay holds for its children: the newest sealed directive of each, their poll keys and acks."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.held: dict[str, Sealed] = {}
        self.keys: dict[str, str] = {}       # child -> the poll key the master gave for it
        self.acked: dict[str, int] = {}      # child -> the version it said it holds in its latest poll

    def store(self, bundle: dict[str, Any]) -> None:
        """A bundle from the master (protocol/relay.py): its children's newer directives and their keys."""
        keys = bundle.get("keys")
        children = bundle.get("children")
        with self.cv:
            if isinstance(keys, dict):
                self.keys = {c: k for c, k in keys.items() if isinstance(k, str)}
            for child, e in (children.items() if isinstance(children, dict) else ()):
                if not (isinstance(e, dict) and type(e.get("v")) is int and isinstance(e.get("d"), str)):
                    continue
                held = self.held.get(child)
                if held is None or e["v"] > held.version:
                    g = e.get("g")
                    self.held[child] = Sealed(e["v"], g if type(g) is int else -1, e["d"].encode(),
                                              str(e.get("mac", "")))
            for gone in set(self.held) - set(self.keys):
                del self.held[gone]
            self.cv.notify_all()

    def state(self) -> dict[str, list[int]]:
        """The relay poll's `relay` field: child -> [version held for it, version it acked]."""
        with self.cv:
            return {c: [self.held[c].version if c in self.held else -1, self.acked.get(c, -1)] for c in self.keys}

    def serve(self, header: dict[str, Any], payload: bytearray) -> tuple[dict[str, Any], bytes]:
        """The peer op RELAY_OP: a child's long-poll. Answers its sealed directive once one newer than the version
        it holds is here, or {"noop": true} after its timeout."""
        ask = RelayPoll.from_header(header)
        child, known, timeout = ask.node_id, ask.version, min(ask.timeout, 2 * RELAY_POLL_S)
        with self.cv:
            key = self.keys.get(child)
            if key is None or not hmac.compare_digest(key.encode(), ask.key.encode()):
                raise PeerError(f"{child[:80]!r} is not a child of this relay")
            self.acked[child] = known
            self.cv.wait_for(lambda: child in self.held and self.held[child].version > known, timeout)
            d = self.held.get(child)
        if d is None or d.version <= known:
            return RelayReply().to_header(), b""
        pause_point("relay_serve", d.generation)    # tests: the relay dies with a broadcast half forwarded
        return RelayReply(d.version, d.mac).to_header(), d.body


class ParentLink:
    """A child's poll of its relay."""

    def __init__(self, peers: PeerClient) -> None:
        self.peers = peers

    def leave(self, addr: str) -> None:
        """The master moved this node off the relay at addr (it was lost, or the tree changed): a poll waiting
        there ends now, not when a hung relay's call would time out (RELAY_POLL_S + 3 s)."""
        self.peers.interrupt(addr)

    def poll(self, addr: str, node_id: str, token: str, version: int) -> dict[str, Any] | None:
        """The directive the relay at addr holds for this node if newer than `version` and sealed by the master
        for it; None if none came. PeerError if the relay is unreachable (the caller polls the master) or
        answered something the master did not seal (a forged or corrupted directive: never acted on)."""
        header, body = self.peers.call(addr, RelayPoll(node_id, poll_key(token), version))
        try:
            reply = RelayReply.from_header(header)
        except ValueError as e:
            raise PeerError(f"relay {addr} answered something else than a directive: {e}") from None
        if reply.version is None:
            return None
        if not sealed(token, bytes(body), reply.mac):
            raise PeerError(f"relay {addr} sent a directive the master did not seal for this node")
        d = json.loads(bytes(body))
        return d if isinstance(d, dict) else None


# ---------------------------------------------------------------------------------------------- acks, upwards
Post = Callable[[Batch], list[dict[str, Any]]]   # send the master a batch, its reply to each report (or raise)
Mine = Callable[[], tuple[str, str]]              # this relay's node id and token now


@dataclass
class _Pending:
    body: bytes
    mac: str
    done: threading.Event = field(default_factory=threading.Event)
    reply: dict[str, Any] | None = None
    error: str = ""


class AckBatcher:
    """A relay's side of the acks: each child's call (its own peer-server thread) queues its sealed report and
    waits; whichever call finds no batch in flight sends the master everything queued, and again while more came
    meanwhile (combining, no thread of its own): a broadcast's acks from ~sqrt N children reach the master in
    one or a few requests, each as soon as the one before it is answered."""

    def __init__(self, cache: RelayCache, post: Post, mine: Mine, timeout: float = ACK_TIMEOUT_S) -> None:
        self.cache, self.post, self.mine, self.timeout = cache, post, mine, timeout
        self._lock = threading.Lock()
        self._queue: list[_Pending] = []
        self._sending = False
        self.batches = 0          # requests sent to the master (tests, logs)

    @property
    def queued(self) -> int:
        """Acks waiting for the next request (tests)."""
        with self._lock:
            return len(self._queue)

    def serve(self, header: dict[str, Any], payload: bytearray) -> tuple[dict[str, Any], bytes]:
        """The peer op REPORT_OP: a child's ack. Answers the master's reply to it; PeerError (the child then sends
        it to the master itself) if the master could not be reached."""
        ask = RelayReport.from_header(header)
        with self.cache.cv:
            key = self.cache.keys.get(ask.node_id)
        if key is None or not hmac.compare_digest(key.encode(), ask.key.encode()):
            raise PeerError(f"{ask.node_id[:80]!r} is not a child of this relay")
        p = _Pending(bytes(payload), ask.mac)
        with self._lock:
            self._queue.append(p)
            lead, self._sending = not self._sending, True
        if lead:
            self._send_queued()
        if not p.done.wait(self.timeout):
            raise PeerError("the master did not answer the relayed acks in time")
        if p.reply is None:
            raise PeerError(f"the relay could not send the master this ack: {p.error}")
        return RelayReportReply(p.reply).to_header(), b""

    def _send_queued(self) -> None:
        while True:
            with self._lock:
                batch = _take(self._queue)
                if not batch:
                    self._sending = False
                    return
            relay, token = self.mine()
            try:
                replies = self.post(Batch(relay, token, tuple((p.body, p.mac) for p in batch)))
                if len(replies) != len(batch):
                    raise ValueError(f"{len(replies)} replies to {len(batch)} reports")
                for p, r in zip(batch, replies):
                    p.reply = r
            except Exception as e:      # the master unreachable, refusing the relay, or a reply it cannot read
                for p in batch:
                    p.error = str(e) or type(e).__name__
            self.batches += 1
            for p in batch:
                p.done.set()


def _take(queue: list[_Pending]) -> list[_Pending]:
    """The front of the queue that one request carries (protocol/relay.py's batch_size), removed from it."""
    n = batch_size([len(p.body) + len(p.mac) for p in queue])
    out = queue[:n]
    del queue[:n]
    return out


class UpLink:
    """A child's send of an ack through its relay."""

    def __init__(self, peers: PeerClient, relay_addr: Callable[[], str | None]) -> None:
        self.peers, self.relay_addr = peers, relay_addr

    def send(self, node_id: str, token: str, body: bytes) -> dict[str, Any] | None:
        """The master's reply to this report (body: its wire bytes, without the token), sent via the relay this
        node polls now; None if it has none. PeerError if the relay failed or could not reach the master."""
        addr = self.relay_addr()
        if addr is None or len(body) > MAX_RELAYED_REPORT:
            return None
        header, _ = self.peers.call(addr, RelayReport(node_id, poll_key(token), report_seal(token, body)), body)
        try:
            return RelayReportReply.from_header(header).reply
        except ValueError as e:
            raise PeerError(f"relay {addr} answered something else than the master's reply: {e}") from None
