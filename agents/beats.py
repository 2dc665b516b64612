"""Heartbeats through the relays (protocol/relay.py): a child hands its relay each heartbeat, numbered and sealed
under its token, and goes on at once; the relay sends the master its children's newest heartbeats in one request
a period, right after its own heartbeat, and hands each child the master's reply when it next calls.

`BeatDesk` is the relay's side, `BeatLink` the child's (which heartbeat the master confirmed, and so whether the
next one may go through the relay: protocol/relay.py's beat_route). A relay that stops forwarding only delays its
children's heartbeats: a child whose heartbeats go unconfirmed for RelayLink.beats seconds sends the next one to
the master itself.
"""
from __future__ import annotations

import hmac
import json
import logging
import threading
import time
from typing import Any

from phoenixrun.protocol.peer_requests import RelayBeat, RelayBeatReply
from phoenixrun.protocol.relay import Batch, batch_size, beat_route, beat_seal, poll_key
from phoenixrun.agents.peer import PeerClient, PeerError
from phoenixrun.agents.relay import Mine, Post, RelayCache

log = logging.getLogger("phoenixrun.agent")
SENT_KEPT = 64                # a child remembers when it sent this many of its latest relayed heartbeats


class BeatDesk:
    """A relay's side: each child's newest heartbeat not sent yet, the highest of its heartbeats the master
    confirmed, and the master's latest reply to it not handed over yet."""

    def __init__(self, cache: RelayCache, post: Post, mine: Mine) -> None:
        self.cache, self.post, self.mine = cache, post, mine
        self._lock = threading.Lock()
        self._newest: dict[str, tuple[int, bytes, str]] = {}   # child -> (seq, body, seal)
        self._confirmed: dict[str, int] = {}
        self._replies: dict[str, dict[str, Any]] = {}
        self.batches = 0          # requests sent to the master (tests, logs)

    def serve(self, header: dict[str, Any], payload: bytearray) -> tuple[dict[str, Any], bytes]:
        """The peer op BEAT_OP: keep a child's heartbeat for the next flush; answer at once."""
        ask = RelayBeat.from_header(header)
        with self.cache.cv:
            key = self.cache.keys.get(ask.node_id)
        if key is None or not hmac.compare_digest(key.encode(), ask.key.encode()):
            raise PeerError(f"{ask.node_id[:80]!r} is not a child of this relay")
        with self._lock:
            held = self._newest.get(ask.node_id)
            if held is None or ask.seq > held[0]:
                self._newest[ask.node_id] = (ask.seq, bytes(payload), ask.mac)
            reply = RelayBeatReply(self._confirmed.get(ask.node_id, -1), self._replies.pop(ask.node_id, None))
        return reply.to_header(), b""

    def flush(self) -> int:
        """Send the master every child's newest heartbeat (the relay's heartbeat thread, once a period, after its
        own): how many the master took. A failed request is logged; its children send their own in time."""
        with self._lock:
            newest, self._newest = self._newest, {}
        with self.cache.cv:
            children = set(self.cache.keys)
        with self._lock:     # children that moved to another relay (or left) are forgotten here
            for table in (self._confirmed, self._replies):
                for gone in set(table) - children:
                    del table[gone]
        queued = [(c, seq, body, mac) for c, (seq, body, mac) in newest.items() if c in children]
        taken = 0
        while queued:
            n = batch_size([len(body) + len(mac) for _, _, body, mac in queued])
            part, queued = queued[:n], queued[n:]
            relay, token = self.mine()
            try:
                replies = self.post(Batch(relay, token, tuple((body, mac) for _, _, body, mac in part)))
                if len(replies) != len(part):
                    raise ValueError(f"{len(replies)} replies to {len(part)} heartbeats")
            except Exception as e:     # the master unreachable or refusing this relay: the children go direct
                log.info("relayed heartbeats of %d children not delivered: %s", len(part), e)
                continue
            finally:
                self.batches += 1
            with self._lock:
                for (child, seq, _, _), r in zip(part, replies):
                    if "error" not in r:
                        self._confirmed[child] = max(seq, self._confirmed.get(child, -1))
                        taken += 1
                    elif r.get("reason") == "stale":   # overtaken by the child's own direct heartbeat: moot
                        continue
                    self._replies[child] = r
        return taken


class BeatLink:
    """A child's side: numbers and seals its heartbeats for its relay, and remembers when it sent each, so that
    it knows how fresh the master's view of it is."""

    def __init__(self, peers: PeerClient) -> None:
        self.peers = peers
        self.seq = 0
        self.lag: float | None = None      # RelayLink.beats, from the master's replies (None: heartbeat it directly)
        self.confirmed_at = 0.0            # monotonic: when it sent the latest heartbeat the master confirmed
        self._sent: dict[int, float] = {}

    def route(self, relay_addr: str | None, now: float | None = None) -> str | None:
        """The relay to send the next heartbeat to, or None: the master directly."""
        return beat_route(relay_addr, self.lag, time.monotonic() if now is None else now, self.confirmed_at)

    def confirmed(self, sent_at: float) -> None:
        """The master answered a heartbeat sent at `sent_at` (monotonic) directly."""
        self.confirmed_at = max(self.confirmed_at, sent_at)

    def send(self, addr: str, node_id: str, token: str, heartbeat: dict[str, Any]) -> dict[str, Any] | None:
        """Hand the relay at addr this heartbeat (its wire form; the token is not sent). Returns the master's reply
        to an earlier one if one came since the last call (None: none). PeerError if the relay failed."""
        self.seq += 1
        now = time.monotonic()
        body = json.dumps({**{k: v for k, v in heartbeat.items() if k != "token"}, "seq": self.seq}).encode()
        self._sent[self.seq] = now
        header, _ = self.peers.call(addr, RelayBeat(node_id, poll_key(token), self.seq, beat_seal(token, body)), body)
        try:
            got = RelayBeatReply.from_header(header)
        except ValueError as e:
            raise PeerError(f"relay {addr} answered something else than a heartbeat receipt: {e}") from None
        if got.confirmed in self._sent:
            self.confirmed(self._sent[got.confirmed])
        for s in [s for s in self._sent if s <= got.confirmed or s <= self.seq - SENT_KEPT]:
            del self._sent[s]
        return got.reply
