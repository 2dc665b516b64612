"""The protocol's names, defined once: every string that travels between master, agents and workers.

Each member's value is exactly the string on the wire (StrEnum: a member *is* that str, so it compares,
hashes and serialises as the plain string): a message built with these names is byte-identical to one
built with literals, and a received string looks its member up with `Command(s)` (ValueError if unknown).

- `Command`: directive commands the master sends an agent (`/v1/directive`'s `command`).
- `ReportKind`: what the master's controller inbox carries: reports agents send (`/v1/report`'s `kind`,
  REPORT_KINDS) and the three the master queues itself (a node joined, a node's heartbeat lost, a
  recovery attempt's deadline).
- `WorkerOp`: the node-local channel between an agent and its workers (Unix socket, JSON lines, `op`).
- `PeerOp`: agent-to-agent requests (agents/peer.py frames, `op`).
- `Event`: the `event` field of events.jsonl lines (control/events.py): the contract tools and tests read.
- `Endpoint`: the master's HTTP API paths (control/server.py).
"""
from __future__ import annotations

from enum import StrEnum


class Command(StrEnum):
    NOOP = "noop"              # the long-poll expired with nothing new
    WAIT = "wait"              # a spare: stand by (`warm`: pre-start workers without a rank)
    RUN = "run"                # start (or, with `resume`, keep) this slot's workers
    RESTART = "restart"        # kill and start the workers (from `restore_step` on disk, or from scratch)
    QUIESCE = "quiesce"        # recovery phase 1: stop after the current step, report `quiesced` (`at_step`:
                               # a drain's, stop at that step boundary, the step's snapshot committed)
    RESTORE = "restore"        # recovery phase 2: fetch the plan's state, rebuild, report `resumed`
    STOP = "stop"              # exit with `exit_code` (or `fenced`: replaced while away, never rejoin)


class ReportKind(StrEnum):
    # sent by agents (/v1/report)
    LEFT = "left"
    WORKERS_DONE = "workers_done"
    WORKER_EXIT = "worker_exit"
    WORKER_HANG = "worker_hang"
    RESTORE_FAILED = "restore_failed"
    RESTORE_REFUSED = "restore_refused"      # one option of a restore source failed: the agent tries the next
    RESUMED = "resumed"
    QUIESCED = "quiesced"
    COMM_ERROR = "comm_error"
    NAN_LOSS = "nan_loss"
    WORKER_ERROR = "worker_error"
    PROTECTION_MODE = "protection_mode"
    HEALTH = "health"
    LAYOUT = "layout"          # where the job's DTensor state has identical copies (redundancy.PeerSet), once
    DRAIN = "drain"            # the agent got SIGTERM: move its ranks to a spare (also queued for `phoenixrun drain`)
    SUSPECT = "suspect"        # a ring neighbour stopped answering (control/ring_watch.py; the watch desk judges)
    # queued by the master itself, never accepted from the wire
    JOINED = "joined"
    NODE_LOST = "node_lost"
    ATTEMPT_CHECK = "attempt_check"


# report kinds an agent sends, and whether a stale generation makes the report moot (it is about workers of
# a generation the master has moved past: acting on it would hit the new generation's healthy workers)
REPORT_KINDS: dict[ReportKind, bool] = {
    ReportKind.LEFT: False, ReportKind.WORKERS_DONE: True, ReportKind.WORKER_EXIT: True,
    ReportKind.WORKER_HANG: True, ReportKind.RESTORE_FAILED: False, ReportKind.RESTORE_REFUSED: False,
    ReportKind.RESUMED: False,
    ReportKind.QUIESCED: False, ReportKind.COMM_ERROR: True, ReportKind.NAN_LOSS: True,
    ReportKind.WORKER_ERROR: True, ReportKind.PROTECTION_MODE: False, ReportKind.HEALTH: False,
    ReportKind.LAYOUT: False,
    ReportKind.DRAIN: False, ReportKind.SUSPECT: False}


class WorkerOp(StrEnum):
    # worker -> agent
    HELLO = "hello"                      # a worker announces its local rank and pid
    ALLOC = "alloc"                      # request: shared-memory snapshot slots for this many bytes
    SLOTS = "slots"                      # request: the paths of the slots already allocated
    WRITE = "write"                      # request: a slot to write the next snapshot into
    WRITTEN = "written"                  # a snapshot is in its slot: replicate and commit it
    PROGRESS = "progress"                # a step began (hang watchdog); step_s: its longest step since (quiesce grace)
    PONG = "pong"                        # answer to PING
    QUIESCED = "quiesced"                # stopped for a recovery, at next_step
    RESUMED = "resumed"                  # rebuilt after a recovery (timings)
    COMM_ERROR = "comm_error"            # a collective failed
    NAN_LOSS = "nan_loss"                # job.observe_loss() saw a non-finite loss
    ERROR = "error"                      # the script's own exception, before the worker exits
    PROTECTION_MODE = "protection_mode"  # the adaptive protection interval changed
    LAYOUT = "layout"                    # rank 0 at protect(): the job's DTensor peer set (or none), for the plan
    # agent -> worker
    REPLY = "reply"                      # the answer to a request, carrying its id
    ASSIGN = "assign"                    # the worker's rank and world
    REBUILD = "rebuild"                  # restore and rebuild process groups (recovery phase 2)
    QUIESCE = "quiesce"                  # stop after the current step (recovery phase 1; `at_step`: at that boundary)
    COMMITTED = "committed"              # a snapshot step is replicated
    COMMIT_FAILED = "commit_failed"      # replicating it failed
    PING = "ping"                        # liveness probe (hang watchdog)
    ABORT_COMM = "abort_comm"            # fault drill: make this worker's collectives fail
    POISON_LOSS = "poison_loss"          # fault drill: the next observed loss is NaN
    SLOW = "slow"                        # fault drill: compute `factor` times slower (a straggler)
    # inside the worker: its link to the agent closed
    AGENT_GONE = "agent_gone"


class PeerOp(StrEnum):
    PUT = "put"                          # store a replica of a rank's snapshot
    GET_PRIVATE = "get_private"          # fetch a rank's private state of a step
    GET_SHARED = "get_shared"            # fetch a rank's shared (model) state of a step
    PING = "ping"                        # reachability


class Event(StrEnum):
    MASTER_STARTED = "master_started"
    MASTER_RECOVERED = "master_recovered"
    MASTER_STALLED = "master_stalled"
    MASTER_STANDBY = "master_standby"      # a master with --lease-ttl waits: another one holds the lease
    MASTER_TAKEOVER = "master_takeover"    # a standby claimed the next epoch and acts from now on
    MASTER_DEPOSED = "master_deposed"      # a master saw a newer epoch claimed: it stops acting
    NODE_JOINED = "node_joined"
    NODE_REJOINED = "node_rejoined"
    NODE_REFUSED = "node_refused"
    NODE_FENCED = "node_fenced"
    SPARE_LOST = "spare_lost"
    SPARE_PROMOTED = "spare_promoted"
    JOB_STARTED = "job_started"
    JOB_FINISHED = "job_finished"
    JOB_SHRUNK = "job_shrunk"            # --on-no-spare shrink: the job goes on without a lost node (control/reshape.py)
    JOB_GROWN = "job_grown"              # a shrunk job took a spare back in
    DIRECTIVE_SENT = "directive_sent"
    FAULT_INJECTED = "fault_injected"
    FAULT_DETECTED = "fault_detected"
    PROTECTION_MODE = "protection_mode"
    RECOVERY_STARTED = "recovery_started"
    RECOVERY_PLAN = "recovery_plan"
    RECOVERY_DONE = "recovery_done"
    RECOVERY_FAILED = "recovery_failed"
    RESTORE_REFUSED = "restore_refused"
    RESTART = "restart"
    FALLBACK_RESTART = "fallback_restart"
    FALLBACK_DONE = "fallback_done"
    CHECKPOINT_REJECTED = "checkpoint_rejected"
    REJECTED_REQUEST = "rejected_request"
    DRAIN_REQUESTED = "drain_requested"
    STRAGGLER = "straggler"


class Endpoint(StrEnum):
    REGISTER = "/v1/register"            # POST: an agent joins (or rejoins a restarted master)
    HEARTBEAT = "/v1/heartbeat"          # POST: liveness, inventories; the reply carries injected faults
    REPORT = "/v1/report"                # POST: a ReportKind
    REPORTS = "/v1/reports"              # POST: a relay's batch of its children's acks (protocol/relay.py)
    HEARTBEATS = "/v1/heartbeats"        # POST: a relay's batch of its children's heartbeats (protocol/relay.py)
    DIRECTIVE = "/v1/directive"          # POST: the directive long-poll (answered with a Command)
    INJECT = "/v1/inject"                # POST: `phoenixrun inject`
    DRAIN = "/v1/drain"                  # POST: `phoenixrun drain`
    STATE = "/v1/state"                  # GET: the job's state (`phoenixrun status`)
    METRICS = "/metrics"                 # GET: Prometheus text
