"""Partition drill: this node's network traffic is dropped, from inside the agent.

`phoenixrun inject --fault partition[:SECONDS]` cuts the node off: every call to the master fails (no
heartbeats, reports or directives get through, replies in flight are lost), the peer server stops listening
and drops its connections (peers and the master's probes cannot connect), calls to peer agents fail, and the
node's workers shut down their gloo and store sockets. Only the node-local Unix channel between agent and
workers keeps working, as it would in a real partition. The traffic comes back after SECONDS, or without
SECONDS when the agent gets SIGUSR1; the master then fences the node if it was replaced meanwhile
(control/state.py::fence_reply).

Done in-process rather than with network namespaces or a packet filter: the standalone launcher runs every
node on loopback, iptables is not installed in CI, and moving a running agent into a namespace would change
its addresses. What the rest of the job observes is the same: the node goes silent and its connections drop.
"""
from __future__ import annotations

import threading
from typing import Any

from phoenixrun.protocol.client import ControlClient
from phoenixrun.protocol.peer_requests import PeerRequest
from phoenixrun.protocol.constants import CLIENT_TIMEOUT_S
from phoenixrun.agents.peer import Payload, PeerClient, PeerError


class NetworkCut:
    """Whether this node's traffic is currently dropped."""

    def __init__(self) -> None:
        self._cut = threading.Event()

    @property
    def active(self) -> bool:
        return self._cut.is_set()

    def start(self) -> None:
        self._cut.set()

    def heal(self) -> None:
        self._cut.clear()

    def blocked(self) -> str | None:
        """The control client's gate (protocol/client.py): why a call cannot go out now, None if it can."""
        return "network partitioned (injected)" if self.active else None


class GatedControlClient(ControlClient):
    """A ControlClient whose calls fail while the node is cut off, like calls into a partitioned network
    (the cut is the client's injected gate)."""

    def __init__(self, endpoint: str, secret: str, cut: NetworkCut, timeout: float = CLIENT_TIMEOUT_S):
        super().__init__(endpoint, secret, timeout, gate=cut.blocked)
        self.cut = cut


class GatedPeerClient(PeerClient):
    def __init__(self, secret: str, cut: NetworkCut, connect_timeout: float = 2.0, io_timeout: float = 10.0):
        super().__init__(secret, connect_timeout, io_timeout)
        self.cut = cut

    def call(self, addr: str, request: PeerRequest, payload: Payload = b"") -> tuple[dict[str, Any], bytearray]:
        if self.cut.active:
            raise PeerError(f"peer {addr}: network partitioned (injected)")
        return super().call(addr, request, payload)
