"""A watcher's suspect report (control/ring_watch.py): sent to /v1/report with kind SUSPECT_KIND.

{"kind": "suspect", "node_id": the watcher, "token": its token, "suspect": the silent neighbour's node id,
 "silent_for": seconds since the neighbour last answered the watcher}

The time is a duration in the watcher's own clock, not a timestamp: the master places it in its clock on arrival,
so no clock skew between hosts enters the decision.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from phoenixrun.protocol.messages import MessageError
from phoenixrun.protocol.names import ReportKind
from phoenixrun.protocol.reports import MAX_SILENT_S

SUSPECT_KIND = ReportKind.SUSPECT.value
_ID = re.compile(r"[A-Za-z0-9._:@/+\-]{1,256}\Z")


@dataclass(frozen=True)
class Suspect:
    watcher: str
    token: str | None
    suspect: str
    silent_for: float


def is_suspect_report(p: object) -> bool:
    return isinstance(p, dict) and p.get("kind") == SUSPECT_KIND


def parse_suspect(p: dict[str, Any]) -> Suspect:
    """The report, validated; MessageError naming the field otherwise."""
    ids = {}
    for name in ("node_id", "suspect"):
        v = p.get(name)
        if not isinstance(v, str) or not _ID.match(v):
            raise MessageError(f"{name} must be a node id, got {str(v)[:80]!r}")
        ids[name] = v
    if ids["node_id"] == ids["suspect"]:
        raise MessageError("a node cannot suspect itself")
    s = p.get("silent_for")
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or not 0 <= s <= MAX_SILENT_S:
        raise MessageError(f"silent_for must be seconds in [0, {MAX_SILENT_S:g}], got {str(s)[:40]!r}")
    token = p.get("token")
    if token is not None and not isinstance(token, str):
        raise MessageError("token must be a string")
    return Suspect(watcher=ids["node_id"], token=token, suspect=ids["suspect"], silent_for=float(s))
