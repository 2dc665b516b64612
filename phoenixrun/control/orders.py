"""How the master gives orders: directives on the board (control/directives.py) carrying the generation and
its rendezvous prefix, the wake-up of the parked polls, and the inbox of reports the coordinator consumes.

Call `direct`/`direct_slots` with the job's lock held (they read the membership and the generation).
"""
from __future__ import annotations

import hashlib
import hmac
import queue
import secrets
from dataclasses import replace
from typing import Any, Callable, Iterable, Mapping

from phoenixrun.control.directives import DirectiveBoard, Rollout
from phoenixrun.control.events import EventLog
from phoenixrun.control.jobstate import JobState
from phoenixrun.protocol.directives import Assignment, Order, World
from phoenixrun.protocol.events import DirectiveSent
from phoenixrun.protocol.reports import Report

NOTHING = Assignment()     # a node given nothing of its own


class Inbox(queue.Queue[Report]):
    """Reports (and the master's own findings) for the controller thread, in arrival order."""

    def take(self, which: Callable[[Report], bool]) -> list[Report]:
        """Remove and return the queued reports `which` picks; the others stay queued, in order."""
        taken: list[Report] = []
        keep: list[Report] = []
        while True:
            try:
                ev = self.get_nowait()
            except queue.Empty:
                break
            (taken if which(ev) else keep).append(ev)
        for ev in keep:
            self.put(ev)
        return taken


class Orders:
    def __init__(self, job: JobState, events: EventLog):
        self.job, self.events = job, events
        # directive versions only grow, across master restarts too: agents ignore what is not newer
        self.board = DirectiveBoard(on_sent=self._sent)
        self.wake: Callable[[list[str]], None] = lambda node_ids: None   # the transport's: directives are ready
        self._prefixes: dict[int, str] = {}      # generation -> store prefix (an HMAC: computed once)
        self._prefix_key = secrets.token_bytes(16)   # never leaves the master: see store_prefix()

    def store_prefix(self, generation: int) -> str:
        """Generation fencing: the store key prefix a generation's process groups rendezvous on.

        It carries a token only the master can compute and only current members receive (in their directives),
        so a worker of an older generation - a fenced node's, say - cannot join a newer generation's
        rendezvous even if it guesses the generation number.
        """
        prefix = self._prefixes.get(generation)
        if prefix is None:
            token = hmac.new(self._prefix_key, f"gen{generation}".encode(), hashlib.sha256).hexdigest()[:16]
            prefix = self._prefixes[generation] = f"/phoenixrun/gen{generation}-{token}/"
        return prefix

    def direct(self, node_ids: Iterable[str], order: Order) -> None:
        """Give node_ids `order` (one version, one encoding for all of them) and wake their polls."""
        self.wake(self.board.set(node_ids, **order.to_wire(), **self._generation_fields()))

    def direct_slots(self, order: Order, own: Mapping[int, Assignment] | None = None,
                     world_for: Iterable[int] | None = None) -> None:
        """Give every slot's node `order` (one version for all), with its slot and world: every slot's, or only
        those in world_for (the others keep theirs); own: more of their own for some slots. Nodes given nothing
        of their own share one encoding."""
        own = own or {}
        slots = self.job.members.slots
        world_for = slots.keys() if world_for is None else set(world_for)
        orders = {nid: (replace(own.get(slot, NOTHING), slot=slot, world=self.world(slot)) if slot in world_for
                        else own.get(slot, NOTHING)).to_wire() for slot, nid in slots.items()}
        self.wake(self.board.set_each(orders, **order.to_wire(), **self._generation_fields()))

    def world(self, slot: int) -> World:
        """What the node in `slot` needs of the world: where its ranks' replicas go and those holders'
        addresses. (The whole map in every node's directive would be O(nodes^2) bytes per broadcast.)"""
        job = self.job
        placement, need = job.course.slot_placement[slot]
        return World({s: job.members.nodes[job.members.slots[s]].peer_addr for s in need if s in job.members.slots}, placement,
                     job.store_port)

    def _generation_fields(self) -> dict[str, Any]:
        """What every directive carries: the generation and its rendezvous prefix, and the master's lease epoch
        (agents ignore orders of an epoch older than one they have seen: a deposed master's). The roster is brought
        up to date first: no agent may learn of a generation or a slot the run directory does not vouch for."""
        self.job.save_roster()
        return {"generation": self.job.course.generation, "store_prefix": self.store_prefix(self.job.course.generation),
                "master_epoch": self.job.master_epoch}

    def _sent(self, r: Rollout, t: float) -> None:
        """Every node a directive was set for has been sent it (called with the lock held)."""
        # a broadcast: how long the order took to reach the last node's connection (not the final stop: the
        # job's last event stays job_finished)
        if r.targets > 1 and r.command != "stop":
            self.events.emit(DirectiveSent(command=r.command, version=r.version, nodes=r.targets,
                                           seconds=round(t - r.set_at, 4)),
                             self.job.course.generation if r.generation is None else r.generation)
