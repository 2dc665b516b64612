"""The master's side of acks and heartbeats through the relays (protocol/relay.py): one `/v1/reports` request per
relay carries its children's quiesce and restore acks, one `/v1/heartbeats` request per relay and heartbeat
period its children's heartbeats. The relay itself is authenticated (its own token); each report or heartbeat is
checked against its own node's seal and then taken exactly as if that node had sent it (control/handlers.py's
`report`, the master's `heartbeat`), so a broadcast's acks and a period's heartbeats cost the master O(sqrt N)
requests instead of N. One the master refuses gets its refusal in its place in the answer; the others are taken.
A relayed heartbeat is taken only if its `seq` is above the last one taken of that node's registration: a relay
can replay a heartbeat it was given at most once, so it cannot keep a dead child alive."""
from __future__ import annotations

import time
from typing import Any, Callable

from phoenixrun.control import wire
from phoenixrun.control.jobstate import JobState
from phoenixrun.control.rejections import Rejections
from phoenixrun.protocol.messages import MessageError, UnknownNode
from phoenixrun.protocol.names import Endpoint
from phoenixrun.protocol.relay import RELAYED_KINDS, Batch, beat_sealed, report_sealed
from phoenixrun.protocol.replies import Heard, TurnedAway

Report = Callable[[dict[str, Any]], Heard | TurnedAway]       # control/handlers.py's report (the token in it)
Beat = Callable[[dict[str, Any]], dict[str, Any]]             # the master's heartbeat: its reply on the wire
CheckToken = Callable[[str, str | None, str], None]           # ... and its token check (call with the lock held)
Sealed = Callable[[str, bytes, object], bool]


class Stale(MessageError):
    """A relayed heartbeat no newer than one already taken of that node (a replay, or overtaken by a direct one):
    ignored, and not counted as hostile - a relay's batch can race its child's own heartbeat."""

    counted = False

    def __init__(self, node_id: str, seq: int, last: int):
        super().__init__(f"heartbeat {seq} of {node_id!r} is not newer than {last}", code=409, reason="stale")


class FanIn:
    def __init__(self, job: JobState, rejections: Rejections, check_token: CheckToken, report: Report,
                 heartbeat: Beat | None = None):
        self.job, self.rejections = job, rejections
        self.check_token, self.report, self.heartbeat = check_token, report, heartbeat
        self.batches = 0           # relayed report requests taken
        self.taken = 0             # reports in them the master took
        self.beat_batches = 0      # relayed heartbeat requests taken
        self.beats = 0             # heartbeats in them the master took
        self._seq: dict[str, tuple[str, int]] = {}   # node -> (the token it was registered with, last seq taken)

    def take(self, p: dict[str, Any]) -> dict[str, Any]:
        """A relay's batch of acks: {"replies": [the reply to each report, in order]}; refused whole (MessageError)
        if the caller is not a member with its own token."""
        batch, host = self._batch(p, "relayed reports")
        replies = [self._one(body, mac, batch.relay, host, Endpoint.REPORTS, self._report)
                   for body, mac in batch.reports]
        self.batches += 1
        self.taken += sum(1 for r in replies if "error" not in r)
        return {"replies": replies}

    def take_beats(self, p: dict[str, Any]) -> dict[str, Any]:
        """A relay's batch of heartbeats: {"replies": [the master's heartbeat reply to each, in order]}."""
        if self.heartbeat is None:
            raise MessageError("this master takes no relayed heartbeats", code=404, reason="no_such_endpoint")
        batch, host = self._batch(p, "relayed heartbeats")
        replies = [self._one(body, mac, batch.relay, host, Endpoint.HEARTBEATS, self._beat)
                   for body, mac in batch.reports]
        self.beat_batches += 1
        self.beats += sum(1 for r in replies if "error" not in r)
        return {"replies": replies}

    def _batch(self, p: dict[str, Any], what: str) -> tuple[Batch, str]:
        batch = Batch.from_wire(p)
        with self.job.cv:
            node = self.job.members.nodes.get(batch.relay)
            if node is None:
                raise UnknownNode()
            self.check_token(batch.relay, batch.token, what)
            return batch, node.host

    def _report(self, p: dict[str, Any], token: str, body: bytes, mac: str) -> dict[str, Any]:
        if p.get("kind") not in RELAYED_KINDS:
            raise MessageError(f"a relay carries only {' and '.join(sorted(RELAYED_KINDS))} reports, not "
                               f"{str(p.get('kind'))[:40]!r}: send it to the master directly", reason="not_relayed")
        self._check_seal(report_sealed, token, body, mac, p, "report")
        return self.report({**p, "token": token}).to_wire()

    def _beat(self, p: dict[str, Any], token: str, body: bytes, mac: str) -> dict[str, Any]:
        self._check_seal(beat_sealed, token, body, mac, p, "heartbeat")
        node_id, seq = p["node_id"], p.get("seq")
        if type(seq) is not int or seq < 0:
            raise MessageError(f"a relayed heartbeat needs seq, a non-negative integer, got {str(seq)[:40]!r}")
        with self.job.cv:
            held_token, last = self._seq.get(node_id, (token, -1))
            last = last if held_token == token else -1       # registered again since: its seq starts over
            if seq <= last:
                raise Stale(node_id, seq, last)
            self._seq[node_id] = (token, seq)
        assert self.heartbeat is not None
        return self.heartbeat({**p, "token": token})

    @staticmethod
    def _check_seal(check: Sealed, token: str, body: bytes, mac: str, p: dict[str, Any], what: str) -> None:
        if not check(token, body, mac):
            raise MessageError(f"{what} of {str(p.get('node_id'))[:80]!r} is not sealed by that node's "
                               f"registration", code=403, reason="bad_seal")

    def _one(self, body: bytes, mac: str, relay: str, host: str, path: str,
             take: Callable[[dict[str, Any], str, bytes, str], dict[str, Any]]) -> dict[str, Any]:
        try:
            p = wire.loads(body)
            if not isinstance(p, dict):
                raise MessageError("a relayed message must be an object")
            node_id = p.get("node_id")
            with self.job.cv:
                token = self.job.members.tokens.get(node_id) if isinstance(node_id, str) else None
            if token is None:
                raise MessageError(f"{str(node_id)[:80]!r}, relayed by {relay!r}, is not a member", code=403,
                                   reason="bad_seal")
            return take(p, token, body, mac)
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            reason = e.reason if isinstance(e, MessageError) else "malformed"
            if getattr(e, "counted", True):
                self.rejections.note(time.time(), host, reason, path, str(e))
            return {"error": f"refused: {e}", "reason": reason}
