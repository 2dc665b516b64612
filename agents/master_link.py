"""The agent's link to the master: registration (and the rejoin of a restarted master), the directive long-poll
and the heartbeat, each poll and heartbeat on a thread of its own. Directives are handed to the main loop
through a queue, newest version only.

Master epochs (docs/operations.md, "A standby master"): every reply and directive of a master holding the lease
carries its epoch. The link remembers the highest it has seen; a master of an older epoch (a deposed one that
ran on after a pause) is not listened to - the client moves on to the next endpoint - and a newer epoch (a
standby that took over) starts its directive versions afresh."""
from __future__ import annotations

import dataclasses
import logging
import queue
import random
import time
from typing import Any, Callable

from phoenixrun.protocol import messages
from phoenixrun.protocol.client import ControlClient, ControlError
from phoenixrun.protocol.directives import Directive, decode
from phoenixrun.protocol.replies import (Admitted, RelayLink, TurnedAway, Watch, heartbeat_reply,
                                         registration_reply)
from phoenixrun.protocol.constants import DIRECTIVE_POLL_S
from phoenixrun.protocol.relay import FALLBACK_POLL_S
from phoenixrun.agents.node import Lifecycle, NodeState
from phoenixrun.agents.peer import PeerError
from phoenixrun.agents.beats import BeatDesk, BeatLink
from phoenixrun.agents.relay import ParentLink, RelayCache

log = logging.getLogger("phoenixrun.agent")


class MasterLink:
    def __init__(self, node: NodeState, life: Lifecycle, client: ControlClient,
                 registration: messages.Register, heartbeat_interval: float,
                 node_state: Callable[[], messages.Heartbeat], rejoin_state: Callable[[], messages.Rejoin],
                 on_inject: Callable[[str], None],
                 parent: ParentLink | None = None, relay: RelayCache | None = None,
                 beats: BeatLink | None = None, beat_desk: BeatDesk | None = None) -> None:
        """registration: what this node tells the master about itself (host, addresses, nproc_per_node...);
        node_state: the heartbeat's view of the node; rejoin_state: what a restarted master learns from us;
        on_inject: a fault the master asks this node to inject (`phoenixrun inject`); parent: how it polls a relay
        (agents/relay.py: the master's heartbeat replies say which; without one it always polls the master); relay:
        what it holds for its children when it is a relay; beats: how it heartbeats through its relay, beat_desk:
        its children's heartbeats when it is one (agents/beats.py; without them it heartbeats the master)."""
        self.node, self.life, self.client, self.registration = node, life, client, registration
        self.heartbeat_interval = heartbeat_interval
        self.node_state, self.rejoin_state, self.on_inject = node_state, rejoin_state, on_inject
        self.directives: queue.Queue[Directive] = queue.Queue()
        self._version = -1
        self.epoch = 0          # the highest master epoch seen (0: masters without a lease)
        self.parent, self.relay = parent, relay or RelayCache()
        self.beats, self.beat_desk = beats, beat_desk
        self.parent_addr: str | None = None   # the relay this node polls (None: the master)
        self.serves = False                   # it is a relay: its polls speak for its children
        self._direct_until = 0.0              # its relay failed: poll the master directly until then
        self.on_watch: Callable[[Watch], None] = lambda watch: None   # agents/neighbour_watch.py's follow

    def current_master(self, reply: dict[str, Any]) -> bool:
        """Is `reply` from a master this node may listen to? A newer epoch is a new master: its directive versions
        are its own. An older one is a deposed master's: the client moves on to the next endpoint. (An answer
        without an epoch - an expired long-poll's noop - orders nothing.)"""
        if "master_epoch" not in reply:
            return True
        epoch = reply["master_epoch"]
        if not isinstance(epoch, int) or epoch < self.epoch:
            log.warning("ignoring a master of epoch %s (epoch %d acts now): trying the next endpoint", epoch, self.epoch)
            self.client.move_on()
            return False
        if epoch > self.epoch:
            if self.epoch:
                log.warning("master epoch %d at %s (was %d)", epoch, self.client.base, self.epoch)
            self.epoch = epoch
            self._version = -1
        return True

    def register(self, rejoin: messages.Rejoin | None = None, node_rank: int | None = None) -> Admitted | TurnedAway:
        deadline = time.time() + 60
        payload = dataclasses.replace(self.registration, rejoin=rejoin,
                                      node_rank=node_rank if rejoin is None else None).to_wire()
        while True:
            try:
                raw = self.client.post("/v1/register", payload)
                if not self.current_master(raw):
                    raise ControlError("a deposed master answered the registration")
                try:
                    reply = registration_reply(raw)
                except ValueError as e:
                    raise ControlError(f"the master's registration reply: {e}") from None
                if isinstance(reply, Admitted):
                    with self.node.lock:
                        self.node.joined(reply.terms, self.client.host)
                return reply
            except ControlError as e:
                if e.refused or time.time() > deadline:   # refused (4xx): asking again gets the same answer
                    raise
                time.sleep(0.2)

    def rejoin(self) -> None:
        """The master restarted and does not know us: tell it what we are, so it can rebuild the job's
        state from the agents (membership, slots, generation, snapshots)."""
        try:
            reply = self.register(rejoin=self.rejoin_state())
        except ControlError as e:
            log.warning("rejoin failed: %s", e)
            return
        if isinstance(reply, TurnedAway):
            log.error("the master fenced this node on rejoin: %s", reply.reason)
            self.life.stop(0)
            return
        self.node.token = reply.token
        log.warning("rejoined a restarted master as %s%s", reply.role,
                    f" (slot {reply.slot})" if reply.slot is not None else "")

    def poll_directives(self) -> None:
        """Thread: long-poll the master (or this node's relay) for orders until the agent stops."""
        while not self.life.stopping:
            addr, token = self.parent_addr, self.node.token
            if addr and token and self.parent is not None and time.monotonic() >= self._direct_until:
                self._poll_relay(addr, token)
                continue
            direct = time.monotonic() < self._direct_until
            timeout = FALLBACK_POLL_S if direct else DIRECTIVE_POLL_S
            payload: dict[str, object] = {"node_id": self.node.node_id, "token": token, "version": self._version,
                                          "timeout": timeout}
            if self.serves:
                payload["relay"] = self.relay.state()
            try:
                d = self.client.post("/v1/directive", payload, timeout=timeout + 5)
            except ControlError as e:
                log.debug("directive poll failed: %s", e)
                time.sleep(0.2)
                continue
            if not self.current_master(d):
                time.sleep(0.2)
                continue
            if d.get("bundle") == 1:          # a relay's answer: its children's directives, and its own
                self.relay.store(d)
                self.serves = True            # (its next poll speaks for them, even before a heartbeat says so)
                d = d.get("own") or {}
            self._take(d)

    def _poll_relay(self, addr: str, token: str) -> None:
        try:
            d = self.parent.poll(addr, self.node.node_id, token, self._version) if self.parent else None
        except PeerError as e:
            log.info("relay %s failed (%s): polling the master directly", addr, e)
            self._direct_until = time.monotonic() + FALLBACK_POLL_S
            return
        epoch = d.get("master_epoch") if d else None
        if d is None or (isinstance(epoch, int) and epoch < self.epoch):   # a relay replaying a deposed master's
            return
        if self.current_master(d):
            self._take(d)

    def _take(self, d: dict[str, Any]) -> None:
        if isinstance(d.get("version"), int) and d["version"] > self._version and isinstance(d.get("command"), str):
            self._version = d["version"]
            try:
                self.directives.put(decode(d))     # the typed order: protocol/directives.py
            except ValueError as e:
                log.error("directive %s from the master is malformed, ignored: %s", d["version"], e)

    def relay_addr(self) -> str | None:
        """The relay this node polls now (None: the master), where its acks go too (agents/reporter.py)."""
        return self.parent_addr if time.monotonic() >= self._direct_until else None

    def follow(self, relay: RelayLink | None) -> None:
        """The tree as the master's heartbeat reply gives it: this node's relay, and whether it is one (None:
        relaying was never on - as it was)."""
        if relay is None:
            return
        if self.parent_addr is not None and relay.parent != self.parent_addr and self.parent is not None:
            self.parent.leave(self.parent_addr)    # its poll there (hung, maybe) ends: it polls the master at once
        self.parent_addr, self.serves = relay.parent, relay.serves
        if self.beats is not None:
            self.beats.lag = relay.beats

    def heartbeat(self) -> None:
        """Thread: tell the master this node is alive (and what it holds) until the agent stops; as a relay, pass
        on its children's heartbeats right after its own (agents/beats.py)."""
        while not self.life.stopping:
            if not self._beat():
                return
            if self.serves and self.beat_desk is not None:
                self.beat_desk.flush()
            # jittered: agents that got their replies together (after a master stall, say) must not keep
            # heartbeating in step, which would load the master in bursts
            self.life.stopped.wait(self.heartbeat_interval * random.uniform(0.9, 1.1))

    def _beat(self) -> bool:
        """One heartbeat: through this node's relay while the master confirms those in time (protocol/relay.py's
        beat_route), to the master directly otherwise. False: this node was fenced (heartbeat no more)."""
        payload, token, now, beats = self.node_state().to_wire(), self.node.token, time.monotonic(), self.beats
        addr = beats.route(self.relay_addr(), now) if beats is not None and token else None
        if addr is not None and beats is not None and token:     # (the last two: for the type checker)
            try:
                reply = beats.send(addr, self.node.node_id, token, payload)
            except PeerError as e:
                log.info("heartbeat through relay %s failed (%s): sending it to the master", addr, e)
            else:
                if reply is None:             # the master's reply to it comes with the next one
                    return True
                if "error" not in reply:
                    return self._heard(reply)
                log.info("the master refused a heartbeat through the relay (%s): sending it directly", reply["error"])
        try:
            raw = self.client.post("/v1/heartbeat", payload, timeout=max(2.0, self.heartbeat_interval * 4))
            if beats is not None:
                beats.confirmed(now)
            return self._heard(raw)
        except ControlError as e:
            if e.unknown_node:           # a restarted master (Status.UNKNOWN_NODE): it learns the job from us
                self.rejoin()
            # the master may be restarting: keep going (training does not need it), keep trying
            (log.warning if e.refused else log.debug)("heartbeat failed: %s", e)
        return True

    def _heard(self, raw: dict[str, Any]) -> bool:
        """Act on the master's heartbeat reply. False: it fenced this node."""
        if not self.current_master(raw):
            return True
        try:
            reply = heartbeat_reply(raw)
        except ValueError as e:          # a reply this agent cannot read: logged, the next heartbeat goes on
            log.warning("heartbeat reply ignored: %s", e)
            return True
        if isinstance(reply, TurnedAway):    # replaced while it was away: never rejoin
            self.life.fenced(reply.reason, reply.exit_code or 0)
            return False
        self.follow(reply.relay)
        self.on_watch(reply.watch)     # the ring neighbours to watch (agents/neighbour_watch.py)
        for fault in reply.inject:
            self.on_inject(fault)
        return True
