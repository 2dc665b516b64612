"""Prometheus text exposition of the master's state (pure: state dict in, text out).

A gauge reads 0 rather than disappearing: every role is exported whether or not a node has it (a scrape that
finds no `role="spare"` sample cannot tell "no spares left" from "not scraped"). A label with no value is left
out, never written as "None". Scraping with the job secret: docs/monitoring.md.
"""
from __future__ import annotations

from typing import Any

# every role a node may have (control/state.py Role): each is exported, 0 when no node has it
ROLES = ("active", "spare", "failed", "drained")


def _labels(**labels: object) -> str:
    """`{k="v",...}` of the labels that have a value (None: left out); "" when none has. Pure."""
    kept = [f'{k}="{v}"' for k, v in labels.items() if v is not None]
    return "{" + ",".join(kept) + "}" if kept else ""


def render(state: dict[str, Any]) -> str:
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP phoenixrun_{name} {help_}")
        lines.append(f"# TYPE phoenixrun_{name} {kind}")
        for labels, value in samples:
            lines.append(f"phoenixrun_{name}{labels} {value}")

    metric("generation", "gauge", "Process-group generation.", [("", state["generation"])])
    metric("step", "gauge", "Last step committed on every rank.", [("", state.get("step") or 0)])
    metric("steps_per_second", "gauge", "Recent training throughput.", [("", state.get("steps_per_s") or 0.0)])
    metric("restarts_total", "counter", "Torchrun-style full restarts.", [("", state["restart_count"])])
    metric("recoveries_total", "counter", "Completed hot-swap recoveries.", [("", state["recoveries"])])
    roles: dict[str, int] = dict.fromkeys(ROLES, 0)
    for n in state["nodes"]:
        roles[n["role"]] = roles.get(n["role"], 0) + 1
    refused = (state.get("rejected_requests") or {}).get("by_reason", {})
    metric("rejected_requests_total", "counter", "Requests the master refused, by reason.",
           [(_labels(reason=r), c) for r, c in sorted(refused.items())])
    metric("nodes", "gauge", "Agents by role.", [(_labels(role=r), c) for r, c in sorted(roles.items())])
    metric("node_heartbeat_age_seconds", "gauge", "Seconds since each agent's last heartbeat (a spare has no slot).",
           [(_labels(node=n["node_id"], slot=n["slot"], role=n["role"]), n["heartbeat_age_s"]) for n in state["nodes"]])
    return "\n".join(lines) + "\n"
