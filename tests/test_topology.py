from hypothesis import given, settings, strategies as st

import pytest

from phoenixrun.topology import Coords, Layout, place_replicas


def test_megatron_order_tp_fastest_then_dp_then_pp():
    lay = Layout(nnodes=2, nproc_per_node=4, tp=2, pp=2)   # world 8, dp 2
    assert lay.dp == 2
    assert [lay.coords(r) for r in range(4)] == [Coords(0, 0, 0), Coords(0, 1, 0), Coords(0, 0, 1), Coords(0, 1, 1)]
    assert lay.coords(4) == Coords(pp=1, tp=0, dp=0)
    assert all(lay.rank_of(lay.coords(r)) == r for r in range(8))


def test_dp_peers_share_tp_pp():
    lay = Layout(nnodes=4, nproc_per_node=2, tp=2, pp=1)
    for r in range(lay.world_size):
        c = lay.coords(r)
        peers = lay.dp_peers(r)
        assert len(peers) == lay.dp - 1 and r not in peers
        assert all((lay.coords(p).tp, lay.coords(p).pp) == (c.tp, c.pp) for p in peers)


def test_bad_layout_is_refused():
    with pytest.raises(ValueError, match="not divisible"):
        Layout(nnodes=3, nproc_per_node=1, tp=2)
    with pytest.raises(ValueError, match="needs at least"):
        place_replicas(Layout(2, 1), k=2)


layouts = st.builds(lambda n, p, tp: Layout(n, p * tp, tp, 1), st.integers(2, 12), st.integers(1, 3),
                    st.sampled_from([1, 2]))


@settings(max_examples=200, deadline=None)
@given(lay=layouts, k=st.integers(1, 3), ndomains=st.integers(1, 6))
def test_placement_properties(lay, k, ndomains):
    k = min(k, lay.nnodes - 1)
    domains = {s: f"rack{s % ndomains}" for s in range(lay.nnodes)}
    plan = place_replicas(lay, k, domains)
    assert plan == place_replicas(lay, k, domains)                  # deterministic
    for rank, holders in plan.items():
        owner = lay.slot_of(rank)
        assert len(holders) == k and len(set(holders)) == k
        assert owner not in holders                                # never on the owner's node
        if ndomains >= k + 1 and lay.nnodes >= ndomains:
            # enough domains: owner and every copy in distinct domains
            assert len({domains[h] for h in holders} | {domains[owner]}) == k + 1


def test_placement_prefers_dp_ring_peers():
    lay = Layout(nnodes=4, nproc_per_node=1)
    assert place_replicas(lay, 1) == {0: [1], 1: [2], 2: [3], 3: [0]}
