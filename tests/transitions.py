"""A transition table's check, as the tests of the master's phases and the agent's roles use it."""
import pytest


def check_move(move, now, to, legal: bool, error: type[Exception]) -> None:
    """`move(now, to)` returns `to` where the table allows the move, else raises `error` naming both ends."""
    if legal:
        assert move(now, to) is to
    else:
        with pytest.raises(error, match=f"{now.value} -> {to.value}"):
            move(now, to)
