"""The job's state as `/v1/state` shows it (`phoenixrun status`, the metrics page, tests): read off the job under
its lock by the master's handlers; pure given the job, the event log's recent records and the rejection counts."""
from __future__ import annotations

import os
import time
from typing import Any

from phoenixrun.control.events import EventLog
from phoenixrun.control.jobstate import JobState
from phoenixrun.control.rejections import Rejections
from phoenixrun.control.state import Role


def job_view(job: JobState, events: EventLog, rejections: Rejections) -> dict[str, Any]:
    """The JSON of /v1/state (call with the job's lock held)."""
    cfg, now = job.cfg, time.time()
    steps = [max(s) for n in job.members.nodes.values() if n.role == Role.ACTIVE for s in n.snapshots.values() if s]
    return {
        "run_id": cfg.run_id, "endpoint": job.endpoint, "master_pid": os.getpid(),
        "master_epoch": job.master_epoch,
        "phase": job.course.phase.value, "generation": job.course.generation,
        "step": min(steps) if len(steps) == job.course.layout.world_size else None,
        "steps_per_s": job.telemetry.steps_per_s(), "restart_count": job.course.restart_count,
        "recoveries": job.course.recoveries, "exit_code": job.course.exit_code, "reason": job.course.reason,
        "protect_every": job.course.protect_every,
        "nnodes": cfg.nnodes, "nproc_per_node": cfg.nproc_per_node,
        "world_size": job.course.layout.world_size, "replicas": cfg.shape.replicas_on(cfg.nnodes),
        "active_nnodes": job.course.layout.nnodes,    # fewer than nnodes while shrunk (--on-no-spare shrink)
        # the global ranks a node's workers hold (none for a spare): where rank 0 runs, for status
        "nodes": sorted(({**n.to_json(now), "ranks": [] if n.slot is None else list(job.course.layout.ranks_of_slot(n.slot))}
                         for n in job.members.nodes.values()),
                        key=lambda d: (d["slot"] is None, d["slot"] or 0, d["node_id"])),
        "events": list(events.recent)[-15:],
        "rejected_requests": rejections.snapshot(),
    }
