"""Master decisions as pure functions: admission, spare choice, restore step, recovery plans."""
import pytest

from phoenixrun.control.state import (SHARED_OPTIONS, FreeSlots, NodeRecord, PlanError, RankSource, Role, admit,
                                      pick_spare, plan_recovery, restore_step)
from phoenixrun.topology import Layout, place_replicas


def node(nid, role, slot=None, snapshots=None, replicas=None, domain=None):
    return NodeRecord(node_id=nid, host="h", agent_pid=1, peer_addr=f"{nid}:1", fault_domain=domain or nid,
                      role=role, slot=slot, snapshots=snapshots or {}, replicas=replicas or {})


def test_admit_fills_slots_lowest_first_then_spares():
    free, taken = FreeSlots(3), {}
    assert admit(False, free, taken) == (Role.ACTIVE, 0)
    taken[0] = "a"
    taken[2] = "c"                                                 # a rejoining node kept its slot
    assert admit(False, free, taken) == (Role.ACTIVE, 1)
    taken[1] = "b"
    assert admit(False, free, taken) == (Role.SPARE, None)        # every slot taken
    assert admit(True, FreeSlots(3), {}) == (Role.SPARE, None)    # after the start: a repaired node is a spare


def test_pick_spare_avoids_failed_domain():
    nodes = {"s1": node("s1", Role.SPARE, domain="rack1"), "s2": node("s2", Role.SPARE, domain="rack2"),
             "x": node("x", Role.FAILED)}
    assert pick_spare(nodes, ["rack1"]).node_id == "s2"
    assert pick_spare(nodes).node_id == "s1"
    assert pick_spare({"x": node("x", Role.ACTIVE, 0)}) is None


@pytest.mark.parametrize("spares,avoid,expected", [
    ([("s1", "r1", False), ("s2", "r2", True)], [], "s2"),          # warm workers up beats joined first
    ([("s1", "r1", True), ("s2", "r2", True)], [], "s1"),           # both ready: joined first
    ([("s1", "r1", False), ("s2", "r2", False)], [], "s1"),         # none ready (no API yet): joined first
    ([("s1", "r1", False), ("s2", "r1", True)], ["r1"], "s2"),
    ([("s1", "r2", False), ("s2", "r1", True)], ["r1"], "s1"),      # the fault domain still comes first
])
def test_pick_spare_prefers_ready_warm_workers(spares, avoid, expected):
    nodes = {}
    for nid, domain, ready in spares:
        nodes[nid] = node(nid, Role.SPARE, domain=domain)
        nodes[nid].warm_ready = ready
    assert pick_spare(nodes, avoid).node_id == expected


@pytest.mark.parametrize("available,expected", [
    ({0: [4, 5], 1: [5, 6], 2: [5]}, 5),
    ({0: [4, 5], 1: [3, 4]}, 4),
    ({0: [5], 1: [6]}, None),
    ({0: [], 1: [1]}, None),
])
def test_restore_step_is_last_common(available, expected):
    assert restore_step(available.values()) == expected


def _cluster():
    # 3 nodes x 1 rank, replicas k=1 on the DP ring: rank r's replica lives on slot r+1
    lay = Layout(3, 1)
    placement = place_replicas(lay, 1)
    nodes = {
        "a": node("a", Role.ACTIVE, 0, snapshots={0: [6, 7]}, replicas={2: [6, 7]}),
        "b": node("b", Role.ACTIVE, 1, snapshots={1: [7, 8]}, replicas={0: [7]}),
        "c": node("c", Role.ACTIVE, 2, snapshots={2: [7]}, replicas={1: [6, 7]}),
        "s": node("s", Role.SPARE),
    }
    return lay, placement, nodes, {0: "a", 1: "b", 2: "c"}


def test_plan_replaces_lost_node_from_replica_and_dp_peer():
    lay, placement, nodes, slots = _cluster()
    plan = plan_recovery(lay, nodes, slots, lost_slots={1}, placement=placement, replacements={1: "s"})
    assert plan.restore_step == 7
    assert plan.slots == {0: "a", 1: "s", 2: "c"}                     # survivors keep their slots
    # every option at step 7, in the order to try them: the one holder, then the peers in ring order
    assert plan.fetch == {1: RankSource(private=("c:1",), shared=(("c:1", 2), ("a:1", 0)))}
    assert (plan.fetch[1].private_addr, plan.fetch[1].shared_addr, plan.fetch[1].shared_rank) == ("c:1", "c:1", 2)


def _ring(n: int, replicas: dict[int, dict[int, list[int]]], snapshots: dict[int, list[int]] | None = None):
    """n nodes x 1 rank, replicas k=2 on the DP ring; node i is "n{i}", holding `replicas[i]` and its own rank's
    snapshots (`snapshots[i]`, default [6, 7])."""
    lay = Layout(n, 1)
    nodes = {f"n{i}": node(f"n{i}", Role.ACTIVE, i, snapshots={i: (snapshots or {}).get(i, [6, 7])},
                           replicas=replicas.get(i, {})) for i in range(n)}
    nodes["s"] = node("s", Role.SPARE)
    return lay, place_replicas(lay, 2), nodes, {i: f"n{i}" for i in range(n)}


@pytest.mark.parametrize("n,replicas,snapshots,expected", [
    # rank 0's holders are slots 1 and 2 (ring order): both have step 7, both are named, first holder first
    (3, {1: {0: [6, 7]}, 2: {0: [6, 7]}}, None, (7, ("n1:1", "n2:1"), (("n1:1", 1), ("n2:1", 2)))),
    # a holder without the restore step is not an option for it
    (3, {1: {0: [6]}, 2: {0: [6, 7]}}, None, (7, ("n2:1",), (("n1:1", 1), ("n2:1", 2)))),
    # a peer without the step is not an option; the step all can get wins
    (3, {1: {0: [6, 7]}, 2: {0: [6, 7]}}, {1: [6], 2: [6, 7]}, (6, ("n1:1", "n2:1"), (("n1:1", 1), ("n2:1", 2)))),
    # a 6-rank ring: every holder, but at most SHARED_OPTIONS peers, nearest in ring order
    (6, {1: {0: [6, 7]}, 2: {0: [7]}}, None, (7, ("n1:1", "n2:1"), (("n1:1", 1), ("n2:1", 2), ("n3:1", 3)))),
], ids=["both holders", "holder lacks the step", "peer lacks the step", "peers bounded"])
def test_plan_names_every_option_in_the_order_to_try(n, replicas, snapshots, expected):
    lay, placement, nodes, slots = _ring(n, replicas, snapshots)
    assert placement[0] == [1, 2]
    plan = plan_recovery(lay, nodes, slots, lost_slots={0}, placement=placement, replacements={0: "s"})
    src = plan.fetch[0]
    assert (plan.restore_step, src.private, src.shared) == expected
    assert len(src.shared) <= SHARED_OPTIONS


def test_a_restore_source_round_trips_the_wire_and_refuses_malformed_ones():
    import json
    src = RankSource(private=("h:1", "h:2"), shared=(("h:3", 4),))
    assert RankSource.from_wire(json.loads(json.dumps(src.to_wire()))) == src
    for bad, error in [({"private": "h:1", "shared": []}, "private"), ({"private": ["h:1"], "shared": [["h:3"]]}, "shared"),
                       ({"private": ["h:1"], "shared": [["h:3", -1]]}, "shared"), ([], "object"),
                       ({"private": [], "shared": [["h:3", 1]]}, "at least one")]:
        with pytest.raises(ValueError, match=error):
            RankSource.from_wire(bad)


def test_plan_local_reset_needs_no_fetch():
    lay, placement, nodes, slots = _cluster()
    plan = plan_recovery(lay, nodes, slots, lost_slots=set(), placement=placement, replacements={})
    assert plan.restore_step == 7 and plan.fetch == {}


def test_plan_refuses_without_spare_or_common_step():
    lay, placement, nodes, slots = _cluster()
    with pytest.raises(PlanError, match="no spare"):
        plan_recovery(lay, nodes, slots, {1}, placement, {})
    nodes["c"].replicas = {1: [5]}                                    # replica too old for the survivors
    with pytest.raises(PlanError, match="no snapshot step"):
        plan_recovery(lay, nodes, slots, {1}, placement, {1: "s"})


def test_plan_refuses_when_owner_and_holders_lost():
    lay, placement, nodes, slots = _cluster()
    nodes["s2"] = node("s2", Role.SPARE)
    with pytest.raises(PlanError, match="replica holder"):
        plan_recovery(lay, nodes, slots, {1, 2}, placement, {1: "s", 2: "s2"})


def test_attempt_ranks_reads_gloo_keys_of_the_default_group():
    from phoenixrun.control.decide import attempt_ranks
    keys = ["default_pg/0//cpu//0/0", "default_pg/0//cpu//0/2", "/default_pg/0//cpu//0/1", "init/",
            "default_pg/0//cpu//0/9", "other/3"]
    assert attempt_ranks(keys, 4) == {0, 1, 2}
    assert attempt_ranks([], 4) == set()


def test_admit_gives_a_node_its_node_rank_whatever_the_order():
    free, taken = FreeSlots(2), {}
    assert admit(False, free, taken, node_rank=1, nnodes=2) == (Role.ACTIVE, 1)
    taken[1] = "b"
    assert admit(False, free, taken, node_rank=1, nnodes=2) == (Role.FAILED, None)   # rank taken: refused
    assert admit(False, free, taken) == (Role.ACTIVE, 0)           # no rank given: the lowest free slot
    assert admit(False, free, taken, node_rank=2, nnodes=2) == (Role.SPARE, None)   # beyond nnodes: a spare
    assert admit(True, FreeSlots(2), {}, node_rank=0, nnodes=2) == (Role.SPARE, None)   # after the start
