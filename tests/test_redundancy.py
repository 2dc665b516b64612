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
