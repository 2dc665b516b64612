"""The master's decisions about faults, as pure functions: what a report means (its signal), which decision
of an incident is carried out, what carries it out (hot swap, persistent fallback, torchrun-style restart; a
job stops where none of them can), how a node lost mid-recovery is filed, and the bounds of the retries; for a
recovery in flight, what each report means (`midway`) and what follows a failed cycle (`after_failure`).

Nothing here touches a socket, a clock or the job's state: the recovery coordinator (control/coordinator.py,
control/recovery.py, the cycle's executor control/cycle.py) gathers the inputs and carries the answers out. The
recovery plan itself is control/state.py's `plan_recovery`. Table-tested in tests/test_master_decide.py and
tests/test_recovery_decide.py.
"""
from __future__ import annotations

import bisect
import math
import re
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from phoenixrun.control.state import NodeRecord, PlanError, RecoveryPlan, Role, restore_step
from phoenixrun.faults import Action, Classification, Correlation, NodeDecision, Signal, SignalKind, classify
from phoenixrun.faults.escalate import Escalation
from phoenixrun.faults.taxonomy import ACTION_PRECEDENCE
from phoenixrun.protocol.events import FaultDetected
from phoenixrun.protocol import reports as r
from phoenixrun.protocol.names import Command, ReportKind
from phoenixrun.protocol.restore import RankSource
from phoenixrun.topology import Layout

K = ReportKind
# reports that name a faulty node by themselves; a collective error only says "some peer failed"
ROOT_CAUSES = (K.NODE_LOST, K.WORKER_EXIT, K.LEFT, K.WORKER_HANG, K.HEALTH, K.WORKER_ERROR, K.NAN_LOSS)
FAULT_REPORTS = ROOT_CAUSES + (K.COMM_ERROR,)     # the reports an incident gathers
NODE_LOSSES = (K.NODE_LOST, K.LEFT)
# reports from a node that is still up: one whose slot is given to a spare must be told to go (fenced)
STILL_UP = (K.HEALTH, K.WORKER_HANG, K.WORKER_EXIT, K.COMM_ERROR)
# directive commands that run workers (a node sent one of these in a generation may report workers_done)
RUNS_WORKERS = (Command.RUN, Command.RESTART, Command.RESTORE)


@dataclass(frozen=True)
class JobEnd:
    """The job is over: the exit code and the reason the master gives."""
    exit_code: int
    reason: str


def signal_of(ev: r.Report, slot: int | None) -> Signal:
    """The fault signal a report (an inbox event) carries, filed under the reporting node's slot."""
    t = ev.at(0.0)
    if isinstance(ev, r.NodeLost):
        return Signal(kind=SignalKind.NODE_HEARTBEAT_LOST, node=slot, detail=ev.detail, timestamp=t)
    if isinstance(ev, r.Left):
        return Signal(kind=SignalKind.NODE_UNREACHABLE, node=slot, detail=ev.detail, timestamp=t)
    if isinstance(ev, r.Health):
        return replace(ev.signal, node=slot)
    if isinstance(ev, r.NanLoss):
        return Signal(kind=SignalKind.NAN_LOSS, node=slot, rank=ev.rank, detail=ev.text, timestamp=t)
    if isinstance(ev, r.WorkerError):
        return Signal(kind=SignalKind.USER_EXCEPTION, node=slot, rank=ev.rank, detail=ev.text, timestamp=t)
    if isinstance(ev, r.WorkerHang):
        return Signal(kind=SignalKind.WORKER_HANG, node=slot, rank=ev.rank, detail=ev.detail, timestamp=t)
    if isinstance(ev, r.WorkerExit):
        return Signal(kind=SignalKind.WORKER_EXIT, node=slot, rank=ev.rank, code=ev.returncode,
                      detail=ev.text or ev.detail, timestamp=t)
    return Signal(kind=SignalKind.COLLECTIVE_ERROR, node=slot, rank=ev.rank, detail=ev.text, timestamp=t)


def is_definite(ev: r.Report, slot: int | None, max_local_resets: int) -> bool:
    """The report names its node's fault by itself (no need to wait for the rest of the incident)."""
    if slot is None:
        return False
    c = classify(signal_of(ev, slot), max_local_resets=max_local_resets)
    return c.root_cause and not c.ambiguous


def exit_code_of(ev: r.Report) -> int | None:
    """The exit code a failing worker's report implies for the job (a signal n: 128 - n, as a shell)."""
    if not isinstance(ev, r.WorkerExit):
        return None
    rc = ev.returncode
    return 128 - rc if rc < 0 else rc


def detail_of(ev: r.Report) -> str:
    """A report's description, as events record it."""
    return ev.described()[:300]


def fault_detected(ev: r.Report, node: str | None, slot: int | None, c: Classification, *,
                   action: str | None = None, step: int | None = None, detail: str | None = None,
                   signal: str | None = None, verdict: str | None = None, reporters: list[str] | None = None,
                   symptoms: list[str] | None = None, repeats: int | None = None,
                   during_recovery: bool | None = None, symptom_of_loss: bool | None = None) -> FaultDetected:
    """The `fault_detected` record of report `ev` classified as `c`, the same fields wherever the fault was found
    (the escalation's stop, an incident, a loss with a restart, a fault during a recovery). Pure."""
    return FaultDetected(
        node=node, slot=slot, signal=signal or ev.kind, rank=ev.rank, returncode=ev.returncode if isinstance(ev, r.WorkerExit) else None,
        detail=detail_of(ev) if detail is None else detail, fault_class=c.fault_class.value,
        action=action or c.action.value, step=ev.step if step is None else step, verdict=verdict,
        reporters=reporters, symptoms=symptoms, repeats=repeats, during_recovery=during_recovery,
        symptom_of_loss=symptom_of_loss)


def midway_worker_verdict(ev: r.Report, slot: int | None, max_local_resets: int) -> Classification:
    """How a worker lost mid-recovery is filed: the classifier's class for its report, the action always
    MIDWAY_WORKER_ACTION (its node is alive: the next cycle's restore respawns it from the node's snapshot)."""
    c = classify(signal_of(ev, slot), max_local_resets=max_local_resets)
    return Classification(c.fault_class, MIDWAY_WORKER_ACTION, c.root_cause, c.reason, c.ambiguous)


def carried_out_first(corr: Correlation) -> NodeDecision | None:
    """The decision of an incident the master carries out (the others are moot once it is): any
    external_fallback decides the job (faults/correlate.py), else the costliest action by the one
    precedence of actions (faults/taxonomy.py's ACTION_PRECEDENCE); among equals the lowest slot."""
    acted = corr.acted_on
    if not acted:
        return None
    if corr.external_fallback:
        return next(d for d in acted if d.action is Action.EXTERNAL_FALLBACK)
    return max(acted, key=lambda d: ACTION_PRECEDENCE[d.acted_action])   # max keeps the first of equals


def fault_text(c: Classification, ev: r.Report) -> str:
    """A node's "last fault" as `status` shows it: the class and what the report said. Pure."""
    return f"{c.fault_class.value}: {ev.described()}"[:200]


def escalated(c: Classification, e: Escalation) -> Classification:
    """The classification with the escalation's action and reason (call only when e does not stop the job)."""
    if e.action is None:
        raise ValueError(f"a stopping escalation has no action to carry out: {e.reason}")
    if e.action is c.action:
        return c
    return Classification(c.fault_class, e.action, c.root_cause, e.reason, c.ambiguous)


class Remedy(str, Enum):
    RESTART = "restart"       # torchrun's semantics: every worker from scratch, bounded by --max-restarts
    FALLBACK = "fallback"     # every worker from the newest persistent checkpoint; the job stops if none
    HOT_SWAP = "hot_swap"     # quiesce, plan, restore from the snapshots in memory, resume


@dataclass(frozen=True)
class Response:
    remedy: Remedy
    replace: bool    # the faulty node's slot goes to a spare
    fence: bool      # the faulty node is still up but must go: it is ordered to stop first


def respond(hot_swap_capable: bool, action: Action, report_kind: str | None) -> Response:
    """What carries out `action` for a fault reported as `report_kind`. A job whose workers do not use the
    phoenixrun API is restarted as torchrun would; one that does is hot-swapped, or restarted from its
    persistent checkpoint where the fault must not be hot-swapped around (external_fallback)."""
    if hot_swap_capable and action is Action.EXTERNAL_FALLBACK:
        return Response(Remedy.FALLBACK, replace=False, fence=False)
    replace = action is Action.NODE_REPLACE
    return Response(Remedy.HOT_SWAP if hot_swap_capable else Remedy.RESTART, replace=replace,
                    fence=replace and report_kind in STILL_UP)


def fallback_reason(c: Classification, ev: r.Report, slot: int | None) -> str:
    """Why the job falls back to its persistent checkpoint (or stops), as events and the exit reason say."""
    what = f"{c.reason}: {ev.text}" if isinstance(ev, r.NanLoss) and ev.text else c.reason
    return f"{what} (rank {ev.rank} on slot {slot})"


def loss_verdict(ev: r.Report, slot: int, max_local_resets: int) -> Classification:
    """How a node loss found while a recovery or a restart is under way is filed: by the classifier, as the
    same report outside a recovery (node_lost: a vanished or silent agent, a node that said it leaves); either
    way its slot goes to a spare."""
    if ev.kind not in NODE_LOSSES:
        raise ValueError(f"not a node loss: {ev.kind.value!r}")
    return classify(signal_of(ev, slot), max_local_resets=max_local_resets)


CASCADE_LIMIT = 5   # hot-swap cycles one recovery starts over before it gives in-memory recovery up


def after_cascade(attempts: int) -> float | None:
    """A hot swap's cycle `attempts` failed (a fault or a refused restore during it): how long to let the job
    settle before the next cycle - none after the first failure, then 0.25 s doubling up to 4 s, so a condition
    that clears by itself (a peer port full for a moment) is waited out instead of retried into the limit - or
    None past CASCADE_LIMIT: give in-memory recovery up for the persistent checkpoint, else a restart. Before, the
    job stopped there (exit 1) with a checkpoint on disk it never tried (issue 31)."""
    if attempts > CASCADE_LIMIT:
        return None
    return 0.0 if attempts <= 1 else min(4.0, 0.25 * 2 ** (attempts - 2))


def fallback_attempts(used: int, limit: int, counted: bool) -> int:
    """How many checkpoint restarts one fallback may try. Every try counts against --max-fallbacks, an
    interrupted or rejected one too (a loop of 5 tries whatever the limit said used to run past it); a job
    resuming from its run directory (`counted` False) gets its first try free."""
    return max(0, limit - used) + (0 if counted else 1)


_GLOO_RANK_KEY = re.compile(r"^/?default_pg/.*/(\d+)$")


def attempt_ranks(keys: Iterable[str], world_size: int) -> set[int]:
    """The ranks whose gloo default group has registered in an attempt's store, from its keys. Pure."""
    out = set()
    for k in keys:
        m = _GLOO_RANK_KEY.match(k)
        if m and int(m.group(1)) < world_size:
            out.add(int(m.group(1)))
    return out


def attempt_verdict(joined: set[int], world_size: int, joined_before: int | None) -> list[int] | None:
    """Does a restart attempt hang? Its gloo ranks each set one key in the attempt's store: none yet -> the
    script is still before init_process_group (or uses no store); all -> up; some, as many as at the check
    one --recovery-timeout before (`joined_before`) -> the others wait for ranks that never come. The ranks
    missing when it hangs, else None (up, or look again later)."""
    if len(joined) == world_size or not joined or joined_before != len(joined):
        return None
    return sorted(set(range(world_size)) - joined)


# ---------------------------------------------------------------- planned drains (`phoenixrun drain`, SIGTERM)
def drain_refusal(slot: int, nnodes: int, node: NodeRecord | None, spares: int, running: bool,
                  hot_swap_capable: bool, committed: int | None, warm_spares: int | None = None) -> str | None:
    """Why a drain of node slot `slot` cannot be carried out now, as the operator reads it (what is wrong and
    what to do); None: it can. `node`: the node holding the slot; `spares`: spare nodes registered; `running`:
    the job runs and no recovery is in flight; `committed`: the newest step every rank has committed;
    `warm_spares`: the spares whose pre-started workers are up (None: not known). A drain onto a spare still
    starting its workers paused the whole job 12.8-22.4 s (issue 31): it waits for a warm one. Pure."""
    if not 0 <= slot < nnodes:
        return f"there is no node slot {slot}: the job's slots are 0..{nnodes - 1} (see `phoenixrun status`)"
    if node is None or node.role != Role.ACTIVE:
        return f"no active node holds slot {slot} (see `phoenixrun status`)"
    if node.draining:
        return f"node {node.node_id} in slot {slot} is already being drained ({node.draining})"
    if not running:
        return ("the job is not running (not started, finished, or a recovery is in flight): "
                "drain again once `phoenixrun status` shows the phase running")
    if not hot_swap_capable:
        return ("the job's script does not use the phoenixrun API (torchrun-style): there are no snapshots to "
                "move; stop the node instead and --max-restarts restarts the job")
    if spares == 0:
        return (f"no spare node to take slot {slot}'s ranks: start one (`phoenixrun agent --rdzv-endpoint "
                "HOST:PORT`) or launch with --spares, then drain again")
    if committed is None:
        return "no step is committed by every rank yet: drain again once the job has taken a step"
    if warm_spares == 0:
        return (f"no spare is warm yet ({spares} spare(s) still starting their workers; a drain onto one would pause "
                "the job until they are up): drain again once `phoenixrun status` shows a spare (warm)")
    return None


def drain_step(newest: int, steps_per_s: float | None, lead_s: float, min_ahead: int = 2,
               unknown_rate_ahead: int = 5, max_ahead: int = 8) -> int:
    """The step boundary every rank stops at for a drain: far enough past the newest snapshot the master knows
    of (`newest`) that no rank has started that step when the order reaches it, `lead_s` seconds from now (how
    stale the master's view is, plus the delivery). A rank already inside the step or past it quiesces at once
    as for a fault (correct, but it may replay a step): the margin makes that rare. At most `max_ahead` steps:
    on a loaded 2-core machine a stale heartbeat and a burst in the step rate once asked for 38 steps ahead,
    past the job's end (the drain then waited for the last step). Pure."""
    if steps_per_s is None:
        ahead = unknown_rate_ahead
    else:
        ahead = max(min_ahead, math.ceil(steps_per_s * lead_s) + 1)
    return newest + min(ahead, max_ahead)


def plan_drain(layout: Layout, nodes: Mapping[str, NodeRecord], slots: Mapping[int, str], drained_slot: int,
               spare_id: str | None) -> RecoveryPlan:
    """The restore of a drain: every rank at the newest step all of them committed (at the drain's step boundary
    none went further, so nothing replays); the drained node's ranks go to the spare, which fetches their state,
    private and shared parts alike, from the drained node's own agent (it is alive and holds the committed
    slots). Every other rank restores from its own agent. No spare (it died since the drain was accepted):
    everyone restores in place and the drained node stays. Raises PlanError when no step is common. Pure."""
    drained = nodes[slots[drained_slot]]
    npn = layout.nproc_per_node
    available = {tuple(nodes[slots[s]].snapshots.get(r, ())) for s in range(layout.nnodes)
                 for r in range(s * npn, (s + 1) * npn)}
    step = restore_step(available)
    if step is None:
        raise PlanError("no snapshot step is available on every rank")
    if spare_id is None:
        return RecoveryPlan(restore_step=step, slots=dict(slots), fetch={}, replaced_slots={})
    fetch = {r: RankSource(private=(drained.peer_addr,), shared=((drained.peer_addr, r),))
             for r in layout.ranks_of_slot(drained_slot)}
    return RecoveryPlan(restore_step=step, slots={**slots, drained_slot: spare_id}, fetch=fetch,
                        replaced_slots={drained_slot: spare_id})


# ---------------------------------------------------------------- stragglers
STRAGGLER_WINDOWS = 3      # consecutive windows a node must be slow in (persistence)
STRAGGLER_MARGIN = 3.0     # and slower than its peers by more than this many median absolute deviations (spread)


def _median(xs: Sequence[float]) -> float:
    """statistics.median, for the small lists of a window, at a third of its cost (it is called 6 times a node)."""
    o = sorted(xs)
    n = len(o)
    return o[n // 2] if n % 2 else (o[n // 2 - 1] + o[n // 2]) / 2


def _mad(xs: Sequence[float], med: float) -> float:
    return _median([abs(x - med) for x in xs])


def median_without(ordered: Sequence[float], x: float) -> float:
    """The median of `ordered` (sorted, x one of its values) with one x left out: O(log n), where the median of
    each node's peers taken afresh made stragglers() O(nodes^2) a window (measured: 6.6 s a call at 4,096 nodes with
    60 samples each, twice a second on the master's loop; 0.08 s now). Pure; at least two values."""
    i = bisect.bisect_left(ordered, x)
    m = len(ordered) - 1

    def at(k: int) -> float:     # the k-th of the others
        return ordered[k] if k < i else ordered[k + 1]
    return at(m // 2) if m % 2 else (at(m // 2 - 1) + at(m // 2)) / 2


def stragglers(samples: Mapping[int, Sequence[float]], ratio: float, window: int, *,
               windows: int = STRAGGLER_WINDOWS, margin: float = STRAGGLER_MARGIN) -> dict[int, float]:
    """slot -> how many times slower than its peers (in the newest window), for each node persistently slower.

    The newest `windows` x `window` samples of each node (a step's compute time, newest last) are cut into
    `windows` disjoint windows of `window` samples. A node is slow in a window when its median there is
    - at least `ratio` times the base, the median of the other nodes' medians in that window, and
    - above the base by more than `margin` times the spread: the larger of its own median absolute deviation
      there and the median of the other nodes' (noise on a loaded machine scatters the samples; a node that is
      really slower is slower steadily);
    it is a straggler when it is slow in every one of the `windows` windows. One node loaded after another
    (measured: on a loaded machine, both nodes of a fault-free run flagged in turn, ratio 2.0-2.5) is slow in
    fewer consecutive windows and never flagged. A node with fewer than `windows` x `window` samples is not
    judged and is nobody's peer yet; a node without a judged peer (or whose peers measure 0) is never a
    straggler. Pure."""
    need = window * windows
    judged = {s: list(v[-need:]) for s, v in samples.items() if len(v) >= need}
    slow_in: dict[int, int] = {s: 0 for s in judged}
    newest: dict[int, float] = {}
    for w in range(windows):            # the newest window first
        lo = need - (w + 1) * window
        med, mad = {}, {}
        for s, v in judged.items():
            part = v[lo:lo + window]
            med[s] = _median(part)
            mad[s] = _mad(part, med[s])
        if len(judged) < 2:              # nobody has a judged peer
            continue
        meds, mads = sorted(med.values()), sorted(mad.values())
        for s in judged:
            if slow_in[s] != w:          # already fast in a newer window
                continue
            base = median_without(meds, med[s])          # the median of the other nodes' medians
            spread = max(mad[s], median_without(mads, mad[s]))
            if base > 0 and med[s] / base >= ratio and med[s] - base > margin * spread:
                slow_in[s] += 1
                if w == 0:
                    newest[s] = round(med[s] / base, 2)
    return {s: newest[s] for s, n in slow_in.items() if n == windows}


# ---------------------------------------------------------------- a recovery in flight (control/inflight.py, cycle.py)
class Midway(str, Enum):
    """What a report means to a recovery waiting for the acks of one phase."""
    IGNORE = "ignore"            # expected meanwhile: comm errors, exits of an older generation (the restore
                                 # respawns those), anything from a node not in play (not active, or lost already)
    MISMATCH = "mismatch"        # a rank refused the restored state's layout: the job stops (no retry can help)
    PLAN_FAILED = "plan_failed"  # a source of the plan holds other bytes (integrity): the same plan cannot succeed
    RETRY = "retry"              # a restore failed otherwise: a new cycle
    NODE_LOST = "node_lost"      # a node in play is gone: its slot goes to a spare, a new cycle
    WORKER_LOST = "worker_lost"  # a worker of this generation died or hung: its node will never ack, a new cycle


# A worker lost mid-recovery is filed as a local reset: the next cycle's restore respawns it from its own node's
# snapshot (the node is alive), whatever the classifier would say of the same exit outside a recovery.
MIDWAY_WORKER_ACTION = Action.LOCAL_RESET


def midway(ev: r.Report, in_play: bool, generation: int) -> Midway:
    """How a report is handled while a recovery of `generation` waits for acks; `in_play`: it comes from an active
    node whose slot is not lost already. A refused restore counts from any node. Pure."""
    kind = ev.kind
    if isinstance(ev, r.RestoreFailed):
        if ev.mismatch:
            return Midway.MISMATCH
        return Midway.PLAN_FAILED if ev.integrity else Midway.RETRY
    if not in_play:
        return Midway.IGNORE
    if kind in NODE_LOSSES:
        return Midway.NODE_LOST
    if kind in (K.WORKER_EXIT, K.WORKER_HANG) and ev.generation == generation:
        # dropped as "expected", it cost the whole --recovery-timeout (39.9 s and 127.8 s recoveries in a soak,
        # two crash-worker 0.5 s apart)
        return Midway.WORKER_LOST
    return Midway.IGNORE


def mismatch_reason(ev: r.Report, step: int | None, persist_dir: Path | None) -> str:
    """The job's end reason when a rank refused the restored state's layout. Pure."""
    where = f"checkpoint step {step} in {persist_dir}" if step is not None and persist_dir else "the restored state"
    return (f"{where} does not match the script (rank {ev.rank}: {ev.reason}): it was written by "
            "another model or optimizer; start a new run (without --resume, another --rdzv-id or --run-dir), or "
            "point --persist-dir at this script's checkpoints")


class Recovery(str, Enum):
    """The recovery kinds one cycle executor drives (control/cycle.py)."""
    HOT_SWAP = "hot_swap"
    DRAIN = "drain"
    SHRINK = "shrink"
    GROW = "grow"
    FALLBACK = "fallback"


class Failure(str, Enum):
    """How a recovery cycle failed."""
    CASCADE = "cascade"      # a fault, a refused restore or a phase deadline while it was in flight
    PLAN = "plan"            # in-memory recovery is impossible (no plan, or a plan whose source holds other bytes)
    NO_SPARE = "no_spare"    # no spare within --spare-wait, with --on-no-spare shrink


class Next(str, Enum):
    """What follows a failed cycle."""
    RETRY = "retry"          # another cycle of the same recovery (after `pause`)
    SHRINK = "shrink"        # go on without the lost slots
    FALL_BACK = "fall_back"  # the persistent checkpoint, else torchrun's restart
    HOT_SWAP = "hot_swap"    # an interrupted drain: hot-swap the drained slot
    STOP = "stop"            # the job fails


@dataclass(frozen=True)
class AfterFailure:
    next: Next
    pause: float = 0.0       # seconds the job settles before a retry


def after_failure(kind: Recovery, failure: Failure, attempts: int, tries: int = 1) -> AfterFailure:
    """What follows cycle `attempts` of a `kind` recovery that failed with `failure`. A hot swap retries a cascade,
    backing off (after_cascade), until it gives in-memory recovery up; a plan that cannot succeed falls back at
    once; without a spare it shrinks (only raised with --on-no-spare shrink). A drain becomes a hot swap of its
    slot. A shrink or grow stops the job: the old snapshots left the agents' slots when the workers restarted.
    A fallback tries the next older checkpoint while `tries` last. Pure."""
    if kind is Recovery.HOT_SWAP:
        if failure is Failure.NO_SPARE:
            return AfterFailure(Next.SHRINK)
        pause = after_cascade(attempts) if failure is Failure.CASCADE else None
        return AfterFailure(Next.FALL_BACK) if pause is None else AfterFailure(Next.RETRY, pause)
    if kind is Recovery.DRAIN:
        return AfterFailure(Next.HOT_SWAP)
    if kind is Recovery.FALLBACK and failure is not Failure.NO_SPARE and attempts < tries:
        return AfterFailure(Next.RETRY)
    return AfterFailure(Next.STOP)


def no_spare(may_shrink: bool, on_no_spare: str, promoted_any: bool) -> Next:
    """--spare-wait passed with a lost slot still empty: shrink - only a hot swap's cycle that may (`may_shrink`:
    none of its slots was filled by a spare in an earlier cycle), with --on-no-spare shrink, before it promoted any
    spare in this cycle - else stop (exit 75). Pure."""
    return Next.SHRINK if may_shrink and on_no_spare == "shrink" and not promoted_any else Next.STOP
