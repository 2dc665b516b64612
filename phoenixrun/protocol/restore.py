"""A restore's sources, defined once: where a rank that lost its memory takes its snapshot from (the master's
plan, carried to the agent in a `restore` directive's `fetch`), and an option the agent refused on the way (a
`restore_refused` report, which the master records as an event).

Every option is one the plan proved right by construction (a replica holder of the rank; a surviving peer
whose shared region holds the same bytes); the agent still verifies what it fetches against the checksums the
lost rank sealed itself, and a mismatch (or an unreachable source) makes it try the next option in order.
Only when every option failed is the restore refused (`restore_failed`).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from phoenixrun.protocol.reports import RestoreRefused


class Part(StrEnum):
    PRIVATE = "private"          # header, metadata and rank-private state: from a replica holder
    SHARED = "shared"            # the shared region (parameters identical on peers): from a peer's own slot


@dataclass(frozen=True, slots=True)
class RankSource:
    """Where a replaced rank gets S_r from, every option in the order to try it."""
    private: tuple[str, ...]                  # peer addresses of the replica holders that have the step
    shared: tuple[tuple[str, int], ...]       # (peer address, rank) of surviving peers that have the step

    def __post_init__(self) -> None:
        if not self.private or not self.shared:
            raise ValueError("a restore source needs at least one replica holder and one peer")

    @property
    def private_addr(self) -> str:
        """The first choice for the private part."""
        return self.private[0]

    @property
    def shared_addr(self) -> str:
        return self.shared[0][0]

    @property
    def shared_rank(self) -> int:
        return self.shared[0][1]

    def to_wire(self) -> dict[str, Any]:
        return {"private": list(self.private), "shared": [[a, r] for a, r in self.shared]}

    @classmethod
    def from_wire(cls, d: Any) -> RankSource:
        """Parse a directive's `fetch[rank]`; ValueError naming what is wrong."""
        if not isinstance(d, dict):
            raise ValueError(f"a restore source must be an object, got {type(d).__name__}")
        private, shared = d.get("private"), d.get("shared")
        if not isinstance(private, list) or not all(isinstance(a, str) and a for a in private):
            raise ValueError(f"restore source: `private` must be a list of peer addresses, got {private!r:.80}")
        if not isinstance(shared, list) or not all(
                isinstance(s, (list, tuple)) and len(s) == 2 and isinstance(s[0], str) and type(s[1]) is int
                and s[1] >= 0 for s in shared):
            raise ValueError(f"restore source: `shared` must be a list of [peer address, rank], got {shared!r:.80}")
        return cls(private=tuple(private), shared=tuple((a, r) for a, r in shared))


@dataclass(frozen=True, slots=True)
class Refusal:
    """One option of a RankSource the agent did not restore from, and why."""
    rank: int                 # the rank being restored
    part: Part
    addr: str                 # the agent asked
    source_rank: int          # whose bytes it offered: `rank` itself (a replica) or the peer's
    reason: str
    integrity: bool           # the bytes failed the lost rank's checksum (False: unreachable, or it had none)

    def to_report(self) -> RestoreRefused:
        """The `restore_refused` report of it."""
        return RestoreRefused(rank=self.rank, part=self.part.value, addr=self.addr, source_rank=self.source_rank,
                              reason=self.reason, integrity=self.integrity)
