"""The recovery coordinator: the master's controller thread. It takes the reports from the inbox one at a
time, gathers the reports of one incident, asks the pure decisions (control/decide.py, faults/) what they mean
and carries the answer out through the recovery procedures (control/recovery.py). Faults are handled one at a
time, so recovery cycles are serialized and a second fault arriving mid-recovery restarts the cycle with a new
generation instead of being dropped. Its collaborators come through the constructor.
"""
from __future__ import annotations

import gc
import logging
import queue
import time
from typing import Any

from phoenixrun.control.decide import (FAULT_REPORTS, NODE_LOSSES, JobEnd, Remedy, carried_out_first, escalated,
                                       exit_code_of, fallback_reason, fault_detected, fault_text, is_definite,
                                       loss_verdict, respond, signal_of)
from phoenixrun.control.events import EventLog
from phoenixrun.control.jobstate import JobState
from phoenixrun.control.joining import EXIT_JOIN_TIMEOUT, PROGRESS_EVERY_S, Joining, gave_up, progress_line
from phoenixrun.control.orders import Inbox, Orders
from phoenixrun.control.inflight import Probe, Stop, unreachable_nodes
from phoenixrun.control.recovery import Recoveries
from phoenixrun.control.state import NodeRecord, Phase, Role
from phoenixrun.faults import Classification, correlate
from phoenixrun.faults.escalate import Attempt, Limits, committed_step, escalate
from phoenixrun.protocol import directives as cmd
from phoenixrun.protocol.events import DrainRequested, JobFinished, JobStarted, MasterRecovered
from phoenixrun.protocol import reports as r

log = logging.getLogger("phoenixrun.master")


class Coordinator:
    def __init__(self, job: JobState, orders: Orders, events: EventLog, inbox: Inbox, recovery: Recoveries,
                 probe: Probe):
        self.cfg, self.job, self.orders, self.events, self.inbox = job.cfg, job, orders, events, inbox
        self.recovery, self.probe = recovery, probe

    def run(self) -> None:
        try:
            end = self._wait_for_start()
            while end is None:
                ev = self.inbox.get()
                if self.job.course.over:     # ended by another thread (as tests end a master): nothing is left to do
                    return
                generation = self.job.course.generation
                # No cyclic collection while an event is handled, a recovery included: what a recovery
                # allocates (16K acks, directives, polls) made the collector run full collections of the
                # 16K-node heap, 0.2 s each, eight of them in one recovery (measured with gc.callbacks).
                # The master's garbage is freed by reference counting; cycles wait for the next collection.
                gc.disable()
                try:
                    end = self._dispatch(ev)
                    if end is None and self.job.shrunk:
                        self.recovery.grow()     # a spare registered (or was there): take it back in
                finally:
                    if self.job.course.generation != generation:
                        gc.freeze()   # the new membership lives on (see _wait_for_start)
                    gc.enable()
        except Stop as s:
            end = JobEnd(s.exit_code, s.reason)
        except Exception as e:  # a bug in the master must still end the job visibly
            log.exception("master controller crashed")
            end = JobEnd(70, f"master error: {e}")
        self.finish(end.exit_code, end.reason)

    def _wait_for_start(self) -> JobEnd | None:
        job = self.job
        held: list[r.Report] = []     # reports a restarted master gets before it runs: handled once it does
        t0 = said = checked = time.monotonic()
        while True:
            try:
                ev = self.inbox.get(timeout=0.2)
                self.recovery.absorb(ev)
                resumed_fault = job.course.resumed_at is not None and not isinstance(ev, r.Joined)
                if resumed_fault or (isinstance(ev, r.Joined) and ev.interrupted):
                    held.append(ev)
            except queue.Empty:
                pass
            with job.cv:
                if job.course.over:          # ended by another thread before it started
                    return JobEnd(job.course.exit_code or 0, job.course.reason)
                if len(job.members.slots) == self.cfg.nnodes:
                    break
                if job.course.resumed_at is not None and time.time() > job.course.resumed_at + self.cfg.recovery.node_timeout:
                    break             # whoever has not rejoined by now is lost
                if job.course.resumed_at is None and time.monotonic() - checked >= 0.2:   # O(nodes): not per join
                    now = checked = time.monotonic()
                    joining = Joining(self.cfg.nnodes, tuple(job.members.slots), sum(
                        n.role == Role.SPARE for n in job.members.nodes.values()), self.cfg.spares, now - t0,
                        self.cfg.recovery.join_timeout)
                    reason = gave_up(joining)
                    if reason is not None:
                        return JobEnd(EXIT_JOIN_TIMEOUT, reason)
                    if now - said >= PROGRESS_EVERY_S:
                        said = now
                        log.info("%s", progress_line(joining))
        # The membership is complete: what exists now (a record per node, a connection per agent) lives as
        # long as the job. Out of the collector's sight: a full collection walked all of it, 0.3 s at 16K
        # nodes with the heartbeats stalled meanwhile, about once a second under 1 Hz heartbeats.
        gc.freeze()
        if job.course.resumed_at is not None:
            self._resume(held)
            return None
        with job.cv:
            job.course.phase = Phase.RUNNING
            self.events.emit(JobStarted(world_size=job.course.layout.world_size, slots=dict(job.members.slots)), job.course.generation)
            resume = self.recovery.newest_checkpoint()
            if resume is None:
                self.orders.direct_slots(cmd.Run(restart_count=0))
                return None
        # a run directory with checkpoints: resume the job from the newest complete one
        if not self.recovery.fallback(set(), f"resuming from checkpoint step {resume}", counted=False):
            return JobEnd(1, f"cannot resume from the checkpoints in {self.cfg.persistence.persist_dir}")
        return None

    def _resume(self, held: list[r.Report]) -> None:
        """Carry on a running job after a master restart. A slot nobody rejoined for lost its node
        while the master was down: it gets a stand-in record and the usual node-lost handling."""
        job = self.job
        with job.cv:
            job.course.phase = Phase.RUNNING
            missing = [s for s in range(self.cfg.nnodes) if s not in job.members.slots]
            api = any(n.api for n in job.members.nodes.values())
            for s in missing:
                nid = f"lost-slot{s}"
                job.members.nodes[nid] = NodeRecord(node_id=nid, host="?", agent_pid=0, peer_addr=job.members.peer_hint.get(s, ""),
                                            fault_domain=nid, role=Role.ACTIVE, slot=s, api=api)
                if api:
                    job.members.api_nodes.add(nid)
                job.members.slots[s] = nid
            self.events.emit(MasterRecovered(nodes=len(job.members.nodes) - len(missing), missing_slots=missing,
                                             restart_count=job.course.restart_count), job.course.generation)
        for s in missing:
            self.inbox.put(r.NodeLost(node_id=f"lost-slot{s}", t=time.time(),
                                      detail="did not rejoin the restarted master"))
        for ev in held:
            if isinstance(ev, r.Joined) and ev.interrupted:   # it was mid-recovery when the master died: recover again
                ev = r.CommError(node_id=ev.node_id, t=time.time(), text="recovery interrupted by a master restart")
            self.inbox.put(ev)

    def _dispatch(self, ev: r.Report) -> JobEnd | None:
        """Handle one report; the job's end once every node's workers finished."""
        job = self.job
        self.recovery.absorb(ev)
        if isinstance(ev, r.AttemptCheck):
            self.recovery.check_attempt(ev)
            return None
        with job.cv:
            node = job.members.nodes.get(ev.node_id)
            slot = None if node is None or node.role != Role.ACTIVE else node.slot
        if node is None or slot is None:
            return None
        if isinstance(ev, r.WorkersDone) and ev.generation == job.course.generation:
            job.members.done_nodes.add(node.node_id)
            if all(nid in job.members.done_nodes for nid in job.members.slots.values()):
                return JobEnd(0, "all workers finished")
            return None
        if isinstance(ev, r.Drain):
            self._drain(node, slot, ev)
            return None
        if ev.kind not in FAULT_REPORTS:
            return None
        if not job.hot_swap_capable() and ev.generation is not None and ev.generation < job.course.generation:
            return None   # a worker of an attempt already restarted (reported after the restart's drain)
        incident = self._incident(ev)
        if incident is not None:
            self._handle_fault(*incident)
        return None

    def _drain(self, node: NodeRecord, slot: int, ev: r.Drain) -> None:
        """A drain asked for by an operator (`phoenixrun drain`) or by the node's agent (it got SIGTERM). Judged
        again now (a fault may have come first). Refused: the operator was told already (the request is checked
        when it arrives) - unless the state changed since; an agent that asked is treated as it was before
        drains existed: it is told to stop as on SIGTERM and its slot is handled as a node that left."""
        job = self.job
        by = ev.by
        reason = ev.reason or ev.detail or "drain"
        with job.cv:
            refusal = job.drain_refusal(slot)
            self.events.emit(DrainRequested(node=node.node_id, slot=slot, reason=reason, by=by,
                                            accepted=refusal is None, refusal=refusal or None), job.course.generation)
            if refusal is not None and by == "agent":
                self.orders.direct([node.node_id], cmd.Stop(exit_code=128 + 15,
                                                            reason=f"drain refused ({refusal}): leaving as on SIGTERM"))
        if refusal is None:
            self.recovery.drain(node, slot, reason, ev.at(time.time()))
        elif by == "agent":
            log.warning("drain of slot %s refused: %s; the node leaves", slot, refusal)
            self.inbox.put(r.Left(node_id=node.node_id, t=time.time(), detail=f"{reason}; drain refused: {refusal}"))
        else:
            log.warning("drain of slot %s refused: %s", slot, refusal)

    def _slot_of(self, ev: r.Report) -> int | None:
        with self.job.cv:
            node = self.job.members.nodes.get(ev.node_id)
        return None if node is None else node.slot

    def _incident(self, ev: r.Report) -> tuple[NodeRecord, r.Report, Classification, dict[str, Any]] | None:
        """Root cause vs symptom: gather the reports of one incident and let `faults.correlate` decide.

        A definite root cause (a killed worker, a lost node, an Xid...) is acted on at once, with whatever
        else is already queued. A collective error or an ambiguous report only says "something failed":
        the master probes every agent (a dead one refuses at once) and waits up to the correlation
        window for a root cause; if none comes, the reporters get a local reset (transient).
        """
        job, resets = self.job, self.cfg.recovery.max_local_resets
        events = [ev]
        with job.cv:
            actives = job.members.actives()
        definite = is_definite(ev, self._slot_of(ev), resets)
        if not definite:
            for n in unreachable_nodes(self.probe, actives):
                events.append(r.NodeLost(node_id=n.node_id, t=time.time(), detail="agent unreachable"))
                definite = True
        deadline = time.time() + (0.0 if definite else self.cfg.recovery.correlation_window)
        unrelated = []
        while True:
            try:
                other = self.inbox.get(timeout=max(0.0, deadline - time.time()))
            except queue.Empty:
                break
            if other.kind in FAULT_REPORTS:
                self.recovery.absorb(other)
                events.append(other)
                if is_definite(other, self._slot_of(other), resets):
                    deadline = time.time()   # drain what is queued, wait no longer
            else:
                unrelated.append(other)
        for other in unrelated:              # not part of the incident: handled in turn afterwards
            self.inbox.put(other)
        with job.cv:
            slot_of = {e.node_id: job.members.nodes[e.node_id].slot for e in events if e.node_id in job.members.nodes}
            history = {s: list(h) for s, h in job.course.fault_history.items()}
        pairs = [(signal_of(e, slot_of[e.node_id]), e) for e in events if slot_of.get(e.node_id) is not None]
        # fault_history holds one signal per incident handled (this window gathers an incident's reports), so
        # entries are never merged by time: merged, local resets 0.5 s apart never escalated (issue 20)
        corr = correlate([sig for sig, _ in pairs], history, max_local_resets=resets, incident_gap_s=0.0)
        d = carried_out_first(corr)
        if d is None:
            return None
        ev = next(e for sig, e in pairs if sig is d.signal)
        verdict = self._escalated(d.classification, ev)
        with job.cv:
            node = job.members.nodes[ev.node_id]
            # recorded with the fault: how the window was decided and who reported what (nodes by id)
            ids = {job.members.nodes[e.node_id].slot: e.node_id for _, e in pairs}
        context = {"verdict": d.verdict.value,
                   "reporters": sorted({ids[x.node] for x in corr.decisions}),
                   "symptoms": sorted({ids[x.node] for x in corr.symptoms})}
        return node, ev, verdict, context

    def _escalated(self, c: Classification, ev: r.Report) -> Classification:
        """No loop: a fault acted on at the committed step of earlier attempts (no progress since) gets a
        stronger remedy, and past the last one the job stops (faults/escalate.py). Hot swap only: a
        torchrun-style job's restarts are bounded by --max-restarts."""
        job = self.job
        with job.cv:
            if not job.hot_swap_capable():
                return c
            step = committed_step(job.members.newest_snapshots(), job.course.layout.world_size, job.course.restored_step)
            e = escalate(c, step, job.course.attempts, Limits(local_resets=self.cfg.recovery.max_local_resets))
            job.course.attempts = [*job.course.attempts[-63:], Attempt(step, e.action or c.action)]
            if e.stop:
                node = job.members.nodes.get(ev.node_id)
                self.recovery.incidents.open(self.events.emit(fault_detected(
                    ev, ev.node_id, None if node is None else node.slot, c, action="stop", step=step, repeats=e.repeats),
                    job.course.generation))
        if e.stop:
            raise Stop(exit_code_of(ev) or 1, e.reason)
        return escalated(c, e)

    def _handle_fault(self, node: NodeRecord, ev: r.Report, verdict: Classification,
                      context: dict[str, Any] | None = None) -> None:
        job = self.job
        with job.cv:
            slot = node.slot
            if slot is None:     # it left its slot meanwhile (failed over by its own rejoin): nothing left to act on
                return
            job.course.fault_history.setdefault(slot, []).append(signal_of(ev, slot))
            before, node.last_fault = node.last_fault, fault_text(verdict, ev)
            self.recovery.incidents.open(self.events.emit(
                fault_detected(ev, node.node_id, slot, verdict, **(context or {})), job.course.generation))
            response = respond(job.hot_swap_capable(), verdict.action, ev.kind)
        failing_code = exit_code_of(ev)
        if response.remedy is Remedy.FALLBACK:
            why = fallback_reason(verdict, ev, slot)
            if not self.recovery.fallback(set(), why):
                raise Stop(failing_code or 1, why)
            return
        if response.fence:
            # the node is still up but must go: fence it (its agent kills its workers and exits)
            with job.cv:
                self.orders.direct([node.node_id], cmd.Stop(exit_code=0, reason=f"fenced: {verdict.reason}"))
        lost = {slot} if response.replace else set()
        if response.remedy is Remedy.RESTART:
            self._restart_plain(lost, node, ev, verdict, failing_code, before)
        else:
            self.recovery.hot_swap(lost, node, ev, verdict.action, failing_code)

    def _restart_plain(self, lost: set[int], node: NodeRecord, ev: r.Report, verdict: Classification,
                       failing_code: int | None, before: str | None = None) -> None:
        """A script without the API: torchrun's semantics, a full restart on any failure while --max-restarts
        allows. A worker's failure may be the symptom of a node loss not yet detected (a survivor's gloo
        error came 1.4 s before the lost node's heartbeat timeout): the agents are probed, and node losses
        reported within the correlation window are taken too, so the lost nodes' slots get spares in the
        same restart (one restart, not two). The fault is then the lost nodes': their rows in `status` show
        it, and the reporting node's goes back to what it showed before (`before`)."""
        job = self.job
        reporter_lost = node.slot in lost
        time.sleep(self.cfg.recovery.correlation_window)
        losses = self.inbox.take(lambda e: e.kind in NODE_LOSSES)
        with job.cv:
            slot_of = {n.node_id: n.slot for n in job.members.actives() if n.slot is not None and n.slot not in lost}
            actives = [job.members.nodes[nid] for nid in slot_of]
            reported = {e.node_id: e for e in losses}
        gone = [n for n in actives if n.node_id in reported]
        # refusals only: a killed node's agent refuses at once, and on a loaded machine a live agent answering
        # late must not be taken for lost (with no spare that would end the job); silence is the heartbeats'
        gone += unreachable_nodes(self.probe, [n for n in actives if n.node_id not in reported], timeout=1.0,
                                  silent_is_dead=False)
        why = f"rank {ev.rank} on slot {node.slot}: {ev.kind.value} ({verdict.reason})"
        if gone:
            with job.cv:
                for n in gone:
                    slot = slot_of[n.node_id]
                    lost.add(slot)
                    job.members.lost.add(n.node_id)
                    loss = reported.get(n.node_id) or r.NodeLost(node_id=n.node_id, detail="agent unreachable")
                    c = loss_verdict(loss, slot, self.cfg.recovery.max_local_resets)
                    n.last_fault = fault_text(c, loss)
                    rec = self.events.emit(fault_detected(loss, n.node_id, slot, c, signal=r.NodeLost.KIND,
                                                          detail="node lost with the failure", symptom_of_loss=True),
                                           job.course.generation)
                    if n is gone[0] and not reporter_lost:    # the incident is the loss (what the console says)
                        first = self.recovery.incidents.current or rec
                        self.recovery.incidents.open({**rec, "detail": loss.detail or rec["detail"],
                                                     "t": first.get("t", rec["t"])})
                if not reporter_lost:      # its report was a symptom of the loss: not its fault
                    node.last_fault = before
            why = (f"node(s) in slot(s) {sorted(slot_of[n.node_id] for n in gone)} lost (rank {ev.rank}'s "
                   f"{ev.kind.value} was its symptom)")
        for e in losses:   # losses of spares and of nodes already handled: the usual bookkeeping
            if e.node_id not in {n.node_id for n in gone}:
                self.recovery.absorb(e)
        self.recovery.restart(lost, failing_code, why)

    def finish(self, exit_code: int, reason: str) -> None:
        job = self.job
        with job.cv:
            if job.course.over:      # a job ends once: one job_finished, one exit code
                return
            job.course.exit_code = exit_code
            job.course.reason = reason
            job.course.phase = Phase.FINISHED if exit_code == 0 else Phase.FAILED
            # what an external restart could resume from: the newest step every rank has committed, and the
            # newest any rank has (a non-finite step must never appear here)
            newest = job.members.newest_snapshots()
            complete = len(newest) == job.course.layout.world_size
            end = self.events.emit(JobFinished(exit_code=exit_code, reason=reason, restarts=job.course.restart_count,
                                               recoveries=job.course.recoveries,
                                               committed_step=min(newest.values()) if complete else None,
                                               newest_snapshot=max(newest.values(), default=None)), job.course.generation)
            self.orders.direct([n.node_id for n in job.members.nodes.values() if n.role != Role.FAILED],
                               cmd.Stop(exit_code=exit_code, reason=reason, job_end=True))
            if job.members.roster is not None:     # nobody rejoins a finished job (control/roster.py)
                job.members.roster.append(job.master_epoch, finished=True)
        # a fault ended it: one line, as for every incident (control/incident.py); else the plain reason
        if exit_code and not self.recovery.incidents.close(end, level=logging.ERROR):
            log.error("job failed (exit %d): %s", exit_code, reason)
        job.stopped.set()
