"""The master's recovery procedures: hot swap (quiesce -> plan -> restore -> resume, restarted at
quiesce with a new generation when a fault arrives mid-way), the persistent-checkpoint fallback and the
torchrun-style restart.

They run on the master's controller thread, one at a time (control/coordinator.py calls them), and carry
out decisions made elsewhere: the pure functions of control/decide.py and control/state.py (`plan_recovery`,
`pick_spare`). Their collaborators - the job's state, the orders, the event log, the inbox, the prober - come
through the constructor; the state is read and changed under its lock (control/jobstate.py).
"""
from __future__ import annotations

import logging
import queue
import random
import threading
import time
from typing import Callable, Iterable

from phoenixrun import persist_layout as persist   # torch-free: the master never reaches the DCP writer
from phoenixrun.control.decide import (NODE_LOSSES, after_cascade, attempt_ranks, attempt_verdict, detail_of,
                                       drain_step, fallback_attempts, fault_text, loss_verdict, plan_drain, signal_of)
from phoenixrun.control.events import EventLog
from phoenixrun.control.incidents import Incidents
from phoenixrun.control.jobstate import JobState
from phoenixrun.control.orders import Inbox, Orders
from phoenixrun.control.probe import unreachable
from phoenixrun.control import layout_file
from phoenixrun.control.reshape import Refusal, ReshapePlan, plan_grow, plan_shrink
from phoenixrun.control.state import NodeRecord, Phase, PlanError, RecoveryPlan, Role, by_rank, pick_spare, plan_recovery
from phoenixrun.faults import Action
from phoenixrun.faults.escalate import settle
from phoenixrun.protocol.names import Command, Event, ReportKind

log = logging.getLogger("phoenixrun.master")

PROBE_AFTER_S = 0.3   # a recovery phase without a new ack this long: probe the nodes it waits for
PROBE_MAX = 512       # ... this many at a time
DRAIN_DELIVERY_S = 0.5   # a drain's quiesce order reaches every worker within this (plus the heartbeats' staleness)

Probe = Callable[[list[str], float, bool], set[str]]   # control/probe.py's unreachable(addrs, timeout, silent_is_dead)


class Cascade(Exception):
    """A new fault arrived while a recovery was in flight: start over at QUIESCE."""

    def __init__(self, reason: str, event: dict | None = None):
        super().__init__(reason)
        self.event = event or {}


EXIT_MISMATCH = 2    # a checkpoint of another model or optimizer: the user's mistake, as a usage error


def mismatch_reason(ev: dict, step: int | None, persist_dir) -> str:
    """The job's end reason when a rank refused the restored state's layout. Pure."""
    where = f"checkpoint step {step} in {persist_dir}" if step is not None and persist_dir else "the restored state"
    return (f"{where} does not match the script (rank {ev.get('rank')}: {ev.get('reason')}): it was written by "
            "another model or optimizer; start a new run (without --resume, another --rdzv-id or --run-dir), or "
            "point --persist-dir at this script's checkpoints")


def stop_if_mismatch(ev: dict, step: int | None, persist_dir) -> bool:
    """A restore_failed report of a state whose layout is not the script's ends the job (Stop): no retry and no
    older checkpoint can help. False for any other restore failure (of which an `integrity` one - the plan's source
    holds other bytes - fails the plan: the same plan again cannot succeed)."""
    if ev.get("mismatch"):
        raise Stop(EXIT_MISMATCH, mismatch_reason(ev, step, persist_dir))
    return False


class Stop(Exception):
    """The job fails: exit_code and the reason the master gives (raised where a recovery cannot go on)."""

    def __init__(self, exit_code: int, reason: str):
        super().__init__(reason)
        self.exit_code, self.reason = exit_code, reason


class NoSpare(Exception):
    """No spare registered within --spare-wait for these slots, and --on-no-spare shrink: the caller shrinks."""

    def __init__(self, slots: set[int], reached: int = 0):
        super().__init__(f"no spare for slot(s) {sorted(slots)}")
        self.slots, self.reached = slots, reached    # reached: the survivors' next step as they quiesced


class Acks:
    """Acknowledgements of one recovery phase (`quiesced` or `resumed` of generation g): O(1) per
    ack, so waiting for 16K of them is not quadratic."""

    def __init__(self, kind: str, generation: int, expected: Iterable[str],
                 on_ack: Callable[[dict], None] | None = None):
        self.kind, self.generation, self.on_ack = kind, generation, on_ack
        self.pending = set(expected)
        self.got: dict[str, dict] = {}

    def add(self, ev: dict) -> None:
        self.got[ev["node_id"]] = ev
        self.pending.discard(ev["node_id"])
        if self.on_ack is not None:
            self.on_ack(ev)

    @property
    def done(self) -> bool:
        return not self.pending


def unreachable_nodes(probe: Probe, nodes: list[NodeRecord], timeout: float = 0.5,
                      silent_is_dead: bool = True) -> list[NodeRecord]:
    """Agents whose peer server does not accept a connection: a fast root-cause check. All
    probed at once (a killed node refuses in microseconds, a hung host costs one timeout)."""
    dead = probe([n.peer_addr for n in nodes], timeout, silent_is_dead)
    return [n for n in nodes if n.peer_addr in dead]


class Recoveries:
    """Everything here runs on the controller thread (see the module docstring)."""

    def __init__(self, job: JobState, orders: Orders, events: EventLog, inbox: Inbox, probe: Probe = unreachable):
        self.cfg, self.job, self.orders, self.events, self.inbox, self.probe = job.cfg, job, orders, events, inbox, probe
        self._attempt_stores: dict = {}     # generation -> the TCPStore of that restart attempt
        self.incidents = Incidents(job)     # the incident being handled: one console line closes it

    def absorb(self, ev: dict) -> None:
        self.job.absorb(ev, self.events.emit)
        if ev.get("kind") == ReportKind.LAYOUT:    # kept for a restarted master (control/layout_file.py)
            layout_file.save(self.cfg.run_dir, self.cfg.run_id, self.job.peer_set)

    # ---------------------------------------------------------------- torchrun-style restart
    def restart(self, lost: set[int], failing_code: int | None, why: str) -> None:
        """torchrun's restart: every worker restarted from scratch (spares fill `lost`), counted once.

        Each attempt rendezvouses on a TCPStore of its own (a fresh port in the directive): scripts
        without the API join with TORCHELASTIC_USE_AGENT_STORE=True and no key prefix, so on a shared
        store the second attempt read the first attempt's gloo addresses (measured: 3 of 3 restarts failed
        in connectFullMesh, one hung for 10 minutes). An attempt that does not come up is stopped with
        the ranks that never arrived (`_check_attempt`)."""
        if self.job.restart_count >= self.cfg.max_restarts:
            raise Stop(failing_code or 1, f"{why}; no restarts left (--max-restarts {self.cfg.max_restarts})")
        self._replace_slots(lost)
        with self.job.cv:
            self.job.restart_count += 1
            self.job.generation += 1
            self.job.done_nodes.clear()
            self.job.restored_step = None        # every worker starts from scratch
            port = self._attempt_store(self.job.generation)
            done = self.events.emit(Event.RESTART, self.job.generation, restart_count=self.job.restart_count,
                                    reason=why, store_port=port)
            self.orders.direct_slots(Command.RESTART, restart_count=self.job.restart_count, restore_step=None, store_port=port)
            self.job.phase = Phase.RUNNING
        self.incidents.close(done)
        self.drain_stale()
        self._arm_attempt_check(self.job.generation, None)

    def _attempt_store(self, generation: int) -> int:
        """A TCPStore for one restart attempt; the previous attempt's (its workers are gone) is closed."""
        from torch.distributed import TCPStore
        store = TCPStore(self.cfg.host, 0, is_master=True, wait_for_workers=False, use_libuv=True)
        self._attempt_stores = {generation: store}
        return store.port

    def _arm_attempt_check(self, generation: int, joined: int | None) -> None:
        timer = threading.Timer(self.cfg.recovery_timeout, self.inbox.put,
                                args=({"kind": ReportKind.ATTEMPT_CHECK, "generation": generation, "joined": joined},))
        timer.daemon = True
        timer.start()

    def check_attempt(self, ev: dict) -> None:
        """Did restart attempt `generation` come up? (decide.attempt_verdict) Up: done; hanging: the job stops
        with the ranks that are missing; else look again one --recovery-timeout later."""
        g = ev.get("generation")
        store = self._attempt_stores.get(g)
        if store is None or g != self.job.generation or self.job.phase != Phase.RUNNING:
            return
        world = self.job.layout.world_size
        joined = attempt_ranks(store.list_keys(), world)
        if len(joined) == world:
            return
        missing = attempt_verdict(joined, world, ev.get("joined"))
        if missing is not None:
            raise Stop(1, f"restart {self.job.restart_count} did not come up: rank(s) {missing} never reached "
                          f"init_process_group within --recovery-timeout {self.cfg.recovery_timeout:g}s "
                          f"while {len(joined)} of {world} ranks waited for them")
        self._arm_attempt_check(g, len(joined))

    def drain_stale(self) -> None:
        """Drop reports about the generation that was just torn down."""
        g = self.job.generation
        self.inbox.take(lambda ev: ev.get("kind") != "node_lost" and ev.get("generation", g) < g)

    def _replace_slots(self, lost: set[int], out: dict[int, str] | None = None, may_shrink: bool = False,
                       since: dict[int, float] | None = None, whole: bool = True) -> dict[int, str]:
        """Promote a spare into every lost slot (waiting up to --spare-wait for one), each recorded in `out` at once
        (a cascade must not forget the spares promoted before it). may_shrink: a hot swap's, with --on-no-spare
        shrink - NoSpare for the slots left without one (the others keep their spare). since: slot ->
        when the wait for its spare began (kept by a hot swap across its cycles: a cascade does not restart the
        wait). whole: every worker restarts anyway (a torchrun-style restart, a fallback): a fault meanwhile only
        adds the slots of lost nodes (pump puts them in `lost`); else (a hot swap's cycle) it starts the cycle
        over at QUIESCE. Uncaught there, a survivor's worker dying during the wait crashed the master (issue 31)."""
        out = {} if out is None else out
        since = {} if since is None else since
        while pending := sorted(lost - out.keys()):
            slot = pending[0]
            deadline = since.setdefault(slot, time.time()) + self.cfg.spare_wait
            with self.job.cv:
                failed_id = self.job.slots[slot]
                failed = self.job.nodes[failed_id]
                spare = pick_spare(self.job.nodes, avoid_domains=[failed.fault_domain])
                if spare is not None:
                    failed.role, failed.slot = Role.FAILED, None
                    spare.role, spare.slot = Role.ACTIVE, slot
                    self.job.slots[slot] = spare.node_id
                    self.job.fault_history.pop(slot, None)   # escalation history belongs to the old node
                    self.events.emit(Event.SPARE_PROMOTED, self.job.generation, slot=slot, node=spare.node_id,
                                     replaces=failed_id)
                    out[slot] = spare.node_id
                    since.pop(slot, None)
                    continue
            if time.time() > deadline:
                if may_shrink and self.cfg.on_no_spare == "shrink" and not out:
                    raise NoSpare(set(lost))
                raise Stop(75, f"node in slot {slot} lost and no spare registered within "
                               f"--spare-wait {self.cfg.spare_wait:g}s")
            try:
                self.pump(min(0.5, max(0.01, deadline - time.time())), lost)
            except (Cascade, PlanError) as c:
                if not whole:
                    raise
                log.warning("while waiting for a spare (every worker restarts anyway): %s", c)
        return out

    # ---------------------------------------------------------------- persistent fallback
    def newest_checkpoint(self) -> int | None:
        if self.cfg.persist_dir is None:
            return None
        return persist.newest_complete(self.cfg.persist_dir, self.job.layout.world_size, exclude=self.job.bad_checkpoints)

    def fallback(self, lost: set[int], reason: str, counted: bool = True) -> bool:
        """Restart every worker from the newest complete persistent checkpoint (spares fill `lost`).

        For what in-memory recovery cannot cover: the owner of a shard and all its replica holders
        lost together, or a fault class that must not be hot-swapped around. A checkpoint that fails
        to load (checksum) is never resumed from: the next older one is tried. False: nothing to
        fall back to (no checkpoint, or --max-fallbacks used up)."""
        tries = fallback_attempts(self.job.fallbacks, self.cfg.max_fallbacks, counted)
        if tries == 0:
            return False
        t0 = time.time()
        for attempt in range(tries):
            step = self.newest_checkpoint()
            if step is None:
                return False
            self._replace_slots(lost)
            lost.clear()
            with self.job.cv:
                self.job.generation += 1
                g = self.job.generation
                self.job.fallbacks += counted or attempt > 0
                self.job.restart_count += 1
                self.job.phase = Phase.RESTORE
                self.job.done_nodes.clear()
                self.job.restored_step = step
                self.events.emit(Event.FALLBACK_RESTART, g, restore_step=step, reason=reason, fallbacks=self.job.fallbacks,
                                 checkpoint=str(persist.step_dir(self.cfg.persist_dir, step)))
                self.orders.direct_slots(Command.RESTART, restart_count=self.job.restart_count, restore_step=step)
                resumed = Acks(ReportKind.RESUMED, g, self.job.slots.values())
            try:
                self._wait_event(resumed, self.cfg.recovery_timeout, lost)
            except (Cascade, PlanError) as c:     # PlanError: a late refusal of the plan before (stale)
                if getattr(c, "event", {}).get("persist_step") == step:
                    self.job.bad_checkpoints.add(step)
                    self.events.emit(Event.CHECKPOINT_REJECTED, g, step=step, reason=c.event.get("reason", ""))
                log.warning("fallback to checkpoint step %d interrupted: %s", step, c)
                continue
            with self.job.cv:
                self.job.phase = Phase.RUNNING
                done = self.events.emit(Event.FALLBACK_DONE, g, restore_step=step,
                                        duration_s=round(time.time() - t0, 4))
            self.incidents.close(done)
            self.drain_stale()
            return True
        raise Stop(1, f"restart from the persistent checkpoint kept failing ({reason}); "
                      f"{tries} tries, --max-fallbacks {self.cfg.max_fallbacks} used up")

    # ---------------------------------------------------------------- hot swap
    def hot_swap(self, lost: set[int], node: NodeRecord, ev: dict, action: Action,
                  failing_code: int | None, fresh: dict[int, str] | None = None) -> None:
        """fresh: slots a spare was promoted into before (an interrupted drain's), which hold no state yet."""
        t0 = time.time()
        cause = ev.get("detail") or ev.get("text") or ev.get("kind")
        if self.incidents.current is None:   # not opened by the coordinator (an interrupted drain): this is it
            self.incidents.open({"t": ev.get("t", t0), "node": node.node_id, "slot": node.slot,
                                "signal": ev.get("kind"), "detail": cause})
        with self.job.cv:
            self.events.emit(Event.RECOVERY_STARTED, self.job.generation + 1, failed_node=node.node_id,
                             slot=node.slot, cause=cause, action=action.value)
        attempts = 0
        fresh = dict(fresh or {})     # slot -> spare promoted during this recovery (holds no state yet)
        waiting: dict[int, float] = {}   # slot -> when its wait for a spare began, across cycles
        while True:
            attempts += 1
            try:
                plan, phases, reached = self._recovery_cycle(lost, fresh, waiting)
                break
            except NoSpare as e:
                self.shrink(e.slots, node, t0, e.reached)
                return
            except Cascade as c:
                log.warning("fault during recovery, restarting at quiesce: %s", c)
                pause = after_cascade(attempts)
                if pause is None:   # the persistent checkpoint, else torchrun's restart, before giving up
                    why = f"recovery kept failing ({attempts} tries): {c}"
                    self.events.emit(Event.RECOVERY_FAILED, self.job.generation, reason=why)
                    if not self.fallback(lost, why):
                        self.restart(lost, failing_code, why)
                    return
                self._settle(pause, lost)
            except PlanError as e:
                self.inbox.take(lambda q: q.get("kind") == "restore_failed")   # other ranks' of the same plan
                self.events.emit(Event.RECOVERY_FAILED, self.job.generation, reason=str(e))
                # no in-memory state to resume from: the persistent checkpoint, else torchrun-style restart
                if not self.fallback(set(), f"in-memory recovery impossible: {e}"):
                    self.restart(set(), failing_code, f"in-memory recovery impossible: {e}")
                return
        with self.job.cv:
            self.job.recoveries += 1
            self.job.phase = Phase.RUNNING
            self.job.done_nodes.clear()
            done = self.events.emit(Event.RECOVERY_DONE, self.job.generation, restored_step=plan.restore_step,
                                    replayed_steps=max(0, reached - plan.restore_step), steps_completed_before=reached,
                                    duration_s=round(time.time() - t0, 4),
                                    detect_to_done_s=round(time.time() - ev.get("t", t0), 4),
                                    replaced_slots=plan.replaced_slots, attempts=attempts, phases=phases)
            # one directive for every node: each got its slot and world with the restore order
            self.orders.direct(self.job.slots.values(), command=Command.RUN, restart_count=self.job.restart_count, resume=True)
        self.incidents.close(done)
        self.drain_stale()

    def _settle(self, seconds: float, lost: set[int]) -> None:
        """Handle reports for `seconds` before a hot swap's next cycle: a node lost meanwhile joins `lost` (the
        next cycle's quiesce finds every other fault itself)."""
        deadline = time.time() + seconds
        while (left := deadline - time.time()) > 0:
            try:
                self.pump(left, lost)
            except (Cascade, PlanError) as c:
                log.info("while settling before the next recovery cycle: %s", c)

    # ---------------------------------------------------------------- shrink and grow
    def shrink(self, lost: set[int], node: NodeRecord, t0: float, reached: int) -> None:
        """Go on without the nodes of `lost` (no spare within --spare-wait, --on-no-spare shrink). The survivors
        are quiesced already and their inventories current; control/reshape.py decides, `_reshape` carries out."""
        job = self.job
        with job.cv:
            alive = {s: job.nodes[nid] for s, nid in job.slots.items() if s not in lost}
            plan = plan_shrink(job.layout, lost, {s: n.snapshots for s, n in alive.items()},
                               {s: n.replicas for s, n in alive.items()}, job.placement)
            if isinstance(plan, Refusal):
                self.events.emit(Event.RECOVERY_FAILED, job.generation, reason=f"cannot shrink: {plan.reason}")
                raise Stop(75, f"node(s) in slot(s) {sorted(lost)} lost, no spare registered within --spare-wait "
                               f"{self.cfg.spare_wait:g}s, and the job cannot shrink: {plan.reason}")
            gone = {}
            for s in lost:
                failed = job.nodes[job.slots[s]]
                gone[s] = failed.node_id
                failed.role, failed.slot = Role.FAILED, None
                job.fault_history.pop(s, None)
        self._reshape(plan, {}, t0, reached, lost_nodes=gone, cause=node.last_fault or "node lost")

    def grow(self) -> None:
        """A shrunk job with a spare registered: quiesce, take the spare into a new last slot, re-partition."""
        job = self.job
        t0 = time.time()
        with job.cv:
            spare = pick_spare(job.nodes, avoid_domains=[]) if job.shrunk and job.phase == Phase.RUNNING else None
            if spare is None:
                return
            job.generation += 1
            g = job.generation
            job.phase = Phase.QUIESCE
            members = list(job.slots.values())
            self.orders.direct(members, command=Command.QUIESCE)
        quiesced = Acks(ReportKind.QUIESCED, g, members, on_ack=self._quiesced_inventory)
        try:
            self._wait_event(quiesced, self.cfg.recovery_timeout, set())
        except (Cascade, PlanError) as c:
            raise Stop(1, f"a fault while growing the job back: {c}") from None
        reached = max((a.get("next_step", 0) for a in quiesced.got.values()), default=0)
        with job.cv:
            plan = plan_grow(job.layout, 1, {s: job.nodes[nid].snapshots for s, nid in job.slots.items()},
                             self.cfg.nnodes)
            if isinstance(plan, Refusal) or spare.role != Role.SPARE:
                why = plan.reason if isinstance(plan, Refusal) else "the spare is gone"
                raise Stop(1, f"cannot grow the job back after quiescing it: {why}")
            self.events.emit(Event.SPARE_PROMOTED, g, slot=plan.new_slots[0], node=spare.node_id, replaces=None)
        self._reshape(plan, {plan.new_slots[0]: spare}, t0, reached, added=spare.node_id)

    def _reshape(self, plan: ReshapePlan, joining: dict[int, NodeRecord], t0: float, reached: int, **what) -> None:
        """Carry a shrink or grow plan out: renumber the slots, relay the job out, restart every worker from
        memory with its `reshard` order (agents hand the old ranks' snapshots to the new workers, which
        re-partition them: runtime/reshard.py), wait until every rank resumed, then let them run.

        The old snapshots leave the agents' slots when the workers restart: a fault before every rank resumed
        cannot be recovered in memory, and the job stops (with --persist-every, start it again to resume)."""
        job = self.job
        with job.cv:
            job.generation += 1
            g = job.generation
            renumbered = {plan.slot_map[s]: nid for s, nid in job.slots.items() if s in plan.slot_map}
            renumbered.update({s: n.node_id for s, n in joining.items()})
            job.slots.clear()
            job.slots.update(renumbered)
            for s, nid in renumbered.items():
                n = job.nodes[nid]
                n.role, n.slot = Role.ACTIVE, s
                n.snapshots, n.replicas = {}, {}     # keyed by the old ranks: the new ones report theirs
            job.relayout(plan.new)
            job.phase = Phase.RESTORE
            job.restored_step = plan.restore_step
            job.attempts = settle(job.attempts, plan.restore_step)
            job.done_nodes.clear()
            self.orders.direct_slots(Command.RESTART, own={s: {"reshard": plan.reshard_for(s), "nnodes": plan.new.nnodes}
                                                         for s in renumbered},
                                     restart_count=job.restart_count, restore_step=plan.restore_step)
            resumed = Acks(ReportKind.RESUMED, g, renumbered.values())
        try:
            self._wait_event(resumed, self.cfg.recovery_timeout, set())
        except (Cascade, PlanError) as c:
            raise Stop(1, f"a fault while the job was being re-partitioned ({plan.kind}): {c}") from None
        with job.cv:
            job.recoveries += 1
            job.phase = Phase.RUNNING
            done = self.events.emit(Event.JOB_SHRUNK if plan.kind == "shrink" else Event.JOB_GROWN, g,
                                    nnodes=plan.new.nnodes, world_size=plan.new.world_size, was_nnodes=plan.old.nnodes,
                                    was_world_size=plan.old.world_size, restored_step=plan.restore_step,
                                    replayed_steps=max(0, reached - plan.restore_step), steps_completed_before=reached,
                                    slot_map=dict(plan.slot_map), duration_s=round(time.time() - t0, 4), **what)
            self.orders.direct(job.slots.values(), command=Command.RUN, restart_count=job.restart_count, resume=True)
        if plan.kind == "shrink":
            self.incidents.close(done)
        self.drain_stale()

    # ---------------------------------------------------------------- planned drain
    def drain(self, node: NodeRecord, reason: str, t_requested: float) -> None:
        """Move a healthy node's ranks to a spare with nothing replayed (docs/operations.md, "Planned drains").

        Every node is told to quiesce at one step boundary (`at_step`, decide.drain_step: past any step a rank
        can have started by the time the order arrives); each rank runs on to it, waits for that step's
        snapshot to commit and stops there, no socket shut down (no rank is inside a step with it). The plan
        (decide.plan_drain) restores every rank at that step: the survivors from their own agents, the drained
        node's ranks on the spare, fetched from the drained node's agent itself. Only then is the drained node
        told to stop. A fault meanwhile turns the drain into an ordinary hot swap of the drained slot (the
        drained node is stopped first), which replays at most one step."""
        job = self.job
        t0 = time.time()
        slot = node.slot
        with job.cv:
            node.draining = reason
            newest = max(job.newest_snapshots().values(), default=0)
            heard = min((n.last_heartbeat for n in job.actives()), default=t0)
            at_step = drain_step(newest, job.steps_per_s(), max(0.0, t0 - heard) + DRAIN_DELIVERY_S)
            job.generation += 1
            g = job.generation
            job.phase = Phase.QUIESCE
            self.events.emit(Event.RECOVERY_STARTED, g, failed_node=node.node_id, slot=slot, cause="drain",
                             action="drain", reason=reason, at_step=at_step)
            members = list(job.slots.values())
            self.orders.direct(members, command=Command.QUIESCE, at_step=at_step)
        lost: set[int] = set()
        phases: dict[str, float] = {}
        quiesced = Acks(ReportKind.QUIESCED, g, members, on_ack=self._quiesced_inventory)
        try:
            self._wait_event(quiesced, self.cfg.recovery_timeout, lost)
        except (Cascade, PlanError) as c:
            self._drain_interrupted(node, lost, {}, c)
            return
        phases["quiesce_s"] = round(time.time() - t0, 4)
        reached = max((a.get("next_step", 0) for a in quiesced.got.values()), default=0)
        t = time.time()
        with job.cv:
            spare = pick_spare(job.nodes, avoid_domains=[node.fault_domain])
            try:
                plan = plan_drain(job.layout, job.nodes, job.slots, slot, spare and spare.node_id)
            except PlanError as e:
                plan = None
                why = e
            if plan is not None and spare is not None:
                spare.role, spare.slot = Role.ACTIVE, slot
                node.role, node.slot = Role.DRAINED, None
                job.slots[slot] = spare.node_id
                job.fault_history.pop(slot, None)
                self.events.emit(Event.SPARE_PROMOTED, g, slot=slot, node=spare.node_id, replaces=node.node_id)
            elif plan is not None:
                node.draining = None     # no spare any more: everyone resumes in place, the node stays
                log.warning("drain of slot %s: the spare is gone; resuming in place", slot)
        if plan is None:
            self._drain_interrupted(node, lost, {}, Cascade(f"drain plan impossible: {why}"))
            return
        with job.cv:
            job.phase = Phase.RESTORE
            job.restored_step = plan.restore_step
            job.attempts = settle(job.attempts, plan.restore_step)
            phases["plan_s"] = round(time.time() - t, 4)
            self._order_restore(g, plan, cause="drain")
        t = time.time()
        resumed = Acks(ReportKind.RESUMED, g, plan.slots.values())
        try:
            self._wait_event(resumed, self.cfg.recovery_timeout, lost)
        except (Cascade, PlanError) as c:   # PlanError: the drained node's bytes fail the checksum
            self._drain_interrupted(node, lost, dict(plan.replaced_slots), c)
            return
        phases["restore_s"] = round(time.time() - t, 4)
        for key in ("rebuild_s", "params_s", "optimizer_s", "fetch_s", "spawn_s"):
            vals = [r.get("timings", {}).get(key) for r in resumed.got.values() if r.get("timings", {}).get(key) is not None]
            if vals:
                phases[key] = round(max(vals), 4)
        with job.cv:
            job.recoveries += 1
            job.phase = Phase.RUNNING
            job.done_nodes.clear()
            self.events.emit(Event.RECOVERY_DONE, g, restored_step=plan.restore_step, cause="drain",
                             replayed_steps=max(0, reached - plan.restore_step), steps_completed_before=reached,
                             duration_s=round(time.time() - t0, 4), detect_to_done_s=round(time.time() - t_requested, 4),
                             replaced_slots=plan.replaced_slots, drained_node=node.node_id, attempts=1, phases=phases)
            self.orders.direct(job.slots.values(), command=Command.RUN, restart_count=job.restart_count, resume=True)
            if plan.replaced_slots:   # its state is on the spare now: the drained node may go
                self.orders.direct([node.node_id], command=Command.STOP, exit_code=0, reason=f"drained: {reason}")
        self.drain_stale()

    def _drain_interrupted(self, node: NodeRecord, lost: set[int], fresh: dict[int, str], c: Exception) -> None:
        """A fault (or a deadline) during a drain: the drained node is stopped and its slot hot-swapped as a lost
        node's (state from replica holders and DP peers), together with whatever else was lost."""
        log.warning("drain of %s interrupted, hot-swapping its slot instead: %s", node.node_id, c)
        with self.job.cv:
            slot = node.slot if node.slot is not None else next(iter(fresh), None)
            if node.role == Role.ACTIVE and slot is not None:
                lost.add(slot)
            node.role, node.slot = Role.DRAINED, None
            self.orders.direct([node.node_id], command=Command.STOP, exit_code=0, reason=f"drain interrupted: {c}")
        self.hot_swap(lost, node, {"kind": "drain", "detail": f"drain interrupted: {c}", "t": time.time()},
                      Action.NODE_REPLACE, None, fresh=fresh)

    def _recovery_cycle(self, lost: set[int], fresh: dict[int, str],
                        waiting: dict[int, float]) -> tuple[RecoveryPlan, dict, int]:
        """One attempt: quiesce survivors, fill lost slots from spares, plan, order the restore.

        lost: slots whose node is gone (emptied here as spares are promoted); fresh: slots filled
        by a spare during this recovery, which must fetch their state from peers; waiting: see _replace_slots.
        """
        phases: dict[str, float] = {}
        t = time.time()
        with self.job.cv:
            self.job.generation += 1
            g = self.job.generation
            self.job.phase = Phase.QUIESCE
            for slot in list(fresh):            # a promoted spare that died is lost again
                if self.job.slots.get(slot) != fresh[slot]:
                    del fresh[slot]
            survivors = {s: nid for s, nid in self.job.slots.items() if s not in lost and s not in fresh}
            self.orders.direct(survivors.values(), command=Command.QUIESCE)
        quiesced = Acks(ReportKind.QUIESCED, g, survivors.values(), on_ack=self._quiesced_inventory)
        self._wait_event(quiesced, self.cfg.recovery_timeout, lost)
        acked = quiesced.got
        phases["quiesce_s"] = round(time.time() - t, 4)
        t = time.time()
        reached = max((a.get("next_step", 0) for a in acked.values()), default=0)
        promoted: dict[int, str] = {}
        try:
            self._replace_slots(lost, promoted, may_shrink=not fresh, since=waiting, whole=False)
        except NoSpare as e:
            raise NoSpare(e.slots, reached) from None
        finally:      # a cascade: the next cycle keeps the spares promoted so far (it replaced them again)
            fresh.update(promoted)
            lost.difference_update(promoted)
        lost.clear()
        with self.job.cv:
            plan = plan_recovery(self.job.layout, dict(self.job.nodes), self.job.slots, set(fresh), self.job.placement, fresh,
                                 peers=self.job.peer_set)
            self.job.phase = Phase.RESTORE
            self.job.restored_step = plan.restore_step
            self.job.attempts = settle(self.job.attempts, plan.restore_step)
            phases["plan_s"] = round(time.time() - t, 4)
            self._order_restore(g, plan)
        t = time.time()
        resumed_acks = Acks(ReportKind.RESUMED, g, plan.slots.values())
        self._wait_event(resumed_acks, self.cfg.recovery_timeout, lost)
        resumed = resumed_acks.got
        phases["restore_s"] = round(time.time() - t, 4)
        for key in ("rebuild_s", "params_s", "optimizer_s", "fetch_s", "spawn_s"):
            vals = [r.get("timings", {}).get(key) for r in resumed.values() if r.get("timings", {}).get(key) is not None]
            if vals:
                phases[key] = round(max(vals), 4)
        return plan, phases, reached

    def _order_restore(self, g: int, plan: RecoveryPlan, **extra) -> None:
        """Publish a plan (`recovery_plan`) and send the restore directive (under the job's lock). The ranks of
        replaced slots fetch their state from the plan's sources; everyone else restores locally."""
        self.events.emit(Event.RECOVERY_PLAN, g, restore_step=plan.restore_step, replaced_slots=dict(plan.replaced_slots),
                         fetch={r: s.to_wire() for r, s in plan.fetch.items()}, **extra)
        fetch: dict[int, dict] = {}
        for r, src in plan.fetch.items():
            fetch.setdefault(self.job.layout.slot_of(r), {}).setdefault("fetch", {})[r] = src.to_wire()
        # a new world only where it changed: the slots filled in this recovery and the slots whose
        # replica holders they are (at 16K nodes: a few bodies to encode instead of 16K)
        self.orders.direct_slots(Command.RESTORE, own=fetch,
                                 world_for={c for s in plan.replaced_slots for c in self.job.needed_by.get(s, ())},
                                 restart_count=self.job.restart_count, restore_step=plan.restore_step)

    def _quiesced_inventory(self, ack: dict) -> None:
        """A survivor's snapshot inventory as it quiesced (fresher than its last heartbeat's), taken as each
        ack arrives: 16K of them in one go after the last ack were 60 ms of the plan at 16K nodes. Without
        the lock: the fields are replaced whole (as heartbeats replace them), never changed in place, so a
        reader under the lock sees the old inventory or the new one."""
        node = self.job.nodes.get(ack.get("node_id", ""))
        if node is not None:
            node.snapshots, node.replicas = by_rank(ack.get("snapshots")), by_rank(ack.get("replicas"))

    def _wait_event(self, acks: Acks, timeout: float, lost: set[int]) -> None:
        """Consume reports until every expected ack came; past the deadline -> Cascade.

        A node dying mid-recovery must not cost a heartbeat timeout: when acks stop coming for
        PROBE_AFTER_S, up to PROBE_MAX of the nodes still awaited are probed (a random few each time, so
        all get probed if the stall lasts). Not while acks flow: at 16K nodes, probing every pending node
        every 0.3 s was most of the master's work in a recovery."""
        deadline = time.time() + timeout
        progress_at, acked = time.time(), 0
        while not acks.done:
            left = deadline - time.time()
            if left <= 0:
                raise Cascade("phase deadline passed")
            self.pump(min(left, 0.1), lost, acks)
            if len(acks.got) != acked:
                acked, progress_at = len(acks.got), time.time()
            elif time.time() - progress_at >= PROBE_AFTER_S:
                progress_at = time.time()
                # only the nodes this phase still waits for: one that acked and then died is
                # caught by the next phase's probe (or its heartbeat timeout)
                with self.job.cv:
                    pending = random.sample(list(acks.pending), min(PROBE_MAX, len(acks.pending)))
                    waiting = [self.job.nodes[nid] for nid in pending if nid in self.job.nodes]
                    waiting = [n for n in waiting if n.role == Role.ACTIVE and n.slot not in lost]
                # refusals only: mid-recovery, with the master and the agents at full load, a probe answered
                # late is no evidence (at 16K nodes, late answers declared live nodes lost); silence is the
                # heartbeat monitor's to judge
                for n in unreachable_nodes(self.probe, waiting, timeout=0.2, silent_is_dead=False):
                    self.inbox.put({"kind": ReportKind.NODE_LOST, "node_id": n.node_id, "t": time.time(),
                                     "detail": "agent unreachable during recovery"})

    def pump(self, timeout: float, lost: set[int], acks: Acks | None = None) -> None:
        """Handle one report (or none within timeout). A new fault on an active node -> Cascade."""
        try:
            ev = self.inbox.get(timeout=timeout)
        except queue.Empty:
            return
        kind = ev.get("kind")
        if acks and kind == acks.kind and ev.get("generation") == acks.generation:
            acks.add(ev)   # the common case, 16K times a phase: no lock (absorb has nothing to do for acks)
            return
        self.absorb(ev)
        with self.job.cv:
            node = self.job.nodes.get(ev.get("node_id", ""))
        if kind == ReportKind.RESTORE_FAILED:
            if stop_if_mismatch(ev, self.job.restored_step, self.cfg.persist_dir) or ev.get("integrity"):
                raise PlanError(f"{ev.get('node_id')}: {ev.get('reason')}")
            raise Cascade(f"{ev.get('node_id')}: {ev.get('reason')}", ev)
        if node is None or node.role != Role.ACTIVE or node.slot in lost:
            return
        if kind in NODE_LOSSES:
            # the losses queued behind this one (a rack, a switch) go into the same new cycle: one cycle
            # per lost node would spend the cascade budget on a single correlated failure
            queued = self.inbox.take(lambda e: e.get("kind") in NODE_LOSSES)
            for loss in queued:
                self.absorb(loss)             # a lost spare is marked failed, as pump would have
            newly = 0
            with self.job.cv:
                for loss in [ev, *queued]:
                    n = self.job.nodes.get(loss.get("node_id", ""))
                    if n is None or n.role != Role.ACTIVE or n.slot in lost:
                        continue
                    lost.add(n.slot)     # whatever the classifier says: a lost node's slot goes to a spare
                    newly += 1
                    c = loss_verdict(loss, n.slot, self.cfg.max_local_resets)
                    n.last_fault = fault_text(c, loss)
                    self.events.emit(Event.FAULT_DETECTED, self.job.generation, node=n.node_id, slot=n.slot,
                                     signal=loss["kind"], detail=loss.get("detail", ""), action=c.action.value,
                                     **{"class": c.fault_class.value}, kind=c.fault_class.value,
                                     during_recovery=True)
            raise Cascade(f"node {node.node_id} (slot {node.slot}) lost during recovery: {ev.get('detail') or kind}"
                          + (f" (and {newly - 1} more queued node losses)" if newly > 1 else ""))
        if kind in (ReportKind.WORKER_EXIT, ReportKind.WORKER_HANG) and ev.get("generation") == self.job.generation:
            # A worker of this recovery's generation died (or hung) while its group was being rebuilt: its
            # node will never ack this phase. Dropping it as "expected" cost the whole --recovery-timeout
            # (39.9 s and 127.8 s recoveries in a soak, two crash-worker 0.5 s apart). A new cycle quiesces
            # the live workers and the restore respawns the dead one from the node's snapshot.
            with self.job.cv:
                self.job.fault_history.setdefault(node.slot, []).append(signal_of(ev, node.slot))
                self.events.emit(Event.FAULT_DETECTED, self.job.generation, node=node.node_id, slot=node.slot,
                                 signal=kind, rank=ev.get("rank"), returncode=ev.get("returncode"),
                                 detail=detail_of(ev), action=Action.LOCAL_RESET.value,
                                 during_recovery=True)
            raise Cascade(f"rank {ev.get('rank')} on slot {node.slot} died during recovery: "
                          f"{ev.get('detail') or kind}", ev)
        # comm errors, and worker exits of an older generation (the restore respawns those), are expected
        # while quiescing
