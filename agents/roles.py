"""What the agent is in the job (`AgentRole`) and how far a drain it asked for has come (`DrainStep`), each with
the moves it may make, written down as the master's phases are (control/state.py's PHASE_MOVES); an illegal move
raises RoleError (a bug in the agent, never a fault of the job). Pure."""
from __future__ import annotations

from enum import Enum


class RoleError(Exception):
    """An illegal move of the agent's role or of its drain."""


class AgentRole(str, Enum):
    UNKNOWN = "unknown"    # not registered yet
    ACTIVE = "active"      # holds a node slot: its workers are ranks of the job
    SPARE = "spare"        # waits (with warm workers) to be promoted into a slot
    FAILED = "failed"      # refused by the master at registration: the agent exits


# registration makes an agent active or a spare (refused: failed, it exits); a spare is promoted by the first order
# that runs workers in a slot (run, restore, restart, reshape); a slot is never given back (a node that must go is
# told to stop)
ROLE_MOVES: dict[AgentRole, frozenset[AgentRole]] = {
    AgentRole.UNKNOWN: frozenset({AgentRole.ACTIVE, AgentRole.SPARE, AgentRole.FAILED}),
    AgentRole.SPARE: frozenset({AgentRole.SPARE, AgentRole.ACTIVE}),
    AgentRole.ACTIVE: frozenset({AgentRole.ACTIVE}),
    AgentRole.FAILED: frozenset(),
}


class DrainStep(str, Enum):
    """A drain this agent asks for when it gets SIGTERM (an active node of an API job)."""
    NONE = "none"              # no SIGTERM (or not a node that can be drained: it just leaves)
    REQUESTED = "requested"    # SIGTERM: the main loop asks the master (never the signal handler)
    ASKED = "asked"            # asked: the node leaves at the deadline unless the master takes the drain on
    STARTED = "started"        # the master's quiesce for the drain came: the spare fetches from this node


DRAIN_MOVES: dict[DrainStep, frozenset[DrainStep]] = {
    DrainStep.NONE: frozenset({DrainStep.REQUESTED}),
    DrainStep.REQUESTED: frozenset({DrainStep.ASKED}),
    DrainStep.ASKED: frozenset({DrainStep.STARTED}),
    DrainStep.STARTED: frozenset(),
}


def role_move(now: AgentRole, to: AgentRole) -> AgentRole:
    """`to`, if the agent's role may move there from `now` (ROLE_MOVES); else RoleError."""
    if to not in ROLE_MOVES[now]:
        raise RoleError(f"illegal role move {now.value} -> {to.value}")
    return to


def drain_move(now: DrainStep, to: DrainStep) -> DrainStep:
    """`to`, if the drain may move there from `now` (DRAIN_MOVES); else RoleError."""
    if to not in DRAIN_MOVES[now]:
        raise RoleError(f"illegal drain move {now.value} -> {to.value}")
    return to
