"""A shrink or grow's restart, as it travels: the master's part of one node's restart order (`NodeReshard`, built
by control/reshape.py's plan, carried by directives.Assignment) and the part each new worker gets in its
assignment (`WorkerReshard`, worker_orders.Assign), once its agent has exported the old ranks' snapshots it reads
(agents/executor.py). The worker re-partitions them (runtime/reshard.py).

On the wire rank maps are JSON objects (string keys); decoded here once, int-keyed, and a field of the wrong type is
a ValueError naming it, as for every directive."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from phoenixrun.protocol.codec import int_keys

KINDS = ("shrink", "grow")


def _int(m: Mapping[str, Any], name: str, where: str) -> int:
    v = m.get(name)
    if type(v) is not int or v < 0:
        raise ValueError(f"{where}.{name} must be a non-negative integer, got {v!r}")
    return v


def _rank_map(v: Any, where: str) -> dict[int, int]:
    if v is not None and not isinstance(v, Mapping):
        raise ValueError(f"{where} must be an object of rank -> rank, got {v!r}")
    out = int_keys(v, where)
    for r, p in out.items():
        if type(p) is not int or p < 0:
            raise ValueError(f"{where}[{r}] must be a rank, got {p!r}")
    return out


@dataclass(frozen=True)
class Image:
    """One old rank's snapshot that a node reads: `own` - from its own slots (parameters included), else the
    replica it holds (optimizer shard, RNG, metadata). `reader` is the local rank on that node that reads it."""
    old_rank: int
    own: bool
    reader: int

    def to_wire(self) -> dict[str, Any]:
        return {"old_rank": self.old_rank, "own": self.own, "reader": self.reader}

    @classmethod
    def from_wire(cls, m: Any) -> Image:
        if not isinstance(m, Mapping) or type(m.get("own")) is not bool:
            raise ValueError(f"reshard.images: each image must be {{old_rank, own, reader}}, got {m!r}")
        return cls(_int(m, "old_rank", "reshard.images"), m["own"], _int(m, "reader", "reshard.images"))


@dataclass(frozen=True)
class NodeReshard:
    """What one node's agent does for a shrink or grow: export the old ranks' snapshots of `step` in `images` for
    its new workers; `predecessor`: new rank -> the old rank it continues (this node's new ranks only)."""
    kind: str                                       # "shrink" | "grow"
    old_world: int
    step: int
    images: tuple[Image, ...] = ()
    predecessor: dict[int, int] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {"kind": self.kind, "old_world": self.old_world, "step": self.step,
                "images": [i.to_wire() for i in self.images], "predecessor": self.predecessor}

    @classmethod
    def from_wire(cls, m: Any) -> NodeReshard:
        if not isinstance(m, Mapping) or m.get("kind") not in KINDS:
            raise ValueError(f"reshard must be an object with kind shrink or grow, got {m!r}")
        images = m.get("images") or []
        if not isinstance(images, list):
            raise ValueError(f"reshard.images must be a list, got {images!r}")
        return cls(m["kind"], _int(m, "old_world", "reshard"), _int(m, "step", "reshard"),
                   tuple(Image.from_wire(i) for i in images), _rank_map(m.get("predecessor"), "reshard.predecessor"))


@dataclass(frozen=True)
class WorkerReshard:
    """What one new worker of a shrunk or grown world reads: `images`, old rank -> the file its agent exported
    that rank's snapshot to; `predecessor`: the old rank it continues (parameters, RNG, the script's state), None
    for a rank that continues none (runtime/reshard.py)."""
    old_world: int
    predecessor: int | None = None
    images: dict[int, str] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {"old_world": self.old_world, "predecessor": self.predecessor, "images": self.images}

    @classmethod
    def from_wire(cls, m: Any) -> WorkerReshard:
        if not isinstance(m, Mapping):
            raise ValueError(f"assign.reshard must be an object, got {m!r}")
        pred = m.get("predecessor")
        if pred is not None and (type(pred) is not int or pred < 0):
            raise ValueError(f"assign.reshard.predecessor must be a rank or null, got {pred!r}")
        images = int_keys(m.get("images"), "assign.reshard.images")
        if not all(isinstance(p, str) for p in images.values()):
            raise ValueError(f"assign.reshard.images must map old ranks to file paths, got {images!r}")
        return cls(_int(m, "old_world", "assign.reshard"), pred, images)
