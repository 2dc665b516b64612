"""The master's lease: which of two (or more) masters of one job acts, decided without a split brain.

Masters started with `--lease-ttl` share the job's run directory (a file system every node sees). Each epoch of
the job's control plane is claimed by exactly one master: the claim is a file `master-lease/epoch-NNNNNNNN`
created with O_EXCL, so two masters that decide to take over at the same moment cannot both get epoch N. The
holder renews `master-lease/lease.json` (written to a temporary name, then renamed into place) every ttl/3;
a waiting master (the standby) takes over once that record is stale. Safety does not rest on clocks: a master
that sees a claim above its own epoch has lost the lease and stops (`Verdict.LOST`), and the agents ignore
orders of an epoch below the highest they have seen (the epoch travels in every directive and reply). Clocks
only decide when a standby takes over: the record is stale when its renewal time is more than ttl + max_skew
behind this machine's clock, or when this master has seen it unchanged for ttl + max_skew on its own monotonic
clock (which also covers a holder whose clock runs far ahead).

`decide` is the pure decision (table-tested in tests/test_lease.py); `LeaseDir` is the file system edge; `Lease`
the record.
"""
from __future__ import annotations

import enum
import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

LEASE_DIR = "master-lease"
RECORD = "lease.json"
MIN_WAIT_S = 0.05


@dataclass(frozen=True)
class Lease:
    """lease.json: who holds which epoch, where it listens, when it last renewed (its own wall clock)."""
    epoch: int
    holder: str
    endpoint: str
    renewed_at: float
    finished: bool = False            # the holder ended the job: nobody takes over
    exit_code: int | None = None      # the job's, once finished (a standby exits with it)


class Verdict(enum.Enum):
    HOLD = "hold"            # this master holds the lease: act (and renew)
    TAKE_OVER = "take_over"  # nobody holds a live lease: claim the next epoch
    WAIT = "wait"            # another master holds a live lease: look again later
    LOST = "lost"            # this master held an epoch and a newer one was claimed: stop acting now
    DONE = "done"            # the job finished: a waiting master exits


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    wait_s: float = 0.0      # WAIT: how long until the record could be stale
    reason: str = ""


def decide(rec: Lease | None, claimed: int, me: str, my_epoch: int, now: float, unchanged_for: float,
           ttl: float, max_skew: float) -> Decision:
    """What a master does with the lease. Pure.

    rec: lease.json as read (None: none yet); claimed: the highest epoch claimed (0: none); me: this master's id;
    my_epoch: the epoch this master claimed (0: none yet); now: this machine's wall clock; unchanged_for: seconds
    (this machine's monotonic clock) this master has seen the same rec and claimed; ttl: the lease's lifetime;
    max_skew: the clock difference between machines this job tolerates."""
    if rec is not None and rec.finished:
        return Decision(Verdict.DONE, reason=f"epoch {rec.epoch} finished the job")
    if my_epoch:
        if claimed > my_epoch:
            return Decision(Verdict.LOST, reason=f"epoch {claimed} was claimed after this master's {my_epoch}")
        return Decision(Verdict.HOLD)
    limit = ttl + max_skew
    if claimed > (rec.epoch if rec is not None else 0):
        # claimed, not yet written: the claimant is starting (or died between the two: then it stays unchanged)
        if unchanged_for > limit:
            return Decision(Verdict.TAKE_OVER, reason=f"epoch {claimed} was claimed but never renewed")
        return Decision(Verdict.WAIT, max(MIN_WAIT_S, limit - unchanged_for), f"epoch {claimed} is starting")
    if rec is None:
        return Decision(Verdict.TAKE_OVER, reason="no master holds the lease")
    age = now - rec.renewed_at
    if age > limit:
        return Decision(Verdict.TAKE_OVER, reason=f"epoch {rec.epoch} ({rec.endpoint}) last renewed {age:.1f}s ago")
    if unchanged_for > limit:
        return Decision(Verdict.TAKE_OVER,
                        reason=f"epoch {rec.epoch} ({rec.endpoint}) not renewed for {unchanged_for:.1f}s")
    return Decision(Verdict.WAIT, max(MIN_WAIT_S, min(limit - age, limit - unchanged_for)),
                    f"epoch {rec.epoch} held by {rec.holder} at {rec.endpoint}")


def renew_every(ttl: float) -> float:
    """How often the holder renews: three renewals fit in one ttl. Pure."""
    return ttl / 3


def master_id() -> str:
    """This master process's id in the lease: host, pid and start time (unique across restarts)."""
    return f"{socket.gethostname()}-{os.getpid()}-{int(time.time() * 1000) % 10**9}"


class LeaseDir:
    """The lease files under RUN_DIR/master-lease (the file system edge of the lease)."""

    def __init__(self, run_dir: Path):
        self.dir = Path(run_dir) / LEASE_DIR
        self.dir.mkdir(parents=True, exist_ok=True)

    def read(self) -> tuple[Lease | None, int]:
        """(lease.json or None, the highest epoch claimed). A torn or foreign record reads as None."""
        claimed = max((int(p.name[6:]) for p in self.dir.glob("epoch-*") if p.name[6:].isdigit()), default=0)
        try:
            raw = json.loads((self.dir / RECORD).read_text())
            rec = Lease(**{k: raw[k] for k in Lease.__dataclass_fields__ if k in raw})
        except (OSError, ValueError, TypeError):
            rec = None
        return rec, claimed

    def claim(self, epoch: int, me: str, endpoint: str) -> bool:
        """Claim `epoch`: True for exactly one master, whoever creates the file first (O_EXCL)."""
        try:
            fd = os.open(self.dir / f"epoch-{epoch:08d}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump({"holder": me, "endpoint": endpoint, "t": time.time()}, f)
        return True

    def announce(self, me: str, info: dict[str, Any]) -> None:
        """A standby says it waits (`phoenixrun status` lists it): standby-<id>.json, until withdraw()."""
        self._replace(self.dir / f"standby-{me}.json", info)

    def withdraw(self, me: str) -> None:
        (self.dir / f"standby-{me}.json").unlink(missing_ok=True)

    def standbys(self) -> list[dict[str, Any]]:
        """The standbys waiting now (unreadable entries skipped)."""
        out = []
        for p in sorted(self.dir.glob("standby-*.json")):
            try:
                out.append(json.loads(p.read_text()))
            except (OSError, ValueError):
                pass
        return out

    def write(self, rec: Lease) -> None:
        """Replace lease.json atomically (temporary file, fsync, rename): readers see the old or the new."""
        self._replace(self.dir / RECORD, asdict(rec))

    @staticmethod
    def _replace(path: Path, obj: dict[str, Any]) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
