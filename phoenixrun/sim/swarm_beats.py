"""Heartbeats through the relays (agents/beats.py) as the load generator's simulated agents speak them.

A child hands its relay its heartbeat in-process (numbered, without its token, sealed under it: the real
child's bytes), and a relay sends the master its children's newest in one `/v1/heartbeats` request right after
its own heartbeat, as agents/master_link.py does; the master's reply to each child's is the child's heartbeat
reply. A child heartbeats the master directly when it has no relay, when its relay was killed (a real child's
call is refused at once) or hangs (after its call's BEAT_CALL_S timeout), and when its latest confirmed heartbeat
is older than the master allows (protocol/relay.py's beat_route), as the real child does.
"""
from __future__ import annotations

import asyncio
import functools
import json
import time
from typing import TYPE_CHECKING, Any, Callable

from phoenixrun.protocol.relay import BEAT_CALL_S, Batch, batch_replies, batch_size, beat_route, beat_seal
from phoenixrun.sim.swarm_relay import Send, SwarmRelays

if TYPE_CHECKING:
    from phoenixrun.sim.swarm import SimAgent

Heard = Callable[["SimAgent", dict[str, Any]], None]   # a child's heartbeat reply, relayed


class SwarmBeats:
    def __init__(self, relays: SwarmRelays, send: Send, heard: Heard, errors: list[str], on: bool = True) -> None:
        self.relays, self.send, self.heard, self.errors = relays, send, heard, errors
        self.on = on               # False: every agent heartbeats the master directly (the A/B's other arm)
        self._newest: dict[str, dict[str, tuple[SimAgent, int, bytes, str, float]]] = {}   # relay -> child -> beat
        self._seq: dict[str, int] = {}
        self.confirmed_at: dict[str, float] = {}   # child -> when it sent its latest heartbeat the master confirmed
        self.batches = 0           # /v1/heartbeats requests sent
        self.relayed = 0           # heartbeats the master took through them

    def hand(self, a: SimAgent, prefix: bytes) -> float | None:
        """The agent's heartbeat (its wire bytes without the token, up to the value of `seq`): None if its relay
        took it; else it sends this one to the master directly, after this many seconds (a call to a hung relay
        times out first, BEAT_CALL_S)."""
        relay = self.relays.relay_of(a) if self.on else None
        if relay is not None and self.relays.failed.get(relay) == "silent":
            return BEAT_CALL_S
        if relay is not None and (self.relays.failed.get(relay) == "kill" or not a.token):
            relay = None
        now = time.monotonic()
        if beat_route(relay, self.relays.beat_lag.get(a.node_id), now, self.confirmed_at.get(a.node_id, 0.0)) is None:
            return 0.0
        assert relay is not None and a.token is not None
        seq = self._seq[a.node_id] = self._seq.get(a.node_id, 0) + 1
        body = prefix + str(seq).encode() + b"}"
        self._newest.setdefault(relay, {})[a.node_id] = (a, seq, body, beat_seal(a.token, body), now)
        return None

    def confirmed(self, a: SimAgent, sent_at: float) -> None:
        """The master answered the agent's direct heartbeat sent at `sent_at` (monotonic)."""
        self.confirmed_at[a.node_id] = max(sent_at, self.confirmed_at.get(a.node_id, 0.0))

    def flush(self, relay: SimAgent) -> None:
        """The relay's heartbeat was answered: send its children's newest heartbeats."""
        queued = [b for b in self._newest.pop(relay.node_id, {}).values() if b[0].alive]
        while queued:
            n = batch_size([len(body) + len(mac) for _, _, body, mac, _ in queued])
            part, queued = queued[:n], queued[n:]
            self.batches += 1
            fut = self.send(relay, Batch(relay.node_id, relay.token or "", tuple((b, m) for _, _, b, m, _ in part)))
            fut.add_done_callback(functools.partial(self._answered, relay, part))

    def _answered(self, relay: SimAgent, part: list[tuple[SimAgent, int, bytes, str, float]],
                  f: asyncio.Future[tuple[int, bytes]]) -> None:
        try:
            if f.cancelled() or f.exception() is not None or f.result()[0] != 200:
                raise ValueError(f"{f.exception() if not f.cancelled() else 'cancelled'}")
            replies = batch_replies(json.loads(f.result()[1]))
            if len(replies) != len(part):
                raise ValueError(f"{len(replies)} replies to {len(part)} heartbeats")
        except (ValueError, KeyError) as e:   # the children find out from their stale confirmations
            if relay.node_id not in self.relays.failed:
                self.errors.append(f"relayed heartbeats of {relay.node_id}: {e}")
            return
        for (a, _, _, _, sent_at), r in zip(part, replies):
            if "error" in r:
                if r.get("reason") != "stale":
                    self.errors.append(f"relayed heartbeat of {a.node_id}: {r['error']}")
                continue
            self.relayed += 1
            self.confirmed(a, sent_at)
            self.heard(a, r)
