"""The relay protocol (docs/design.md, "Directive fan-out"): what the master, a relay agent and its children
exchange so that a broadcast costs the master O(sqrt N) writes (the tree: control/relay_tree.py).

- A relay's directive long-poll to the master carries `relay`: child id -> [the version it holds for the child,
  the version the child last said it holds] (the second is the child's ack, aggregated).
- The master answers a relay with a bundle: {"bundle": 1, "master_epoch", "own": the relay's own directive (or
  null), "children": id -> {"v": version, "g": generation, "d": the directive's encoded bytes as text, "mac"},
  "keys": id -> poll key}. The relay forwards "d" as it is, never parsing it.
- "mac" is HMAC-SHA256 of the directive's bytes under the child's registration token, which only the master and
  that child hold: a relay can neither forge nor alter a directive (a replayed older one is not newer, and
  agents act only on newer versions). A child's poll to its relay carries its poll key, derived from its token
  (the relay, holding the key, learns nothing it could seal with): a stranger with the job secret alone does not
  get a member's directive (it carries the generation's rendezvous prefix) from a relay.
- A child polls its relay over the agents' peer transport (agents/peer.py, op RELAY_OP); when the relay is
  unreachable it polls the master directly, which always holds every node's directive.

Acks travel the tree the other way: a broadcast's acks (RELAYED_KINDS: `quiesced`, `resumed`, one from every
agent at once) go to the child's relay (peer op REPORT_OP), which sends the master one request for all that
reached it meanwhile (`/v1/reports`: {"node_id": the relay, "token": its own, "reports": [{"d": a report's wire
bytes as text, "mac"}]}), and answers each child with the master's reply to its own report. Each report is sealed
by its child (`report_seal`, under the child's token, which the relay does not hold), so a relay can neither
forge nor alter one; it could replay one, which the master takes as the duplicate ack it is (a stale
generation's is moot). The master takes no other kind through a relay: a fault report goes to it directly.
A child whose relay fails or cannot reach the master sends the report to the master itself.

Heartbeats travel the tree the same way, but without waiting: a child hands its relay its heartbeat (peer op
BEAT_OP: the heartbeat's wire bytes without the token, with `seq`, a number that grows with each heartbeat of
this registration, sealed by `beat_seal`) and gets back at once the master's reply to its latest heartbeat that
the master has answered since (each reply handed over once) and the highest `seq` the master confirmed. The relay
keeps each child's newest heartbeat and, once per heartbeat period, right after its own, sends the master one
`/v1/heartbeats` request for all of them (a Batch, as above). So the master reads O(sqrt N) heartbeat requests a
period instead of N. The master takes a relayed heartbeat only if its child sealed it and its `seq` is above the
last it took (a relay cannot forge one, and it can replay each one it was given at most once). A child that has
no relay, whose relay fails, or whose latest confirmed heartbeat was sent longer ago than the master allows
(RelayLink.beats, half of --node-timeout) heartbeats the master directly (`beat_route`): a relay that stops
forwarding delays its children's heartbeats, it never makes them silent.
"""
from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Any, Sequence

from phoenixrun.protocol.messages import MessageError
from phoenixrun.protocol.names import ReportKind

RELAY_OP = "directive"       # the peer-transport op a child polls its relay with
REPORT_OP = "report"         # the peer-transport op a child sends its relay an ack with
BEAT_OP = "beat"             # the peer-transport op a child hands its relay its heartbeat with
BEAT_CALL_S = 1.0            # a child's heartbeat call to its relay gives up after this (then: the master directly)
RELAY_POLL_S = 2.0           # a child's long-poll at its relay: short, so a hung relay is left within seconds
FALLBACK_POLL_S = 5.0        # a child whose relay failed polls the master this long, then tries a relay again
MAX_CHILDREN = 4096          # children one relay poll may speak for (sqrt of 16M members)
MAX_BATCH_BYTES = 512 * 1024  # a relay's /v1/reports body stays under this (half the master's MAX_BODY); a
                             # quiesce ack of a 4-rank node is ~0.3 KB (302 bytes with 4 snapshots and 4
                             # replicas), so well over 1,000 children's fit one request
ACK_TIMEOUT_S = 5.0          # a relay waits this long for the master's answer to its children's acks
MAX_RELAYED_REPORT = MAX_BATCH_BYTES // 4   # a larger report goes to the master directly
RELAYED_KINDS = frozenset({ReportKind.QUIESCED, ReportKind.RESUMED})   # the only reports a relay may carry


def poll_key(token: str) -> str:
    """What a child shows its relay: derived from its token, not the token (which seals its directives)."""
    return hmac.new(token.encode(), b"phoenixrun relay poll", hashlib.sha256).hexdigest()


def seal(token: str, body: bytes) -> str:
    """The master's MAC of a directive's bytes for the node holding `token`."""
    return hmac.new(token.encode(), b"phoenixrun directive\0" + body, hashlib.sha256).hexdigest()


def sealed(token: str, body: bytes, mac: object) -> bool:
    """Did the master seal `body` for the node holding `token`?"""
    return isinstance(mac, str) and hmac.compare_digest(seal(token, body), mac)


def report_seal(token: str, body: bytes) -> str:
    """A child's MAC of its report's wire bytes, under its token: the master checks it (a relay cannot forge)."""
    return hmac.new(token.encode(), b"phoenixrun report\0" + body, hashlib.sha256).hexdigest()


def report_sealed(token: str, body: bytes, mac: object) -> bool:
    return isinstance(mac, str) and hmac.compare_digest(report_seal(token, body), mac)


def beat_seal(token: str, body: bytes) -> str:
    """A child's MAC of a heartbeat's wire bytes (`seq` in them), under its token."""
    return hmac.new(token.encode(), b"phoenixrun heartbeat\0" + body, hashlib.sha256).hexdigest()


def beat_sealed(token: str, body: bytes, mac: object) -> bool:
    return isinstance(mac, str) and hmac.compare_digest(beat_seal(token, body), mac)


def beat_route(relay: str | None, lag: float | None, now: float, confirmed_sent_at: float) -> str | None:
    """Where a child sends its next heartbeat: its relay's address, or None for the master directly. relay: the
    relay it polls now (None: none, or it failed); lag: RelayLink.beats (None: the master wants them directly);
    confirmed_sent_at: when it sent the latest heartbeat the master confirmed (by either path)."""
    if relay is None or lag is None or now - confirmed_sent_at > lag:
        return None
    return relay


@dataclass(frozen=True)
class Batch:
    """A relay's `/v1/reports` request, validated: who sends it (its own token) and its children's reports."""
    relay: str
    token: str
    reports: tuple[tuple[bytes, str], ...]     # (a report's wire bytes, its child's seal)

    def to_wire(self) -> dict[str, Any]:
        return {"node_id": self.relay, "token": self.token,
                "reports": [{"d": body.decode(), "mac": mac} for body, mac in self.reports]}

    @classmethod
    def from_wire(cls, p: object) -> Batch:
        if not isinstance(p, dict):
            raise MessageError("a relayed batch must be an object")
        relay, token, items = p.get("node_id"), p.get("token"), p.get("reports")
        if not isinstance(relay, str) or not isinstance(token, str):
            raise MessageError("a relayed batch needs node_id and token (the relay's own) as strings")
        if not isinstance(items, list) or len(items) > MAX_CHILDREN:
            raise MessageError(f"reports must be a list of at most {MAX_CHILDREN} {{d, mac}} objects")
        out = []
        for i, e in enumerate(items):
            if not isinstance(e, dict) or not isinstance(e.get("d"), str) or not isinstance(e.get("mac"), str):
                raise MessageError(f"reports[{i}]: want {{\"d\": the report as text, \"mac\": its seal}}")
            out.append((e["d"].encode(), e["mac"]))
        return cls(relay, token, tuple(out))


def batch_size(sizes: Sequence[int], limit: int = MAX_BATCH_BYTES) -> int:
    """How many queued reports (their sizes, front first) the next request carries: the first always, then while
    their total stays within `limit`."""
    total, n = 0, 0
    while n < len(sizes) and (n == 0 or total + sizes[n] <= limit):
        total, n = total + sizes[n], n + 1
    return n


def batch_replies(m: object) -> list[dict[str, Any]]:
    """The master's answer to a Batch: its reply to each report, in order."""
    replies = m.get("replies") if isinstance(m, dict) else None
    if not isinstance(replies, list) or not all(isinstance(r, dict) for r in replies):
        raise ValueError(f"the master's answer to relayed reports has no list of replies: {str(m)[:80]}")
    return replies


def parse_relay_state(value: object) -> dict[str, tuple[int, int]]:
    """A relay poll's `relay` field: child id -> (version held for it, version it acked); refused whole if
    malformed."""
    if not isinstance(value, dict):
        raise MessageError("relay must be an object: child id -> [held version, acked version]")
    if len(value) > MAX_CHILDREN:
        raise MessageError(f"relay speaks for {len(value)} children, at most {MAX_CHILDREN}")
    out: dict[str, tuple[int, int]] = {}
    for child, pair in value.items():
        if (not isinstance(child, str) or not isinstance(pair, list) or len(pair) != 2
                or not all(type(v) is int and v >= -1 for v in pair)):
            raise MessageError(f"relay entry {str(child)[:40]!r}: want child id -> [held version, acked version]")
        out[child] = (pair[0], pair[1])
    return out
