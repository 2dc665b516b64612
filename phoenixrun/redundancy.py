"""Which state has an identical copy on another node, derived from the script's own layout. Pure, torch-free.

A rank's state is a set of tensors, each laid out over a device mesh (torch's DeviceMesh: named dimensions,
the world rank at every coordinate). Along a mesh dimension a tensor is either *replicated* (every rank on
that dimension holds the same bytes: DDP's parameters over `dp`, HSDP's over `replicate`, a TP shard over
the DP dimension at the same TP coordinate) or it *varies* (each holds its own bytes: FSDP2's `Shard` over
the shard dimension, TP's `Shard` over `tp`, a pipeline stage's weights over `pp`, a ZeRO optimizer shard
over `dp`, anything rank-private such as RNG state over every dimension). Two ranks hold identical bytes of
a tensor exactly when their coordinates agree on every dimension it varies along - nothing else is evidence
of equality, so nothing else may be used to restore from a peer.

The decisions, for a layout, the node each rank lives on, and (on recovery) the nodes lost:
- `private`: per rank, the layouts with no identical copy on another node: these must be replicated to
  `--replicas` holders in other fault domains, since a node loss destroys them;
- `sources`: per rank of a lost node, per layout, a rank on a surviving node that holds the same bytes
  (None: none survives, take the rank's replica).

A layout whose bytes cannot be compared (torch's `Partial`: a pending reduction) is refused by the caller
before it gets here. Tensors are grouped by layout (`Varies`): thousands of parameters share a handful.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Hashable, Iterable, Iterator, Mapping, Sequence

# the mesh dimensions a tensor's bytes vary along (every other dimension replicates it)
Varies = frozenset[str]


class LayoutError(ValueError):
    """The mesh or a placement cannot describe this job; the message says what and what to do."""


@dataclass(frozen=True)
class Mesh:
    """A device mesh: dimension names, sizes, and the world rank at every coordinate (row-major, as the
    `mesh` tensor of torch's DeviceMesh)."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.names) != len(self.shape) or len(set(self.names)) != len(self.names):
            raise LayoutError(f"mesh dimension names {self.names} must be distinct, one per dimension of "
                              f"shape {self.shape}")
        size = 1
        for n in self.shape:
            if n < 1:
                raise LayoutError(f"mesh shape {self.shape} has an empty dimension")
            size *= n
        if size != len(self.ranks) or len(set(self.ranks)) != len(self.ranks):
            raise LayoutError(f"mesh of shape {self.shape} needs {size} distinct ranks, got {len(self.ranks)} "
                              f"({len(set(self.ranks))} distinct)")

    @staticmethod
    def flat(name: str, world_size: int) -> "Mesh":
        """The one-dimensional mesh of a script without one (DDP: every rank a replica of every other)."""
        return Mesh((name,), (world_size,), tuple(range(world_size)))

    @cached_property
    def _coords(self) -> dict[int, tuple[int, ...]]:
        out: dict[int, tuple[int, ...]] = {}
        for index, rank in enumerate(self.ranks):
            c = []
            for n in reversed(self.shape):
                c.append(index % n)
                index //= n
            out[rank] = tuple(reversed(c))
        return out

    def coords(self, rank: int) -> tuple[int, ...]:
        try:
            return self._coords[rank]
        except KeyError:
            raise LayoutError(f"rank {rank} is not in the mesh (ranks {min(self.ranks)}..{max(self.ranks)})")

    def key(self, rank: int, varies: Varies) -> tuple[int, ...]:
        """What identifies `rank`'s bytes of a tensor laid out as `varies`: its coordinates along those
        dimensions. Equal keys, identical bytes."""
        unknown = varies - set(self.names)
        if unknown:
            raise LayoutError(f"placement over mesh dimension(s) {sorted(unknown)}, but the mesh has "
                              f"{list(self.names)}")
        c = self.coords(rank)
        return tuple(c[i] for i, n in enumerate(self.names) if n in varies)

    def groups(self, varies: Varies) -> dict[tuple[int, ...], list[int]]:
        """The ranks holding identical bytes of a tensor laid out as `varies`, by key, in mesh order."""
        out: dict[tuple[int, ...], list[int]] = {}
        for r in self.ranks:
            out.setdefault(self.key(r, varies), []).append(r)
        return out

    def copies(self, rank: int, varies: Varies) -> list[int]:
        """The other ranks holding the same bytes as `rank`, in ring order from `rank` on (so a recovery's
        fetches spread over the holders instead of all hitting the first)."""
        return _ring_after(self.groups(varies)[self.key(rank, varies)], rank)

    def iter_copies(self, rank: int, varies: Varies) -> Iterator[int]:
        """`copies`, lazily and without a pass over the mesh: the coordinates along the dimensions the bytes do
        not vary along, counted on from `rank`'s (mixed radix, mesh order). A recovery plan at 16K nodes asks
        for the first few only."""
        self.key(rank, varies)                      # unknown dimensions are an error, as there
        c = list(self.coords(rank))
        free = [i for i, n in enumerate(self.names) if n not in varies]
        sizes = [self.shape[i] for i in free]
        strides = []
        acc = 1
        for i in reversed(range(len(self.shape))):
            strides.append(acc)
            acc *= self.shape[i]
        strides.reverse()
        count = 1
        for n in sizes:
            count *= n
        start = 0
        for i, n in zip(free, sizes):
            start = start * n + c[i]
        base = sum(c[i] * strides[i] for i in range(len(c)) if i not in free)
        for j in range(1, count):
            k = (start + j) % count
            index = base
            for i, n in zip(reversed(free), reversed(sizes)):
                index += (k % n) * strides[i]
                k //= n
            yield self.ranks[index]


def _ring_after(group: list[int], rank: int) -> list[int]:
    i = group.index(rank)
    return group[i + 1:] + group[:i]


def private(mesh: Mesh, layouts: Iterable[Varies], node_of: Mapping[int, str]) -> dict[int, set[Varies]]:
    """Per rank, the layouts of which no rank on another node holds the same bytes: state a node loss
    destroys unless it is replicated elsewhere. O(ranks x layouts)."""
    out: dict[int, set[Varies]] = {r: set() for r in mesh.ranks}
    for v in set(layouts):
        for group in mesh.groups(v).values():
            if len({node_of[r] for r in group}) == 1:
                for r in group:
                    out[r].add(v)
    return out


def sources(mesh: Mesh, layouts: Iterable[Varies], node_of: Mapping[int, str],
            lost_nodes: Iterable[str]) -> dict[int, dict[Varies, int | None]]:
    """Per rank on a lost node, per layout: the first rank (ring order) on a surviving node holding the same
    bytes, or None when none survives (the rank's replica is then the only source)."""
    lost = set(lost_nodes)
    out: dict[int, dict[Varies, int | None]] = {r: {} for r in mesh.ranks if node_of[r] in lost}
    for v in set(layouts):
        for group in mesh.groups(v).values():
            for r in group:
                if r in out:
                    out[r][v] = next((p for p in _ring_after(group, r) if node_of[p] not in lost), None)
    return out


def check_flags(mesh: Mesh, tp: int, pp: int) -> None:
    """`--tp/--pp` are unnecessary with a mesh; given, they must agree with its `tp`/`pp` dimensions."""
    for flag, value in (("tp", tp), ("pp", pp)):
        size = mesh.shape[mesh.names.index(flag)] if flag in mesh.names else 1
        if value != 1 and value != size:
            raise LayoutError(f"--{flag} {value} contradicts the script's device mesh, whose '{flag}' dimension "
                              f"has size {size}; leave --{flag} out: the mesh says it")


def varies_of(dims: Sequence[str], placements: Sequence[str]) -> Varies:
    """The mesh dimensions a DTensor's bytes vary along, from its placements as layout_check names them: the
    dimensions it is sharded over (`Shard`, FSDP2-over-TP's `_StridedShard`); it is replicated over the others.
    A `Partial` placement has no such answer (refused before this)."""
    if len(dims) != len(placements):
        raise LayoutError(f"{len(placements)} placements for a mesh of {len(dims)} dimensions {list(dims)}")
    bad = [p for p in placements if not p.startswith(("Shard", "_StridedShard", "Replicate"))]
    if bad:
        raise LayoutError(f"placement {bad[0]} says nothing about which ranks hold the same bytes")
    return frozenset(d for d, p in zip(dims, placements) if not p.startswith("Replicate"))


@dataclass(frozen=True)
class PeerSet:
    """Where a rank's DTensor state has identical copies, job-wide: every DTensor of every rank lives on `mesh`
    (the world's), and each varies along dimensions within `varies` (U, the union over the rank's tensors, the
    same on every rank). So any rank whose coordinates agree with `rank`'s on U holds the same bytes of every
    tensor (`Mesh.key`): that is its peer set. What the runtime tells the master once per job, instead of a peer
    list per rank."""
    mesh: Mesh
    varies: Varies
    plain: bool = False      # plain state is in the shared region too: a peer must also be a DP peer of --tp/--pp

    def peers(self, rank: int) -> Iterator[int]:
        """Ranks holding `rank`'s DTensor bytes, ring order from `rank` on, lazily."""
        return self.mesh.iter_copies(rank, self.varies)

    def to_wire(self) -> dict[str, Any]:
        identity = self.mesh.ranks == tuple(range(len(self.mesh.ranks)))
        return {"names": list(self.mesh.names), "shape": list(self.mesh.shape),
                "ranks": None if identity else list(self.mesh.ranks), "varies": sorted(self.varies),
                "plain": self.plain}

    @staticmethod
    def from_wire(d: Mapping[str, Any]) -> "PeerSet":
        """LayoutError naming what is wrong (the master's parser turns it into a refused message)."""
        try:
            names, shape, varies = tuple(d["names"]), tuple(d["shape"]), frozenset(d["varies"])
            ranks = d.get("ranks")
        except (KeyError, TypeError) as e:
            raise LayoutError(f"a peer set needs names, shape and varies ({e})") from None
        if not all(isinstance(n, str) for n in (*names, *varies)) or not all(type(n) is int for n in shape):
            raise LayoutError("a peer set's names and varies are strings, its shape integers")
        size = 1
        for n in shape:
            size *= n
        ranks = tuple(range(size)) if ranks is None else tuple(ranks)
        if not all(type(r) is int for r in ranks):
            raise LayoutError("a peer set's ranks are integers")
        mesh = Mesh(names, shape, ranks)
        if not varies <= set(names):
            raise LayoutError(f"varies {sorted(varies)} names dimensions the mesh {list(names)} lacks")
        plain = d.get("plain", False)
        if type(plain) is not bool:
            raise LayoutError("a peer set's plain is true or false")
        return PeerSet(mesh, varies, plain)


def peer_set(meshes: Sequence[Mesh], varies: Iterable[Varies], world_size: int) -> PeerSet | None:
    """A rank's DTensors as one PeerSet: they must all live on one mesh spanning the world (FSDP2, HSDP, a 2-D
    TP x DP mesh); None otherwise (submeshes: a 3-D job's TP and FSDP meshes, whose other coordinates hold other
    tensors) - its DTensor state then stays rank-private."""
    distinct = set(meshes)
    if len(distinct) != 1:
        return None
    mesh = distinct.pop()
    if sorted(mesh.ranks) != list(range(world_size)):
        return None
    return PeerSet(mesh, frozenset().union(*varies))


def lacking_copy(ps: PeerSet, node_of: Mapping[int, Hashable],
                 also: Callable[[int, int], bool] = lambda rank, peer: True) -> list[int]:
    """The ranks with no peer (for which `also(rank, peer)` holds too) on another node: empty when every rank's
    DTensor state can be taken from a surviving node after any one node's loss."""
    return sorted(r for r in ps.mesh.ranks
                  if not any(node_of[p] != node_of[r] and also(r, p) for p in ps.peers(r)))
