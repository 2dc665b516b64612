"""Who relays the master's directives to whom: a two-level fan-out tree over the job's members (pure functions).

Above a membership of `threshold` nodes the master answers ~sqrt(N) relays, and each relay serves ~sqrt(N)
children, so a broadcast costs the master O(sqrt N) writes instead of N. The tree never gets deeper than two
hops (master -> relay -> child): a relay is never another relay's child. Relays are spread over fault domains
(racks) first, then hosts, so a rack that goes dark takes few relays with it; children are given to relays in
contiguous blocks of the (domain, host, id) order, so a child's relay is most often in its own rack.

A relay that dies is only a re-parenting: its children go to the least loaded surviving relays (the others keep
theirs: a stable tree moves no one who did not need to move); with no relay left, everyone polls the master. A
child whose relay is unreachable before the master has re-planned polls the master directly meanwhile (the
master holds every node's directive, so no order is lost and, since agents act only on newer versions, none is
acted on twice).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence


@dataclass(frozen=True, order=True)
class Member:
    """A node as the tree sees it: where it runs (racks and hosts are spread over when relays are picked)."""
    domain: str
    host: str
    node_id: str


@dataclass(frozen=True)
class Tree:
    """parent: node id -> the relay it polls, None for the master itself. Every member has exactly one entry."""
    parent: Mapping[str, str | None] = field(default_factory=dict)

    @property
    def relays(self) -> tuple[str, ...]:
        """The nodes others poll (sorted)."""
        return tuple(sorted({p for p in self.parent.values() if p is not None}))

    def children(self, relay: str) -> tuple[str, ...]:
        return tuple(sorted(n for n, p in self.parent.items() if p == relay))

    def direct(self) -> tuple[str, ...]:
        """The nodes the master answers itself: the relays and any node without one (its writes per broadcast)."""
        return tuple(sorted(n for n, p in self.parent.items() if p is None))

    def loads(self) -> dict[str, int]:
        """relay -> how many children it serves (relays without children are not relays)."""
        out: dict[str, int] = {}
        for p in self.parent.values():
            if p is not None:
                out[p] = out.get(p, 0) + 1
        return out


def relay_count(n: int) -> int:
    """How many relays serve n members: ceil(sqrt(n)), which minimises the larger of the master's writes
    (relays) and a relay's (children) per broadcast."""
    return math.isqrt(n - 1) + 1 if n > 0 else 0


def spread(members: Sequence[Member], k: int) -> list[Member]:
    """k members taken round-robin over domains, and within a domain over its hosts (first member of each host
    first): relays land on as many racks and hosts as there are."""
    domains: dict[str, dict[str, list[Member]]] = {}
    for m in sorted(members, key=_key):
        domains.setdefault(m.domain, {}).setdefault(m.host, []).append(m)
    # per domain: its first k members in host-round-robin order (no domain gives more than k)
    per_domain = [_round_robin(list(hosts.values()), k) for _, hosts in sorted(domains.items())]
    return _round_robin(per_domain, k)


def _key(m: Member) -> tuple[str, str, str]:
    """(domain, host, id): the order relays are spread in and children are blocked by (a key function: the
    dataclass's own comparisons build two tuples per comparison)."""
    return (m.domain, m.host, m.node_id)


def _round_robin(queues: list[list[Member]], limit: int) -> list[Member]:
    """The first `limit` of: each queue's first, then each one's second, ..."""
    out: list[Member] = []
    depth = max((len(q) for q in queues), default=0)
    for i in range(depth):
        out.extend(q[i] for q in queues if i < len(q))
        if len(out) >= limit:
            break
    return out[:limit]


def plan(members: Iterable[Member], threshold: int) -> Tree:
    """The tree for `members`: flat (everyone polls the master) below `threshold` members (or with threshold
    <= 0: relaying off), else ceil(sqrt(n)) relays with the others shared out in balanced contiguous blocks."""
    ms = sorted(set(members), key=_key)
    if threshold <= 0 or len(ms) < max(threshold, 2):
        return Tree({m.node_id: None for m in ms})
    relays = spread(ms, relay_count(len(ms)))
    chosen = {r.node_id for r in relays}
    rest = [m for m in ms if m.node_id not in chosen]
    order = sorted(relays, key=_key)   # blocks follow the same (domain, host, id) order: children near their relay
    parent: dict[str, str | None] = {r.node_id: None for r in relays}
    k = len(order)
    for i, m in enumerate(rest):
        parent[m.node_id] = order[i * k // len(rest)].node_id
    return Tree(parent)


def reparent(tree: Tree, dead: Iterable[str]) -> Tree:
    """`tree` without the `dead` nodes: the children of a dead relay go, one at a time in id order, to the
    surviving relay serving fewest (ties: lowest id); nobody else moves. No relay left: they poll the master."""
    gone = set(dead)
    loads = {r: n for r, n in tree.loads().items() if r not in gone}
    parent: dict[str, str | None] = {}
    orphans: list[str] = []
    for node, p in tree.parent.items():
        if node in gone:
            continue
        if p is not None and p in gone:
            orphans.append(node)
        else:
            parent[node] = p
    for node in sorted(orphans):
        parent[node] = _least_loaded(loads)
    return Tree(parent)


def _least_loaded(loads: dict[str, int]) -> str | None:
    if not loads:
        return None
    relay = min(loads, key=lambda r: (loads[r], r))
    loads[relay] += 1
    return relay


def update(tree: Tree, members: Iterable[Member], threshold: int) -> Tree:
    """The tree for a membership that changed: the dead re-parented and newcomers given to the least loaded
    relays while the relay count stays within [sqrt(n)/2, 2 sqrt(n)] of its ideal; a fresh plan otherwise (or
    when the membership crosses the threshold either way)."""
    ms = {m.node_id: m for m in members}
    if threshold <= 0 or len(ms) < max(threshold, 2) or not any(p is not None for p in tree.parent.values()):
        return plan(ms.values(), threshold)      # (a fresh plan only when needed: it sorts every member)
    kept = reparent(tree, set(tree.parent) - set(ms))
    loads = kept.loads()
    ideal = relay_count(len(ms))
    if not ideal / 2 <= len(loads) <= 2 * ideal:
        return plan(ms.values(), threshold)
    parent = dict(kept.parent)
    for node in sorted(set(ms) - set(parent)):
        parent[node] = _least_loaded(loads)
    return Tree(parent)


def groups(tree: Tree) -> dict[str, frozenset[str]]:
    """relay -> its children, in one pass."""
    out: dict[str, set[str]] = {}
    for node, p in tree.parent.items():
        if p is not None:
            out.setdefault(p, set()).add(node)
    return {r: frozenset(c) for r, c in out.items()}


def changed_relays(old: Tree, new: Tree) -> list[str]:
    """The relays of `new` whose children are not those they had in `old` (they must hear of the change)."""
    before, after = groups(old), groups(new)
    return sorted(r for r, kids in after.items() if before.get(r) != kids)


def route(tree: Tree, node_ids: Iterable[str]) -> set[str]:
    """The polls to wake for directives set for node_ids: each node's own (it may be polling the master
    directly: a fallback) and its relay's."""
    out: set[str] = set()
    for nid in node_ids:
        out.add(nid)
        p = tree.parent.get(nid)
        if p is not None:
            out.add(p)
    return out
