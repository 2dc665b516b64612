"""The protocol between master, agents and workers: its names (names.py), limits and timeouts
(constants.py), the control API's typed messages and their parsers (messages.py), the HTTP status of each
outcome (status.py), the decoding of int-keyed maps in directives (codec.py) and the control client (client.py).

Importing this package pulls no torch and nothing of the master or the agent: both sides, the load
generator (sim/swarm.py) and the tools depend on it, not on each other.
"""
from phoenixrun.protocol.names import REPORT_KINDS, Command, Endpoint, Event, PeerOp, ReportKind, WorkerOp
from phoenixrun.protocol.status import Status

__all__ = ["Command", "Endpoint", "Event", "PeerOp", "REPORT_KINDS", "ReportKind", "Status", "WorkerOp"]
