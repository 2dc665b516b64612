"""The master's side of the directive fan-out (protocol/relay.py; the tree itself: control/relay_tree.py).

The desk keeps the tree over the job's live members (re-planned at most every REFRESH_S, from the transport's
heartbeat path), tells each agent its relay (in the heartbeat reply; with `beat_lag`, that it heartbeats through
it too: protocol/relay.py), answers a relay's long-poll with a bundle
of its children's directives, each sealed with the child's token, and maps a wake-up for a node to its relay's
parked poll as well as its own (a child whose relay failed polls the master directly meanwhile).
Below `threshold` members (or with threshold 0) the tree is flat: every agent polls the master, as without it.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from phoenixrun.control import relay_tree
from phoenixrun.control.directives import Ask, Directive
from phoenixrun.control.jobstate import JobState
from phoenixrun.control.pacing import Pacer
from phoenixrun.control.relay_tree import Member, Tree
from phoenixrun.control.state import Role
from phoenixrun.protocol.names import Command
from phoenixrun.protocol.relay import FALLBACK_POLL_S, poll_key, seal
from phoenixrun.protocol.replies import RelayLink

REFRESH_S = 0.25       # the tree follows the membership this closely (a relay's children do not wait for it:
                       # they poll the master directly the moment their relay fails)
Answer = Callable[[list[Ask]], list[Directive | None]]


@dataclass
class Bundle(Directive):
    """A relay's answer: its own directive (if newer) and its children's. `parts`: every directive it carries
    (they count as sent once the bundle is)."""
    parts: list[Directive] = field(default_factory=list)


class RelayDesk:
    def __init__(self, job: JobState, threshold: int, beat_lag: float | None = None):
        self.job, self.threshold = job, threshold
        self.beat_lag = beat_lag          # RelayLink.beats: children heartbeat through their relays (None: not)
        self.tree = Tree()
        self.ever = False                 # the tree had relays once: agents must hear when it goes flat
        self._members: frozenset[str] = frozenset()
        self._addr: dict[str, str] = {}   # relay -> its peer address
        self._kids: dict[str, tuple[str, ...]] = {}   # relay -> its children (Tree.children is O(N) a call)
        self._keys: dict[str, tuple[str, str]] = {}   # node -> (token, poll key)
        self._pacer = Pacer(REFRESH_S)
        self.wake: Callable[[list[str]], None] = lambda node_ids: None   # the transport's, unrouted

    # ------------------------------------------------------------------ the tree
    def refresh(self, now: float | None = None) -> None:
        """Follow the membership (at most every REFRESH_S, less often while a walk costs more than a tenth of
        that; any thread)."""
        if self.threshold > 0:      # an O(nodes) walk: at most a tenth of the master (control/pacing.py)
            self._pacer.run(self._follow, time.monotonic() if now is None else now)

    def _follow(self) -> None:
        with self.job.cv:
            # a node reported lost relays no more at once, before its recovery replaces it (its children would
            # wait out their calls to a hung relay, 3-5 s, and miss the recovery's first broadcast meanwhile)
            lost = self.job.members.lost
            live = [n for n in self.job.members.nodes.values()
                    if n.role in (Role.ACTIVE, Role.SPARE) and n.node_id not in lost]
            ids = frozenset(n.node_id for n in live)
            if ids == self._members:
                return
            members = [Member(n.fault_domain, n.host, n.node_id) for n in live]
            old, tree = self.tree, relay_tree.update(self.tree, members, self.threshold)
            self._addr = {r: self.job.members.nodes[r].peer_addr for r in tree.relays}
            self._kids = {r: tuple(sorted(c)) for r, c in relay_tree.groups(tree).items()}
            self._members, self.tree = ids, tree
            self.ever = self.ever or bool(tree.relays)
        # a relay parked in its poll learns its new children (their poll keys) now, not when its poll expires:
        # a child sent to it would be refused meanwhile (measured: 20 s of refusals, a real job, issue 32)
        self.wake(relay_tree.changed_relays(old, tree))

    def link(self, node_id: str) -> RelayLink | None:
        """What a heartbeat reply tells the node of the tree: its relay's address (None: the master) and whether
        it serves children; None while relaying has never been on (the reply stays as it was)."""
        self.refresh()
        if not self.ever:
            return None
        tree = self.tree
        parent = tree.parent.get(node_id)
        addr = self._addr.get(parent) if parent else None
        return RelayLink(addr, parent, node_id in self._addr, self.beat_lag if addr else None)

    def poll_timeout(self, node_id: str, asked: float) -> float:
        """How long to park a node's direct poll: short for a node that has a relay (it polls the master only
        while its relay fails, and must move back to the relay soon after), as asked otherwise."""
        return min(asked, FALLBACK_POLL_S) if self.tree.parent.get(node_id) is not None else asked

    def route(self, node_ids: Iterable[str]) -> list[str]:
        """The parked polls to wake for directives set for node_ids (theirs and their relays')."""
        ids = list(node_ids)
        return ids if not self._addr else list(relay_tree.route(self.tree, ids))

    # ------------------------------------------------------------------ answering relays
    def answer(self, asks: list[Ask], answer: Answer) -> list[Directive | None]:
        """Directive polls, some of them relays' (`relay` set): plain ones as `answer` answers them, a relay's
        with a Bundle (None: nothing new for it or its children: park it)."""
        kids = self._kids
        if all(a.relay is None and a.node_id not in kids for a in asks):
            return answer(asks)
        out: list[Directive | None] = []
        for a in asks:
            if a.relay is None and a.node_id not in kids:
                out.extend(answer([a]))
                continue
            # a relay whose poll does not speak for children yet (sent before it heard it serves) is answered at
            # once with all of theirs and their keys: parked, it would learn them only when the poll expires, and
            # its children would be refused meanwhile (measured: 15-30 s after a job's start, a real job)
            out.append(self._bundle(a.node_id, a.version, a.relay if a.relay is not None else {}, answer))
        return out

    def _bundle(self, relay: str, known: int, state: Mapping[str, tuple[int, int]],
                answer: Answer) -> Directive | None:
        kids = self._kids.get(relay, ())
        acks = [Ask(c, state[c][1]) for c in kids if c in state and state[c][1] >= 0]
        asked = [Ask(relay, known)] + [Ask(c, state.get(c, (-1, -1))[0]) for c in kids]
        got = answer(acks + asked)[len(acks):]     # the acks first: answering a held version records it
        own, theirs = got[0], list(zip(kids, got[1:]))
        children = {c: d for c, d in theirs if d is not None}
        keyed = [c for c in kids if c not in state]    # children the relay does not know yet
        if own is None and not children and not keyed:
            return None
        with self.job.cv:
            tokens = {c: self.job.members.tokens.get(c, "") for c in kids}
        entries = ", ".join(f"{json.dumps(c)}: {self._entry(tokens[c], d)}" for c, d in children.items())
        keys = ", ".join(f"{json.dumps(c)}: {json.dumps(self._key(c, tokens[c]))}" for c in kids)
        body = (f'{{"bundle": 1, "master_epoch": {int(self.job.master_epoch)}, "version": '
                f'{own.version if own else known}, "children": {{{entries}}}, "keys": {{{keys}}}, "own": ').encode() \
            + (own.body if own else b"null") + b"}"
        parts = ([own] if own else []) + list(children.values())
        own_command = own.command if own else Command.NOOP
        return Bundle(own.version if own else known, own_command, own.generation if own else None, body, parts=parts)

    @staticmethod
    def _entry(token: str, d: Directive) -> str:
        gen = d.generation
        return (f'{{"v": {d.version}, "g": {gen if gen is not None else -1}, '
                f'"d": {json.dumps(d.body.decode())}, "mac": "{seal(token, d.body)}"}}')

    def _key(self, node: str, token: str) -> str:
        held = self._keys.get(node)
        if held is None or held[0] != token:
            held = self._keys[node] = (token, poll_key(token))
        return held[1]


def expand(sent: list[Directive]) -> list[Directive]:
    """The directives a batch of answers delivered (a bundle delivers its parts)."""
    return [p for d in sent for p in (d.parts if isinstance(d, Bundle) else [d])]
