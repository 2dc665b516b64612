"""The orders the master gives its agents, encoded once when they are set.

An agent long-polls for its directive and gets the bytes stored here: a broadcast to 16K agents
costs one JSON encode when every node gets the same order (quiesce, the resume, stop), and one per
node only for the nodes whose order names their own slot and world (the start, a restart, the few
whose world a recovery changed) - never an encode per delivery, which kept a 16K-node broadcast
in the seconds.

Versions only grow (across master restarts too: the first is the clock in microseconds) and one
broadcast is one version; an agent acts on a directive newer than the one it holds. The board
tracks each version until every node it was set for has been sent it: the time from the order to
the last node's socket is the broadcast's own time (`directive_sent` events).
Not thread-safe: the master calls it with its lock held.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from phoenixrun.control import wire
from phoenixrun.protocol import directives as wire_directives
from phoenixrun.protocol.names import Command


@dataclass
class Directive:
    """One node's order as the board holds it: encoded once (`body`, shared by a broadcast's nodes), with the two
    things the master itself asks of it afterwards; `decoded()` is what the agent will make of the bytes."""
    version: int
    command: Command
    generation: int | None
    body: bytes
    sent: bool = False    # handed to the agent's connection (in its socket buffer, or on the wire)
    acked: bool = False   # the agent polled again holding this version: it has it

    def decoded(self) -> wire_directives.Directive:
        return wire_directives.decode(wire.loads(self.body))


@dataclass(frozen=True, slots=True)
class Ask:
    """A node asking for a directive newer than the `version` it holds (-1: none yet): its own long-poll
    (protocol/messages.py's Poll, validated), or one a relay's poll asks for a child (control/relaying.py), whose
    `relay` says what it holds and has acked for each child: child id -> (held, acked)."""
    node_id: str
    version: int
    relay: Mapping[str, tuple[int, int]] | None = None


def _head(fields: Mapping[str, Any]) -> tuple[Command, int | None]:
    """A directive's command and generation, read once per version (not per node: a broadcast sets 16K)."""
    gen = fields.get("generation")
    return Command(fields["command"]), gen if isinstance(gen, int) else None


@dataclass
class Rollout:
    """One version on its way out: set for `targets` nodes at `set_at`, sent to `sent` of them."""
    version: int
    command: Command
    generation: int | None
    targets: int
    set_at: float
    sent: int = 0


ROLLOUTS_KEPT = 64    # versions still tracked (older ones were superseded or went to dead nodes)


class DirectiveBoard:
    """on_sent(rollout, t) is called once a version has been sent to every node it was set for."""

    def __init__(self, first_version: int | None = None,
                 on_sent: Callable[[Rollout, float], None] | None = None):
        self.version = int(time.time() * 1e6) if first_version is None else first_version
        self._by_node: dict[str, Directive] = {}
        self._rollouts: OrderedDict[int, Rollout] = OrderedDict()
        self.on_sent = on_sent

    def set(self, node_ids: Iterable[str], **fields: Any) -> list[str]:
        """Give every node in node_ids the directive `fields` under one new version; returns the ids."""
        self.version += 1
        fields["version"] = self.version
        body = wire.dumps(fields)
        ids = list(node_ids)
        command, generation = _head(fields)
        for nid in ids:
            self._by_node[nid] = Directive(self.version, command, generation, body)
        self._track(command, generation, len(ids))
        return ids

    def set_each(self, orders: Mapping[str, dict[str, Any]], **common: Any) -> list[str]:
        """Give each node its own directive, `common` merged into each, under one new version (the
        nodes with nothing of their own share one encoding of `common`)."""
        self.version += 1
        common["version"] = self.version
        shared: bytes | None = None
        command, generation = _head(common)     # a node's own part is its slot and world, never these
        for nid, own in orders.items():
            if own:
                body = wire.dumps({**common, **own})
            else:
                body = shared = wire.dumps(common) if shared is None else shared
            self._by_node[nid] = Directive(self.version, command, generation, body)
        self._track(command, generation, len(orders))
        return list(orders)

    def _track(self, command: Command, generation: int | None, targets: int) -> None:
        self._rollouts[self.version] = Rollout(self.version, command, generation, targets, time.time())
        while len(self._rollouts) > ROLLOUTS_KEPT:
            self._rollouts.popitem(last=False)

    def get(self, node_id: str) -> Directive | None:
        return self._by_node.get(node_id)

    def answer(self, node_id: str, known: int) -> Directive | None:
        """A poll from an agent that holds version `known`: records that it has its current
        directive, returns the directive if it is newer than `known`, else None (park the poll).
        The transport calls mark_sent once it has written the answer."""
        d = self._by_node.get(node_id)
        if d is None:
            return None
        if known == d.version:
            d.acked = True
            return None
        if d.version < known:
            return None
        return d

    def mark_sent(self, d: Directive) -> None:
        """d was handed to its node's connection; the last of a version's nodes completes its rollout."""
        if d.sent:
            return
        d.sent = True
        r = self._rollouts.get(d.version)
        if r is not None:
            r.sent += 1
            if r.sent == r.targets and self.on_sent is not None:
                self.on_sent(r, time.time())
