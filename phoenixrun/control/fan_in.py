"""The master's side of acks through the relays (protocol/relay.py): one `/v1/reports` request per relay carries
its children's quiesce and restore acks. The relay itself is authenticated (its own token); each report is
checked against its own node's seal and then taken exactly as if that node had sent it (control/handlers.py's
`report`), so a broadcast's acks cost the master O(sqrt N) requests instead of N. A report the master refuses
gets its refusal in its place in the answer; the others are taken."""
from __future__ import annotations

import time
from typing import Any, Callable

from phoenixrun.control import wire
from phoenixrun.control.jobstate import JobState
from phoenixrun.control.rejections import Rejections
from phoenixrun.protocol.messages import MessageError, UnknownNode
from phoenixrun.protocol.relay import RELAYED_KINDS, Batch, report_sealed
from phoenixrun.protocol.replies import Heard, TurnedAway

Report = Callable[[dict[str, Any]], Heard | TurnedAway]       # control/handlers.py's report (the token in it)
CheckToken = Callable[[str, str | None, str], None]           # ... and its token check (call with the lock held)


class FanIn:
    def __init__(self, job: JobState, rejections: Rejections, check_token: CheckToken, report: Report):
        self.job, self.rejections = job, rejections
        self.check_token, self.report = check_token, report
        self.batches = 0           # relayed requests taken
        self.taken = 0             # reports in them the master took

    def take(self, p: dict[str, Any]) -> dict[str, Any]:
        """A relay's batch: {"replies": [the reply to each report, in order]}; refused whole (MessageError) if the
        caller is not a member with its own token."""
        batch = Batch.from_wire(p)
        with self.job.cv:
            node = self.job.members.nodes.get(batch.relay)
            if node is None:
                raise UnknownNode()
            self.check_token(batch.relay, batch.token, "relayed reports")
            host = node.host
        replies = [self._one(body, mac, batch.relay, host) for body, mac in batch.reports]
        self.batches += 1
        self.taken += sum(1 for r in replies if "error" not in r)
        return {"replies": replies}

    def _one(self, body: bytes, mac: str, relay: str, host: str) -> dict[str, Any]:
        try:
            p = wire.loads(body)
            if not isinstance(p, dict):
                raise MessageError("a relayed report must be an object")
            node_id, kind = p.get("node_id"), p.get("kind")
            if kind not in RELAYED_KINDS:
                raise MessageError(f"a relay carries only {' and '.join(sorted(RELAYED_KINDS))} reports, not "
                                   f"{str(kind)[:40]!r}: send it to the master directly", reason="not_relayed")
            with self.job.cv:
                token = self.job.members.tokens.get(node_id) if isinstance(node_id, str) else None
            if token is None or not report_sealed(token, body, mac):
                raise MessageError(f"report of {str(node_id)[:80]!r} relayed by {relay!r} is not sealed by that "
                                   f"node's registration", code=403, reason="bad_seal")
            return self.report({**p, "token": token}).to_wire()
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            reason = e.reason if isinstance(e, MessageError) else "malformed"
            if getattr(e, "counted", True):
                self.rejections.note(time.time(), host, reason, "/v1/reports", str(e))
            return {"error": f"refused: {e}", "reason": reason}
