"""Redundancy derived from the layout (phoenixrun/redundancy.py): the layouts LLM training uses, as tables, and
the property that matters most - no source ever holds bytes other than the lost rank's - over random meshes."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phoenixrun.redundancy import LayoutError, Mesh, check_flags, private, sources

NONE = frozenset()   # replicated along every dimension


def nodes_of(world: int, per_node: int) -> dict[int, str]:
    return {r: f"n{r // per_node}" for r in range(world)}


def grid(names, shape, ranks=None):
    size = 1
    for n in shape:
        size *= n
    return Mesh(tuple(names), tuple(shape), tuple(ranks if ranks is not None else range(size)))


N8 = nodes_of(8, 2)   # 4 nodes x 2 ranks
# (what, mesh, layout, ranks expected private, sources when node n1 (ranks 2, 3) is lost)
TABLE = [
    ("DDP parameters", grid(["dp"], [8]), NONE, set(), {2: 4, 3: 4}),
    ("ZeRO optimizer shard", grid(["dp"], [8]), frozenset({"dp"}), set(range(8)), {2: None, 3: None}),
    ("FSDP2 full shard", grid(["dp_shard"], [8]), frozenset({"dp_shard"}), set(range(8)), {2: None, 3: None}),
    # HSDP, shard dimension across nodes, replicas in the other half: every shard has a copy elsewhere
    ("HSDP, shard across nodes", grid(["replicate", "shard"], [2, 4]), frozenset({"shard"}), set(), {2: 6, 3: 7}),
    # HSDP with both replicas of a shard on one node: the copy dies with it
    ("HSDP, replicas on one node", grid(["replicate", "shard"], [2, 4], [0, 2, 4, 6, 1, 3, 5, 7]),
     frozenset({"shard"}), set(range(8)), {2: None, 3: None}),
    # TP inside a node, DP across: a TP shard's copy is the same TP coordinate on another node
    ("TP shard", grid(["dp", "tp"], [4, 2]), frozenset({"tp"}), set(), {2: 4, 3: 5}),
    # pipeline stage 0 = ranks 0-3, stage 1 = 4-7: rank 2's copy is a stage-0 rank, never a stage-1 one
    ("PP stage", grid(["pp", "dp"], [2, 4]), frozenset({"pp"}), set(), {2: 0, 3: 0}),
    ("PP stage x ZeRO", grid(["pp", "dp"], [2, 4]), frozenset({"pp", "dp"}), set(range(8)), {2: None, 3: None}),
]


@pytest.mark.parametrize("what,mesh,layout,expect_private,expect_sources", TABLE, ids=[t[0] for t in TABLE])
def test_layouts(what, mesh, layout, expect_private, expect_sources):
    priv = private(mesh, [layout], N8)
    assert {r for r, ls in priv.items() if layout in ls} == expect_private
    got = sources(mesh, [layout], N8, ["n1"])
    assert {r: s[layout] for r, s in got.items()} == expect_sources


def test_pure_pipeline_without_data_parallelism_has_no_peer():
    # 2 stages, one rank each on its own node: stage 1 must never be restored from stage 0
    mesh = grid(["pp"], [2])
    assert sources(mesh, [frozenset({"pp"})], nodes_of(2, 1), ["n1"]) == {1: {frozenset({"pp"}): None}}
    assert private(mesh, [frozenset({"pp"})], nodes_of(2, 1)) == {0: {frozenset({"pp"})}, 1: {frozenset({"pp"})}}


@pytest.mark.parametrize("names,shape,ranks,match", [
    (["dp", "dp"], [2, 2], range(4), "distinct"),
    (["dp"], [4], range(3), "needs 4 distinct ranks"),
    (["dp"], [4], [0, 1, 1, 2], "distinct ranks"),
    (["dp"], [0], [], "empty dimension"),
])
def test_bad_meshes_are_refused(names, shape, ranks, match):
    with pytest.raises(LayoutError, match=match):
        Mesh(tuple(names), tuple(shape), tuple(ranks))


def test_a_placement_over_a_dimension_the_mesh_lacks_is_refused():
    with pytest.raises(LayoutError, match=r"dimension\(s\) \['tp'\]"):
        private(grid(["dp"], [4]), [frozenset({"tp"})], nodes_of(4, 2))


def test_tp_pp_flags_must_agree_with_the_mesh():
    mesh = grid(["pp", "dp", "tp"], [2, 2, 2])
    check_flags(mesh, tp=1, pp=1)      # left out: the mesh says it
    check_flags(mesh, tp=2, pp=2)      # given and consistent
    with pytest.raises(LayoutError, match="--tp 4 contradicts .* size 2"):
        check_flags(mesh, tp=4, pp=1)
    with pytest.raises(LayoutError, match="--pp 2 contradicts .* size 1"):
        check_flags(grid(["dp"], [8]), tp=1, pp=2)


# -- properties, against a brute-force definition of "identical bytes" --------------------------------------

@st.composite
def jobs(draw):
    ndims = draw(st.integers(1, 3))
    shape = [draw(st.integers(1, 4)) for _ in range(ndims)]
    names = [f"d{i}" for i in range(ndims)]
    size = 1
    for n in shape:
        size *= n
    ranks = draw(st.permutations(range(size)))
    per_node = draw(st.sampled_from([d for d in range(1, size + 1) if size % d == 0]))
    node_of = nodes_of(size, per_node)
    layouts = draw(st.lists(st.frozensets(st.sampled_from(names)), min_size=1, max_size=4))
    lost = draw(st.sets(st.sampled_from(sorted(set(node_of.values())))))
    return Mesh(tuple(names), tuple(shape), tuple(ranks)), node_of, layouts, lost


def same_bytes(mesh: Mesh, a: int, b: int, varies) -> bool:
    ca, cb = mesh.coords(a), mesh.coords(b)
    return all(ca[i] == cb[i] for i, n in enumerate(mesh.names) if n in varies)


@settings(max_examples=300, deadline=None)
@given(jobs())
def test_a_source_always_holds_the_lost_ranks_bytes_and_survives(job):
    mesh, node_of, layouts, lost = job
    got = sources(mesh, layouts, node_of, lost)
    assert set(got) == {r for r in mesh.ranks if node_of[r] in lost}
    for rank, by_layout in got.items():
        for v in layouts:
            src = by_layout[v]
            survivors = [r for r in mesh.ranks if node_of[r] not in lost and same_bytes(mesh, rank, r, v)]
            if src is None:
                assert not survivors, f"rank {rank} {set(v)}: {survivors} hold its bytes but none was used"
            else:
                assert src in survivors, f"rank {rank} {set(v)}: source {src} does not hold the same bytes"


@settings(max_examples=300, deadline=None)
@given(jobs())
def test_private_is_exactly_what_one_node_loss_cannot_recover(job):
    mesh, node_of, layouts, _ = job
    priv = private(mesh, layouts, node_of)
    for rank in mesh.ranks:
        after_loss = sources(mesh, layouts, node_of, [node_of[rank]])[rank]
        for v in layouts:
            assert (v in priv[rank]) == (after_loss[v] is None)
            brute = not any(node_of[r] != node_of[rank] and same_bytes(mesh, rank, r, v) for r in mesh.ranks)
            assert (v in priv[rank]) == brute


# ------------------------------------------------------------------ the job-wide peer set (DTensor state shared)
from phoenixrun.redundancy import PeerSet, lacking_copy, peer_set, varies_of  # noqa: E402


@st.composite
def meshes(draw):
    ndims = draw(st.integers(1, 3))
    names = tuple(draw(st.permutations(["a", "b", "c"]))[:ndims])
    shape = tuple(draw(st.lists(st.integers(1, 3), min_size=ndims, max_size=ndims)))
    size = 1
    for n in shape:
        size *= n
    return Mesh(names, shape, tuple(draw(st.permutations(list(range(size))))))


@given(meshes(), st.data())
@settings(max_examples=200, deadline=None)
def test_iter_copies_is_copies_lazily(mesh, data):
    varies = frozenset(data.draw(st.sets(st.sampled_from(mesh.names))))
    for r in mesh.ranks:
        assert list(mesh.iter_copies(r, varies)) == mesh.copies(r, varies)


@pytest.mark.parametrize("dims,placements,expected", [
    (("shard",), ("Shard(dim=0)",), {"shard"}),
    (("replicate", "shard"), ("Replicate()", "Shard(dim=0)"), {"shard"}),
    (("dp", "tp"), ("_StridedShard(dim=0, sf=2)", "Shard(dim=0)"), {"dp", "tp"}),
    (("dp", "tp"), ("Replicate()", "Replicate()"), set()),
])
def test_varies_of_placements(dims, placements, expected):
    assert varies_of(dims, placements) == frozenset(expected)


def test_varies_of_refuses_what_says_nothing_about_copies():
    with pytest.raises(LayoutError, match="Partial"):
        varies_of(("dp",), ("Partial(sum)",))
    with pytest.raises(LayoutError, match="2 placements for a mesh of 1"):
        varies_of(("dp",), ("Shard(dim=0)", "Replicate()"))


HSDP_ACROSS = grid(["replicate", "shard"], [2, 2])      # 2 nodes x 2: shards within a node, replicas across


@pytest.mark.parametrize("what,meshes_,varies,world,per_node,lacking", [
    ("HSDP, shards within a node", [HSDP_ACROSS], [{"shard"}], 4, 2, []),
    ("HSDP, replicas within a node", [grid(["replicate", "shard"], [2, 2], [0, 2, 1, 3])], [{"shard"}], 4, 2,
     [0, 1, 2, 3]),
    ("FSDP2 full shard", [grid(["shard"], [4])], [{"shard"}], 4, 2, [0, 1, 2, 3]),
    ("TP within a node, DP across", [grid(["dp", "tp"], [2, 2])], [{"tp"}, set()], 4, 2, []),
])
def test_peer_set_and_who_lacks_a_copy(what, meshes_, varies, world, per_node, lacking):
    ps = peer_set(meshes_, [frozenset(v) for v in varies], world)
    assert ps is not None and lacking_copy(ps, nodes_of(world, per_node)) == lacking


def test_no_peer_set_for_submeshes_or_several_meshes():
    # a 3-D job's DTensors live on submeshes (other pp coordinates hold other stages): not a peer set
    assert peer_set([grid(["dp", "tp"], [2, 2])], [frozenset({"tp"})], world_size=8) is None
    assert peer_set([grid(["dp"], [4]), grid(["tp"], [4])], [frozenset()], world_size=4) is None


def test_peer_set_wire_is_compact_and_round_trips():
    ps = PeerSet(HSDP_ACROSS, frozenset({"shard"}), plain=True)
    assert ps.to_wire() == {"names": ["replicate", "shard"], "shape": [2, 2], "ranks": None, "varies": ["shard"],
                            "plain": True}
    assert PeerSet.from_wire(ps.to_wire()) == ps
    odd = PeerSet(grid(["dp"], [3], [2, 0, 1]), frozenset())
    assert PeerSet.from_wire(odd.to_wire()) == odd
    for bad, match in [({"names": ["a"], "shape": [2], "varies": ["b"]}, "lacks"),
                       ({"names": ["a"], "shape": [2], "ranks": [0, 0], "varies": []}, "distinct"),
                       ({"names": ["a"], "shape": ["2"], "varies": []}, "integers"),
                       ({"names": ["a"], "shape": [2]}, "needs names, shape and varies")]:
        with pytest.raises(LayoutError, match=match):
            PeerSet.from_wire(bad)


@given(meshes(), st.data())
@settings(max_examples=300, deadline=None)
def test_a_plan_fetches_shared_state_only_from_a_rank_with_identical_bytes(mesh, data):
    """Over random meshes, placements, node maps and lost nodes: every shared region a recovery plan fetches
    comes from a surviving rank whose coordinates agree with the lost rank's on every dimension any of its
    tensors varies along (identical bytes), and a plan is refused only where no such rank survives."""
    from phoenixrun.control.state import NodeRecord, PlanError, Role, plan_recovery
    from phoenixrun.topology import Layout, place_replicas
    world = len(mesh.ranks)
    per_node = data.draw(st.sampled_from([d for d in range(1, world + 1) if world % d == 0]))
    nnodes = world // per_node
    if nnodes < 2:
        return
    layouts = data.draw(st.lists(st.sets(st.sampled_from(mesh.names)).map(frozenset), min_size=1, max_size=3))
    ps = PeerSet(mesh, frozenset().union(*layouts))
    lay = Layout(nnodes, per_node)
    placement = place_replicas(lay, 1)
    lost = set(data.draw(st.sets(st.integers(0, nnodes - 1), min_size=1, max_size=nnodes - 1)))
    nodes = {f"n{s}": NodeRecord(node_id=f"n{s}", host="h", agent_pid=1, peer_addr=f"n{s}:1", fault_domain=f"n{s}",
                                 role=Role.ACTIVE, slot=s,
                                 snapshots={r: [5] for r in lay.ranks_of_slot(s)},
                                 replicas={r: [5] for r in range(world) if s in placement[r]})
             for s in range(nnodes)}
    spares = {s: f"spare{s}" for s in lost}
    for s, nid in spares.items():
        nodes[nid] = NodeRecord(node_id=nid, host="h", agent_pid=1, peer_addr=f"{nid}:1", fault_domain=nid,
                                role=Role.SPARE)
    slots = {s: f"n{s}" for s in range(nnodes)}
    try:
        plan = plan_recovery(lay, nodes, slots, lost, placement, spares, peers=ps)
    except PlanError as e:
        if "data-parallel peer" in str(e):
            r = int(str(e).split()[1].rstrip(":"))
            assert all(lay.slot_of(p) in lost for p in mesh.copies(r, ps.varies)), str(e)
        return
    for r, src in plan.fetch.items():
        assert lay.slot_of(r) in lost and src.shared
        for addr, p in src.shared:
            assert p != r and lay.slot_of(p) not in lost and addr == f"n{lay.slot_of(p)}:1"
            for v in layouts:
                assert mesh.key(p, v) == mesh.key(r, v), (r, p, v)
