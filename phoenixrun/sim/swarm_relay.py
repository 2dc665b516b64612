"""The relay protocol (protocol/relay.py) as the load generator's simulated agents speak it.

Master <-> relay is the real protocol on the relay's own poll connection: a relay's long-poll carries its
children's versions, the master answers with a bundle of sealed directives. Relay -> child is in-process: one
process cannot hold a peer connection per child next to the master's connections at 16K agents (its limit of
20000 open files), so a relay hands each child its directive directly, after the check the real child makes
(the master's seal, under the child's token), stamped with the time the bundle's bytes reached the relay (the
relay hop itself, one round trip on a LAN, is not in the figures). A child whose relay was killed polls the
master directly at once (a real child's connection is reset); one whose relay hangs does so when its call to
the relay times out (RELAY_POLL_S + 3 s, the agents' peer client's limit), as agents/master_link.py does.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING, Any

from phoenixrun.protocol.relay import FALLBACK_POLL_S, RELAY_POLL_S, sealed

if TYPE_CHECKING:
    from phoenixrun.sim.swarm import SimAgent

RELAY_CALL_LIMIT_S = RELAY_POLL_S + 3     # agents/agent.py: the peer client's io timeout for relay polls
Relayed = tuple[dict[str, Any], float]    # a directive and when its bytes reached the relay


class SwarmRelays:
    def __init__(self, agents: list[SimAgent]) -> None:
        self.by_id = {a.node_id: a for a in agents}
        self.parent: dict[str, str] = {}                  # child -> its relay's node id (heartbeat replies)
        self.serves: set[str] = set()
        self.held: dict[str, dict[str, int]] = {}         # relay -> child -> version it holds for the child
        self.inbox: dict[str, asyncio.Queue[Relayed | None]] = {}
        self.direct_until: dict[str, float] = {}          # child -> polls the master directly until (monotonic)
        self.failed: dict[str, str] = {}                  # failed agent -> how (kill | silent)
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
        link = json.loads(reply).get("relay")
        if not isinstance(link, dict):
            return
        via = link.get("via") if link.get("parent") else None
        if isinstance(via, str) and via in self.by_id:
            self.parent[a.node_id] = via
        else:
            self.parent.pop(a.node_id, None)
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
            self._queue(c).put_nowait((json.loads(body), at))
        own = bundle.get("own")
        return own if isinstance(own, dict) else {}

    def _queue(self, node_id: str) -> asyncio.Queue[Relayed | None]:
        q = self.inbox.get(node_id)
        if q is None:
            q = self.inbox[node_id] = asyncio.Queue()
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
        try:
            got = await asyncio.wait_for(self._queue(a.node_id).get(),
                                         RELAY_CALL_LIMIT_S if how == "silent" else RELAY_POLL_S)
        except asyncio.TimeoutError:
            got = None
        if got is None and relay in self.failed:
            self.direct_until[a.node_id] = time.monotonic() + FALLBACK_POLL_S
        return got

    def fail(self, a: SimAgent, fault: str) -> None:
        """`a` failed: a killed relay's children find out at once (their connections are reset)."""
        self.failed[a.node_id] = fault
        if fault == "kill":
            for child, relay in self.parent.items():
                if relay == a.node_id:
                    self._queue(child).put_nowait(None)
