"""An agent's part in the directive fan-out (protocol/relay.py): as a relay, the cache of its children's sealed
directives that it serves them over the peer transport; as a child, the poll of its relay, which accepts only
what the master sealed for this node.

The relay forwards bytes: it reads the version and generation the master put beside each directive, never the
directive itself, and it cannot forge one (the seal is keyed by the child's token, which it does not hold).
"""
from __future__ import annotations

import hmac
import json
import threading
from dataclasses import dataclass
from typing import Any

from phoenixrun.protocol.peer_requests import RelayPoll, RelayReply
from phoenixrun.protocol.relay import RELAY_POLL_S, poll_key, sealed
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
