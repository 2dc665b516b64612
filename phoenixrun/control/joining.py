"""What the master says while nodes join, and when it gives up (issue 29: no silence while waiting). Pure.

Until every active slot is filled the master logs, every PROGRESS_EVERY_S, how many nodes joined and what it
waits for; after `--join-timeout` (torchrun's rdzv join_timeout: 600 s by default) it stops the job naming what was
missing. Spares never hold the start (they may join later), so only active slots count toward it.
"""
from __future__ import annotations

from dataclasses import dataclass

PROGRESS_EVERY_S = 10.0
EXIT_JOIN_TIMEOUT = 1     # as torchrun's RendezvousTimeoutError ends the launcher


@dataclass(frozen=True)
class Joining:
    nnodes: int                  # active slots the job needs
    filled: tuple[int, ...]      # slots filled so far
    spares: int                  # spares registered so far
    spares_wanted: int | None    # spares the job admits (None: any number, none awaited)
    waited_s: float
    timeout_s: float             # 0: wait forever


def _ranges(slots: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8' (at most 8 ranges, then '...')."""
    out: list[str] = []
    i = 0
    while i < len(slots):
        j = i
        while j + 1 < len(slots) and slots[j + 1] == slots[j] + 1:
            j += 1
        out.append(str(slots[i]) if i == j else f"{slots[i]}-{slots[j]}")
        i = j + 1
    return ", ".join(out[:8]) + (", ..." if len(out) > 8 else "")


def waiting_for(j: Joining) -> str:
    """'12/64 nodes joined (+0/2 spares); waiting for 52 more: slots 12-63'."""
    filled = set(j.filled)     # once, not per slot: O(nodes^2) held the master's lock for 2-3.5 s every
    missing = [s for s in range(j.nnodes) if s not in filled]   # PROGRESS_EVERY_S at 4K nodes (issue 32)
    spares = f" (+{j.spares}/{j.spares_wanted} spares)" if j.spares_wanted else (
        f" (+{j.spares} spares)" if j.spares else "")
    head = f"{len(j.filled)}/{j.nnodes} nodes joined{spares}"
    if not missing:
        return head
    return f"{head}; waiting for {len(missing)} more: slot{'s' if len(missing) > 1 else ''} {_ranges(missing)}"


def progress_line(j: Joining) -> str:
    left = f", giving up in {max(0.0, j.timeout_s - j.waited_s):.0f}s (--join-timeout)" if j.timeout_s else ""
    return f"{waiting_for(j)} after {j.waited_s:.0f}s{left}"


def gave_up(j: Joining) -> str | None:
    """The job's end reason once the join timeout passed with active slots unfilled; None: keep waiting."""
    if not j.timeout_s or j.waited_s < j.timeout_s or len(set(j.filled)) >= j.nnodes:
        return None
    return (f"gave up waiting for nodes after --join-timeout {j.timeout_s:g}s: {waiting_for(j)} (is every node "
            f"started, with the same --rdzv-endpoint, and can it reach the master? their agents' logs say why not)")
