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
"""
from __future__ import annotations

import hashlib
import hmac

from phoenixrun.protocol.messages import MessageError

RELAY_OP = "directive"       # the peer-transport op a child polls its relay with
RELAY_POLL_S = 2.0           # a child's long-poll at its relay: short, so a hung relay is left within seconds
FALLBACK_POLL_S = 5.0        # a child whose relay failed polls the master this long, then tries a relay again
MAX_CHILDREN = 4096          # children one relay poll may speak for (sqrt of 16M members)


def poll_key(token: str) -> str:
    """What a child shows its relay: derived from its token, not the token (which seals its directives)."""
    return hmac.new(token.encode(), b"phoenixrun relay poll", hashlib.sha256).hexdigest()


def seal(token: str, body: bytes) -> str:
    """The master's MAC of a directive's bytes for the node holding `token`."""
    return hmac.new(token.encode(), b"phoenixrun directive\0" + body, hashlib.sha256).hexdigest()


def sealed(token: str, body: bytes, mac: object) -> bool:
    """Did the master seal `body` for the node holding `token`?"""
    return isinstance(mac, str) and hmac.compare_digest(seal(token, body), mac)


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
