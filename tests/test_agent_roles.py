"""The agent's role and the course of a drain it asks for (agents/roles.py): the moves each may make. Tables."""
import pytest

from phoenixrun.agents.node import NodeState
from phoenixrun.agents.roles import DRAIN_MOVES, ROLE_MOVES, AgentRole, DrainStep, RoleError, drain_move, role_move
from tests.transitions import check_move

U, A, S, F = AgentRole.UNKNOWN, AgentRole.ACTIVE, AgentRole.SPARE, AgentRole.FAILED


@pytest.mark.parametrize("now, to, legal", [
    (U, A, True), (U, S, True), (U, F, True),      # registration
    (S, A, True),                                  # promoted into a slot
    (S, S, True),
    (A, A, True),                                  # every order that runs workers says so again
    (A, S, False),                                 # a slot is never given back
    (A, U, False), (S, U, False),
    (F, A, False),                                 # refused: the agent exits
    (U, U, False),
])
def test_role_moves(now, to, legal):
    check_move(role_move, now, to, legal, RoleError)


N, RQ, AS, ST = DrainStep.NONE, DrainStep.REQUESTED, DrainStep.ASKED, DrainStep.STARTED


@pytest.mark.parametrize("now, to, legal", [
    (N, RQ, True), (RQ, AS, True), (AS, ST, True),
    (N, AS, False),        # asked only from the main loop, after SIGTERM requested it
    (RQ, ST, False),       # taken on only once asked
    (ST, RQ, False),       # a second SIGTERM does not start another drain: the node leaves
    (AS, N, False),
])
def test_drain_moves(now, to, legal):
    check_move(drain_move, now, to, legal, RoleError)


def test_every_role_and_step_has_its_row():
    assert set(ROLE_MOVES) == set(AgentRole) and set(DRAIN_MOVES) == set(DrainStep)


def test_a_node_state_refuses_an_illegal_role():
    node = NodeState(node_id="n", nproc_per_node=1)
    assert node.role is U
    node.become(S)
    node.become(A)
    with pytest.raises(RoleError):
        node.become(S)
    assert node.role is A
