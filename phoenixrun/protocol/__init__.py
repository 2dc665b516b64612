"""The protocol between master, agents and workers: its names (names.py), limits and timeouts
(constants.py), the control API's typed messages and their parsers (messages.py) and the control client
(client.py).

Importing this package pulls no torch and nothing of the master or the agent: both sides, the load
generator (sim/swarm.py) and the tools depend on it, not on each other.
"""
from phoenixrun.protocol.names import REPORT_KINDS, Command, Event, PeerOp, ReportKind, WorkerOp

__all__ = ["Command", "Event", "PeerOp", "REPORT_KINDS", "ReportKind", "WorkerOp"]
