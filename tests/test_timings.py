"""protocol/timings.py: the recovery phases a worker and its agent measure reach the master's `recovery_done`
whole - each phase the slowest rank's, nothing measured dropped, unknown names ignored."""
from __future__ import annotations

import pytest

from phoenixrun.control.cycle import slowest
from phoenixrun.protocol.reports import Resumed
from phoenixrun.protocol.timings import FIELDS, Timings


@pytest.mark.parametrize("a, b, both", [
    (Timings(), Timings(), Timings()),
    (Timings(rebuild_s=1.0), Timings(), Timings(rebuild_s=1.0)),
    (Timings(rebuild_s=1.0, fetch_s=0.5), Timings(rebuild_s=2.0), Timings(rebuild_s=2.0, fetch_s=0.5)),
    (Timings(state_s=0.3, params_fetch_s=0.1), Timings(state_s=0.2, params_fetch_s=0.4),
     Timings(state_s=0.3, params_fetch_s=0.4)),
])
def test_slowest_keeps_each_phase_s_largest(a, b, both):
    assert a.slowest(b) == b.slowest(a) == both


def test_the_wire_round_trips_every_field_and_ignores_unknown_names():
    t = Timings(**{f: i + 0.5 for i, f in enumerate(FIELDS)})
    assert Timings.from_wire(t.to_wire()) == t
    assert Timings.from_wire({"rebuild_s": 1, "spawn_s": 9.0}) == Timings(rebuild_s=1.0)
    assert Timings().to_wire() == {}


def test_the_master_records_every_phase_an_agent_reports():
    acks = {"a": Resumed(node_id="a", timings=Timings(rebuild_s=1.0, state_s=0.2, worker_recovery_s=1.5)),
            "b": Resumed(node_id="b", timings=Timings(rebuild_s=0.5, fetch_s=0.7, params_fetch_s=0.3)),
            "c": Resumed(node_id="c")}
    assert slowest(acks) == {"rebuild_s": 1.0, "state_s": 0.2, "worker_recovery_s": 1.5, "fetch_s": 0.7,
                             "params_fetch_s": 0.3}
