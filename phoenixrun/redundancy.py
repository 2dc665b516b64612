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
from typing import Iterable, Mapping

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
