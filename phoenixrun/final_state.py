"""A run's state as its run directory records it: what `phoenixrun status` shows once the master is gone.

The master's live state (`GET /v1/state`) ends with the master. Its event log (`RUN_DIR/events.jsonl`, the event
contract of docs/design.md) outlives it; `from_events` folds the log into a dict with the live state's keys, so
one renderer shows both. What only the live master knows (heartbeat ages, worker pids, snapshot timings,
throughput) is absent (None). Pure: events in, state out.
"""
from __future__ import annotations

from typing import Any

# the live state's phases a finished log maps to; no `job_finished` (the master was killed, its host went down,
# or it still runs but cannot be reached): "ended?" - the log does not say how it ended
FINISHED, FAILED, UNKNOWN = "finished", "failed", "ended?"


def _node(nodes: dict[str, dict[str, Any]], node_id: str) -> dict[str, Any]:
    return nodes.setdefault(node_id, {"node_id": node_id, "slot": None, "role": "active", "host": None,
                                      "agent_pid": None, "worker_pids": [], "heartbeat_age_s": None,
                                      "protection": {}, "snapshots": {}, "last_fault": None})


def _fault_text(e: dict[str, Any]) -> str:
    """A fault event as the live state's "last fault" reads (control/decide.py: `class: detail`)."""
    return f"{e.get('class') or e.get('kind') or 'fault'}: {e.get('detail') or ''}".rstrip(": ")[:200]


def _apply(s: dict[str, Any], nodes: dict[str, dict[str, Any]], e: dict[str, Any]) -> None:
    """Fold one event into the state `s` and its nodes (by node id)."""
    name = e.get("event")
    if name == "master_started":
        s.update(endpoint=e.get("endpoint"), master_pid=e.get("pid"), master_epoch=e.get("epoch"),
                 nnodes=e.get("nnodes", s["nnodes"]), nproc_per_node=e.get("nproc_per_node", s["nproc_per_node"]))
    elif name in ("node_joined", "node_rejoined"):
        n = _node(nodes, e["node"])
        n.update(role=e.get("role") or n["role"], slot=e.get("slot"))
        n["host"] = e.get("host", n["host"])
        n["agent_pid"] = e.get("agent_pid", n["agent_pid"])
    elif name == "job_started":
        s["world_size"] = e.get("world_size")
        s["active_nnodes"] = len(e.get("slots") or {}) or s["nnodes"]
    elif name == "fault_detected" and e.get("node") in nodes:
        nodes[e["node"]]["last_fault"] = _fault_text(e)
    elif name == "spare_promoted":
        replaced = nodes.get(e.get("replaces") or "")
        if replaced is not None and replaced["role"] == "active":
            replaced.update(role="failed", slot=None)
        _node(nodes, e["node"]).update(role="active", slot=e.get("slot"))
    elif name == "spare_lost" and e.get("node") in nodes:
        nodes[e["node"]].update(role="failed", slot=None, last_fault=nodes[e["node"]]["last_fault"] or "spare lost")
    elif name == "recovery_done":
        s["recoveries"] += 1
        if e.get("drained_node") in nodes:
            nodes[e["drained_node"]].update(role="drained", slot=None)
        s["step"] = e.get("restored_step", s["step"])
    elif name == "restart":
        s["restart_count"] = e.get("restart_count", s["restart_count"] + 1)
    elif name in ("job_shrunk", "job_grown"):
        s.update(active_nnodes=e.get("nnodes"), world_size=e.get("world_size"), step=e.get("restored_step"))
        slot_map = {int(k): v for k, v in (e.get("slot_map") or {}).items()}
        for n in nodes.values():
            if n["role"] == "active" and n["slot"] in slot_map:
                n["slot"] = slot_map[n["slot"]]
            elif n["role"] == "active" and name == "job_shrunk" and n["slot"] is not None:
                n.update(role="failed", slot=None)
    elif name == "rejected_request":
        by = s["rejected_requests"]["by_reason"]
        by[e.get("reason", "?")] = by.get(e.get("reason", "?"), 0) + int(e.get("count") or 1)
        s["rejected_requests"]["total"] += int(e.get("count") or 1)
    elif name == "job_finished":
        code = e.get("exit_code")
        s.update(phase=FINISHED if code == 0 else FAILED, exit_code=code, reason=e.get("reason"),
                 step=e.get("committed_step", s["step"]))
        s["restart_count"] = e.get("restarts", s["restart_count"])
        s["recoveries"] = e.get("recoveries", s["recoveries"])
    s["generation"] = max(s["generation"], e.get("generation") or 0)


def from_events(events: list[dict[str, Any]], run_id: str) -> dict[str, Any]:
    """The state of the run the events record, with the keys of the master's `/v1/state`. Pure."""
    s: dict[str, Any] = {"run_id": run_id, "endpoint": None, "master_pid": None, "master_epoch": None, "phase": UNKNOWN,
               "generation": 0, "step": None, "steps_per_s": None, "restart_count": 0, "recoveries": 0,
               "exit_code": None, "reason": None, "nnodes": 0, "nproc_per_node": None, "world_size": None,
               "active_nnodes": None, "rejected_requests": {"total": 0, "by_reason": {}}, "from_log": True}
    nodes: dict[str, dict[str, Any]] = {}
    for e in events:
        _apply(s, nodes, e)
    if s["active_nnodes"] is None:
        s["active_nnodes"] = s["nnodes"]
    if s["world_size"] is None and s["nproc_per_node"]:
        s["world_size"] = s["nnodes"] * s["nproc_per_node"]
    nproc = s["nproc_per_node"] or 0
    s["nodes"] = sorted(({**n, "ranks": [] if n["slot"] is None or n["role"] != "active"
                          else list(range(n["slot"] * nproc, (n["slot"] + 1) * nproc))} for n in nodes.values()),
                        key=lambda d: (d["slot"] is None, d["slot"] or 0, d["node_id"]))
    s["events"] = events[-15:]
    return s
