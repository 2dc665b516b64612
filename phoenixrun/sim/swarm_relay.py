"""The relay protocol (protocol/relay.py) as the load generator's simulated agents speak it.

Master <-> relay is the real protocol on the relay's own poll connection: a relay's long-poll carries its
children's versions, the master answers with a bundle of sealed directives. Relay -> child is in-process: one
process cannot hold a peer connection per child next to the master's connections at 16K agents (its limit of
20000 open files), so a relay hands each child its directive directly, after the check the real child makes
(the master's seal, under the child's token), stamped with the time the bundle's bytes reached the relay (the
relay hop itself, one round trip on a LAN, is not in the figures). A child whose relay was killed polls the
master directly at once (a real child's connection is reset); one whose relay hangs does so when its call to
the relay times out (RELAY_POLL_S + 3 s, the agents' peer client's limit), as agents/master_link.py does.

Acks go up the same way (`SwarmAcks`): a child hands its sealed `quiesced`/`resumed` report to its relay
in-process, and the relay sends the master one `/v1/reports` request for all that reached it, and the next one
when the master has answered it, as agents/relay.py's AckBatcher does; a child whose relay failed sends its own.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING, Any, Callable

from phoenixrun.protocol import reports
from phoenixrun.protocol.relay import (FALLBACK_POLL_S, RELAY_POLL_S, RELAYED_KINDS, Batch, batch_replies, batch_size,
                                       report_seal, sealed)

if TYPE_CHECKING:
    from phoenixrun.sim.swarm import SimAgent

RELAY_CALL_LIMIT_S = RELAY_POLL_S + 3     # agents/agent.py: the peer client's io timeout for relay polls
IN_PROCESS_POLL_S = 5 * RELAY_POLL_S      # a child's in-process wait at its relay: a real child polls again every
                                          # RELAY_POLL_S, which costs only the generator here (a timer per child),
                                          # not the master - 8,000 a second at 16K agents
Relayed = tuple[dict[str, Any], float]    # a directive and when its bytes reached the relay


class SwarmRelays:
    def __init__(self, agents: list[SimAgent]) -> None:
        self.by_id = {a.node_id: a for a in agents}
        self.parent: dict[str, str] = {}                  # child -> its relay's node id (heartbeat replies)
        self.serves: set[str] = set()
        self.held: dict[str, dict[str, int]] = {}         # relay -> child -> version it holds for the child
        self.inbox: dict[tuple[str, str], asyncio.Queue[Relayed | None]] = {}   # (relay, child) -> what it holds
        self.direct_until: dict[str, float] = {}          # child -> polls the master directly until (monotonic)
        self.failed: dict[str, str] = {}                  # failed agent -> how (kill | silent)
        self._waiting_since: dict[str, float] = {}        # child -> when its in-process wait at its relay began
        self.beat_lag: dict[str, float | None] = {}       # child -> RelayLink.beats (its heartbeats through its relay)
        self._seen: dict[str, bytes] = {}                 # agent -> its latest heartbeat reply
        self.master_writes = 0     # directive answers the master wrote that carried something new (a bundle: one)
        self.relayed = 0           # directives relays handed to children
        self.refused = 0           # relayed directives a child refused (not sealed for it by the master)

    # ------------------------------------------------------------------ what the master says of the tree
    def follow(self, a: SimAgent, reply: bytes) -> None:
        """A heartbeat reply: the agent's relay (its node id, `via`) and whether it serves children."""
        if b'"relay"' not in reply or self._seen.get(a.node_id) == reply:   # mostly the same bytes each period
            return
        self._seen[a.node_id] = reply
        self.follow_reply(a, json.loads(reply))

    def follow_reply(self, a: SimAgent, reply: dict[str, Any]) -> None:
        """The same, from a reply already decoded (one of a relayed batch's)."""
        link = reply.get("relay")
        if not isinstance(link, dict):
            return
        beats = link.get("beats")
        self.beat_lag[a.node_id] = float(beats) if isinstance(beats, (int, float)) and beats > 0 else None
        via = link.get("via") if link.get("parent") else None
        old = self.parent.get(a.node_id)
        if isinstance(via, str) and via in self.by_id:
            self.parent[a.node_id] = via
        else:
            self.parent.pop(a.node_id, None)
        if old is not None and old != self.parent.get(a.node_id):
            # moved off its relay: as agents/master_link.py's follow, its poll there ends now and it polls the
            # master directly for a while (a hung relay's children are not held until their calls time out)
            self.direct_until[a.node_id] = time.monotonic() + FALLBACK_POLL_S
            self._queue(old, a.node_id).put_nowait(None)
        (self.serves.add if link.get("serves") is True else self.serves.discard)(a.node_id)

    def state(self, a: SimAgent) -> dict[str, list[int]] | None:
        """A relay's poll field: child -> [version held for it, version it holds]."""
        if a.node_id not in self.serves:
            return None
        return {c: [v, self.by_id[c].version] for c, v in self.held.get(a.node_id, {}).items()}

    def poll_timeout(self, a: SimAgent, asked: float) -> float:
        return FALLBACK_POLL_S if time.monotonic() < self.direct_until.get(a.node_id, 0.0) else asked

    # ------------------------------------------------------------------ a relay's bundle
    def forward(self, relay: SimAgent, bundle: dict[str, Any], at: float) -> dict[str, Any]:
        """Hand each child its directive (checked as the child checks it); returns the relay's own directive."""
        self.serves.add(relay.node_id)      # as the agent: its next poll speaks for its children
        held = self.held.setdefault(relay.node_id, {})
        keys = bundle.get("keys")
        if isinstance(keys, dict):
            for c in list(held):
                if c not in keys:
                    del held[c]
            for c in keys:
                held.setdefault(c, -1)
        for c, e in (bundle.get("children") or {}).items():
            child = self.by_id.get(c)
            if child is None or not isinstance(e, dict) or e.get("v", -1) <= held.get(c, -1):
                continue
            held[c] = e["v"]
            body = str(e.get("d", "")).encode()
            if not sealed(child.token or "", body, e.get("mac")):
                self.refused += 1
                continue
            self.relayed += 1
            self._queue(relay.node_id, c).put_nowait((json.loads(body), at))
        own = bundle.get("own")
        return own if isinstance(own, dict) else {}

    def _queue(self, relay: str, child: str) -> asyncio.Queue[Relayed | None]:
        """What `relay` holds for `child`: a child polling one relay gets nothing another holds for it."""
        q = self.inbox.get((relay, child))
        if q is None:
            q = self.inbox[(relay, child)] = asyncio.Queue()
        return q

    # ------------------------------------------------------------------ a child's side
    def relay_of(self, a: SimAgent) -> str | None:
        """The relay this agent polls now (None: the master)."""
        if time.monotonic() < self.direct_until.get(a.node_id, 0.0):
            return None
        return self.parent.get(a.node_id)

    async def next_relayed(self, a: SimAgent, relay: str) -> Relayed | None:
        """The child's poll of its relay: a directive, or None (nothing within the poll, or the relay failed:
        then it polls the master directly for a while)."""
        how = self.failed.get(relay)
        if how == "kill":
            self.direct_until[a.node_id] = time.monotonic() + FALLBACK_POLL_S
            return None
        self._waiting_since[a.node_id] = time.monotonic()
        try:   # a hung relay's children are woken when their calls to it would time out (fail, below)
            got = await asyncio.wait_for(self._queue(relay, a.node_id).get(),
                                         RELAY_CALL_LIMIT_S if how == "silent" else IN_PROCESS_POLL_S)
        except asyncio.TimeoutError:
            got = None
        if got is None and relay in self.failed:
            self.direct_until[a.node_id] = time.monotonic() + FALLBACK_POLL_S
        return got

    def fail(self, a: SimAgent, fault: str) -> None:
        """`a` failed: a killed relay's children find out at once (their connections are reset), a hung one's when
        their calls to it time out."""
        self.failed[a.node_id] = fault
        children = [child for child, relay in self.parent.items() if relay == a.node_id]
        if fault == "kill":
            for child in children:
                self._queue(a.node_id, child).put_nowait(None)
        else:   # hung: each child's call to it times out RELAY_CALL_LIMIT_S after it began; a real child calls
            # again every RELAY_POLL_S, so its call in flight began (time waiting) mod RELAY_POLL_S ago
            loop, now = asyncio.get_running_loop(), time.monotonic()
            for child in children:
                began = (now - self._waiting_since.get(child, now)) % RELAY_POLL_S
                loop.call_later(RELAY_CALL_LIMIT_S - began, self._queue(a.node_id, child).put_nowait, None)


Send = Callable[["SimAgent", Batch], "asyncio.Future[tuple[int, bytes]]"]     # a relay's request to the master
Direct = Callable[["SimAgent", reports.Report], None]                         # a report sent to the master directly


class SwarmAcks:
    """The relays' batching of their children's acks (agents/relay.py's AckBatcher, in-process)."""

    def __init__(self, relays: SwarmRelays, send: Send, direct: Direct, errors: list[str]) -> None:
        self.relays, self.send, self.direct, self.errors = relays, send, direct, errors
        self._queued: dict[str, list[tuple[SimAgent, reports.Report, bytes, str]]] = {}
        self._in_flight: set[str] = set()
        self.batches = 0           # /v1/reports requests sent
        self.relayed = 0           # acks the master took through them
        self.made: dict[str, float] = {}   # report kind -> when the generator made its latest (its own pace)

    def report(self, a: SimAgent, ev: reports.Report) -> None:
        """An agent's report: an ack goes through its relay when it has a live one, anything else directly."""
        self.made[ev.kind] = time.time()
        relay = self.relays.relay_of(a) if ev.kind in RELAYED_KINDS else None
        if relay is None or relay in self.relays.failed or not a.token:
            self.direct(a, ev)
            return
        body = json.dumps(ev.to_wire()).encode()
        self._queued.setdefault(relay, []).append((a, ev, body, report_seal(a.token, body)))
        if relay not in self._in_flight:
            self._flush(relay)

    def _flush(self, relay_id: str) -> None:
        queued = self._queued.get(relay_id, [])
        if not queued:
            self._in_flight.discard(relay_id)
            return
        n = batch_size([len(body) + len(mac) for _, _, body, mac in queued])
        batch, self._queued[relay_id] = queued[:n], queued[n:]
        relay = self.relays.by_id[relay_id]
        self._in_flight.add(relay_id)
        self.batches += 1
        fut = self.send(relay, Batch(relay_id, relay.token or "", tuple((b, m) for _, _, b, m in batch)))

        def done(f: asyncio.Future[tuple[int, bytes]]) -> None:
            try:
                if f.cancelled() or f.exception() is not None or f.result()[0] != 200:
                    raise ValueError(f"{f.exception() if not f.cancelled() else 'cancelled'}")
                replies = batch_replies(json.loads(f.result()[1]))
                if len(replies) != len(batch):
                    raise ValueError(f"{len(replies)} replies to {len(batch)} reports")
            except (ValueError, KeyError) as e:
                if relay_id not in self.relays.failed:
                    self.errors.append(f"relayed acks of {relay_id}: {e}")
                for a, ev, _, _ in batch:      # the relay could not: each child sends its own
                    self.direct(a, ev)
            else:
                for (a, ev, _, _), r in zip(batch, replies):
                    if "error" in r:
                        self.errors.append(f"relayed {ev.kind} of {a.node_id}: {r['error']}")
                    else:
                        self.relayed += 1
            self._flush(relay_id)
        fut.add_done_callback(done)
