"""The orders the master gives its agents, encoded once when they are set.

An agent long-polls for its directive and gets the bytes stored here: a broadcast to 16K agents
costs one JSON encode when every node gets the same order (quiesce, stop) or one per node when
each order names the node's slot and world (restore, run) - never an encode per delivery, which
is what kept a 16K-node broadcast in the seconds.

Versions only grow (across master restarts too: the first is the clock in microseconds) and one
broadcast is one version; an agent acts on a directive newer than the one it holds.
Not thread-safe: the master calls it with its lock held.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Mapping

from phoenixrun.control import wire


@dataclass
class Directive:
    version: int
    fields: dict          # what the agent gets, as the master set it (shared by a broadcast's nodes)
    body: bytes           # the same, encoded
    acked: bool = False   # the agent polled again holding this version: it has it


class DirectiveBoard:
    def __init__(self, first_version: int | None = None):
        self.version = int(time.time() * 1e6) if first_version is None else first_version
        self._by_node: dict[str, Directive] = {}

    def set(self, node_ids: Iterable[str], **fields) -> list[str]:
        """Give every node in node_ids the directive `fields` under one new version; returns the ids."""
        self.version += 1
        fields["version"] = self.version
        body = wire.dumps(fields)
        ids = list(node_ids)
        for nid in ids:
            self._by_node[nid] = Directive(self.version, fields, body)
        return ids

    def set_each(self, orders: Mapping[str, dict], **common) -> list[str]:
        """Give each node its own directive, `common` merged into each, under one new version."""
        self.version += 1
        common["version"] = self.version
        for nid, own in orders.items():
            fields = {**common, **own}
            self._by_node[nid] = Directive(self.version, fields, wire.dumps(fields))
        return list(orders)

    def get(self, node_id: str) -> Directive | None:
        return self._by_node.get(node_id)

    def answer(self, node_id: str, known: int) -> bytes | None:
        """A poll from an agent that holds version `known`: records that it has its current
        directive, returns the directive if it is newer than `known`, else None (park the poll)."""
        d = self._by_node.get(node_id)
        if d is None:
            return None
        if known == d.version:
            d.acked = True
            return None
        return d.body if d.version > known else None
