"""Who is in the job, as the master knows it: the nodes registered (active, spare, failed), which holds each
slot, when each was last heard from, what their registrations were given, what the run directory's roster
vouches for, and what a restarted master learned from the agents that rejoined it. Nothing here acts on it.

Called with JobState.cv held (control/jobstate.py), like the rest of the master's data.
"""
from __future__ import annotations

from collections import OrderedDict

from phoenixrun.control.roster import Roster, TrackedSlots
from phoenixrun.control.state import FreeSlots, NodeRecord, Role


class Membership:
    def __init__(self, nnodes: int) -> None:
        self.nodes: dict[str, NodeRecord] = {}
        # slot -> node id, current generation (changes: the roster)
        self.slots: dict[int, str] = TrackedSlots()
        self.free_slots = FreeSlots(nnodes)  # what registrations before the start fill
        self.heard: OrderedDict[str, None] = OrderedDict()   # node ids, least recently heard from first
        self.api_nodes: set[str] = set()
        self.tokens: dict[str, str] = {}         # node id -> the token its registration was given
        self.nonces: dict[str, str] = {}         # node id -> digest of its agent's nonce (never served: roster.py)
        # what the run directory vouches for (control/roster.py): set by the Master; None: nothing (no rejoins)
        self.roster: Roster | None = None
        self.fenced: set[str] = set()            # replaced nodes already told to go (one event each)
        self.injections: dict[str, list[str]] = {}
        self.done_nodes: set[str] = set()
        # nodes reported lost (control/monitor.py), whose recovery may not have replaced them yet: no longer relays
        self.lost: set[str] = set()
        # a restarted master: what the rejoining agents told it
        self.peer_hint: dict[int, str] = {}       # slot -> peer address, as the rejoining agents knew it
        self.rejoin_generation: dict[str, int] = {}   # node -> generation it reported when rejoining

    def add_node(self, node: NodeRecord) -> None:
        self.nodes[node.node_id] = node
        self.lost.discard(node.node_id)
        self.heard[node.node_id] = None
        self.heard.move_to_end(node.node_id)
        if node.api:
            self.api_nodes.add(node.node_id)
        if node.slot is not None:
            self.slots[node.slot] = node.node_id

    def actives(self) -> list[NodeRecord]:
        return [n for n in self.nodes.values() if n.role == Role.ACTIVE]

    def newest_snapshots(self) -> dict[int, int]:
        """rank -> the newest step any active node holds a snapshot of it at (its own or a replica)."""
        newest: dict[int, int] = {}
        for n in self.nodes.values():
            if n.role == Role.ACTIVE:
                for r, steps in n.snapshots.items():
                    if steps:
                        newest[r] = max(newest.get(r, steps[0]), max(steps))
        return newest
