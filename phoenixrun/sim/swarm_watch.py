"""The ring watch (control/ring_watch.py) as the load generator's simulated agents do it.

Each simulated agent watches the neighbours its heartbeat replies name, with the real decision
(ring_watch.is_suspect) and the real report (protocol/suspect.py, over the report connections). The pings
themselves are in-process: a live simulated agent answers every ping at once, a failed one none from its failure
on, so a watcher's last answer from a failed neighbour is the last ping round before the failure; one round runs
every PING_S for the failed nodes' watchers only (16K agents pinging 2 neighbours 5 times a second would be 160K
messages a second in one process: the generator's CPU, not the master's; each real agent pings its own 2). A
round that comes late (the generator itself did not run) is the watcher's own lag, which the decision discounts,
as a real watcher does.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Callable

from phoenixrun.control.ring_watch import PING_S, is_suspect
from phoenixrun.protocol.reports import Suspect

Report = Callable[[str, Suspect], None]                # (watcher node id, its report)


class SwarmWatch:
    def __init__(self) -> None:
        self.watching: dict[str, tuple[str, ...]] = {}     # watcher -> the neighbours it watches
        self.watchers: dict[str, set[str]] = {}            # neighbour -> who watches it
        self.failed: dict[str, float] = {}                 # failed agent -> its last answered ping round (monotonic)
        self.reported: set[tuple[str, str]] = set()        # (watcher, suspect) already reported
        self.reports = 0
        self._seen: dict[str, bytes] = {}
        self._round = time.monotonic()

    def follow(self, node_id: str, reply: bytes) -> None:
        """A heartbeat reply: the neighbours the master says this agent watches."""
        if b'"watch"' not in reply or self._seen.get(node_id) == reply:
            return
        self._seen[node_id] = reply
        self.follow_reply(node_id, json.loads(reply))

    def follow_reply(self, node_id: str, reply: dict[str, Any]) -> None:
        """The same, from a reply already decoded (one of a relayed batch's)."""
        got = reply.get("watch")
        if not isinstance(got, list):
            return
        now = tuple(str(w[0]) for w in got if isinstance(w, list) and w)
        if self.watching.get(node_id) == now:
            return
        for old in self.watching.get(node_id, ()):
            self.watchers.get(old, set()).discard(node_id)
        self.watching[node_id] = now
        for w in now:
            self.watchers.setdefault(w, set()).add(node_id)

    def fail(self, node_id: str) -> None:
        """The agent stops answering pings (hung or killed): its watchers' last answer was the last round's."""
        self.failed[node_id] = self._round

    async def run(self, alive: Callable[[str], bool], report: Report) -> None:
        """A ping round every PING_S: each live watcher of a failed agent reports it once suspected."""
        while True:
            due = self._round + PING_S
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            now = time.monotonic()
            lag, self._round = max(0.0, now - due), now
            for node_id, since in list(self.failed.items()):
                for w in sorted(self.watchers.get(node_id, ())):
                    if (w, node_id) in self.reported or not alive(w):
                        continue
                    if is_suspect(since, 0.0, now, lag):
                        self.reported.add((w, node_id))
                        self.reports += 1
                        report(w, Suspect(node_id=w, suspect=node_id, silent_for=round(now - since, 3)))
