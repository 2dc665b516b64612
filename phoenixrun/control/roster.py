"""What the run directory vouches for when agents rejoin a restarted master (RUN_DIR/roster.jsonl).

A master that starts over a run directory whose roster names this run is a *restarted* master (a launcher
restart, a master restarted by hand, a standby that took over): only such a master accepts rejoins, and only as
the roster allows them (control/handlers.py, `_readmit`):

- the node is in the roster and proves it is the agent process that registered: the digest of the `nonce` its
  agent sent with its first registration matches (a random value only that process holds; the digest, never the
  nonce, is written here, and neither is ever served by /v1/state);
- the generation it names is at most the newest any master of this run issued (the roster's `generation` is
  written before a directive carries it, so no agent can legitimately know a newer one);
- an active node names the slot the roster gives it (else it was replaced while the master was down: fenced).

The file is append-only, one JSON object per line, each starting with a newline so that a line cut short by a
killed master stays a line of its own (skipped) instead of spoiling the next. The first line names the run; each
later line carries the writer's lease epoch and what changed since the previous line: `generation` (the newest
issued), `slots` (slot -> node id, null: emptied) and `nonces` (node id -> sha256 of its nonce). Lines of an epoch
older than one already read are a deposed master's, written after a newer one took over: skipped. Writes happen
when the membership or the generation changes (a registration, a new generation's first directive), each O(what
changed), never per heartbeat.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
from pathlib import Path
from typing import Any, TypeVar, overload

from phoenixrun import auth

log = logging.getLogger("phoenixrun.master")
NAME = "roster.jsonl"
_D = TypeVar("_D")


def digest(nonce: str) -> str:
    """What the roster keeps of a node's nonce (the nonce itself never leaves the agent and the master's memory)."""
    return hashlib.sha256(nonce.encode()).hexdigest()


class TrackedSlots(dict[int, str]):
    """slot -> node id, remembering which slots changed since the roster was last written (`changed`). Reads are
    plain dict reads; the few writers (registrations, recoveries, reshapes) pay a Python call."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.changed: set[int] = set(self.keys())

    def __setitem__(self, k: int, v: str) -> None:
        super().__setitem__(k, v)
        self.changed.add(k)

    def __delitem__(self, k: int) -> None:
        super().__delitem__(k)
        self.changed.add(k)

    @overload
    def pop(self, k: int, /) -> str: ...

    @overload
    def pop(self, k: int, default: _D, /) -> str | _D: ...

    def pop(self, k: int, *default: Any) -> Any:
        if k in self:
            self.changed.add(k)
        return super().pop(k, *default)

    def popitem(self) -> tuple[int, str]:
        k, v = super().popitem()
        self.changed.add(k)
        return k, v

    def clear(self) -> None:
        self.changed.update(self.keys())
        super().clear()

    def update(self, *a: Any, **kw: Any) -> None:
        for k, v in dict(*a, **kw).items():
            self[k] = v

    def setdefault(self, k: int, default: str, /) -> str:   # never without a default
        if k not in self:
            self[k] = default
        return self[k]


class Roster:
    """The run directory's roster, as read at this master's start and kept up to date by its own writes."""

    def __init__(self, run_dir: Path, run_id: str):
        self._fd: int | None = None
        self.path = Path(run_dir) / NAME
        self.run_id = run_id
        self.generation = 0
        self.slots: dict[int, str] = {}
        self.nonces: dict[str, str] = {}
        self.epoch = 0
        self.restarted = False        # a previous master of this run wrote it: rejoins may be vouched for
        self._failed = False
        self._load()

    def _load(self) -> None:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            self._start(replace=False)
            return
        except OSError as e:
            log.warning("cannot read %s (%s): rejoins will be refused", self.path, e)
            self._failed = True
            return
        lines = [ln for ln in text.split("\n") if ln.strip()]
        head = _parse(lines[0]) if lines else None
        if head is None or head.get("run_id") != self.run_id:
            # another run's roster (or none readable): nothing of it vouches for this run's agents
            self._start(replace=True)
            return
        for ln in lines[1:]:
            rec = _parse(ln)
            if rec is None:
                continue           # cut short by a killed master
            epoch = rec.get("epoch", 0)
            if not isinstance(epoch, int) or epoch < self.epoch:
                continue           # a deposed master's late write
            self.epoch = epoch
            self._apply(rec)
        self.restarted = bool(self.nonces or self.slots)

    def _start(self, replace: bool) -> None:
        """A roster of this run, empty: created exactly once (if another master created it meanwhile, that one is
        read), or replacing another run's - written whole either way."""
        head = "\n" + json.dumps({"run_id": self.run_id}) + "\n"
        try:
            if replace:
                tmp = self.path.with_name(f".{NAME}.{os.getpid()}.tmp")
                tmp.write_text(head)
                os.chmod(tmp, 0o600)
                os.replace(tmp, self.path)
            elif not auth.create_once(self.path, head):
                self._load()
        except OSError as e:
            log.warning("cannot write %s (%s): a restarted master will refuse this run's rejoins", self.path, e)
            self._failed = True

    def _apply(self, rec: dict[str, Any]) -> None:
        if rec.get("finished"):
            # the job ended: a master started later over this directory runs a new job, nobody rejoins it
            self.generation, self.slots, self.nonces = 0, {}, {}
            return
        g = rec.get("generation")
        if isinstance(g, int):
            self.generation = max(self.generation, g)
        for s, nid in (rec.get("slots") or {}).items():
            try:
                s = int(s)
            except (TypeError, ValueError):
                continue
            if nid is None:
                self.slots.pop(s, None)
            elif isinstance(nid, str):
                self.slots[s] = nid
        for nid, d in (rec.get("nonces") or {}).items():
            if isinstance(d, str):
                self.nonces[nid] = d

    def append(self, epoch: int, generation: int | None = None, slots: dict[int, str | None] | None = None,
               nonces: dict[str, str] | None = None, finished: bool = False) -> None:
        """Record a change (call with the job's lock held): in memory at once, on disk with one write."""
        rec: dict[str, Any] = {"epoch": epoch}
        if finished:
            rec["finished"] = True
        if generation is not None:
            rec["generation"] = generation
        if slots:
            rec["slots"] = {str(s): n for s, n in slots.items()}
        if nonces:
            rec["nonces"] = nonces
        self._apply(rec)
        self.epoch = max(self.epoch, epoch)
        if self._failed:
            return
        try:
            if self._fd is None:      # kept open: a 16K-node job's registrations append one line each
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            os.write(self._fd, ("\n" + json.dumps(rec, separators=(",", ":")) + "\n").encode())
        except OSError as e:
            log.warning("cannot append to %s (%s): a restarted master will refuse this run's rejoins", self.path, e)
            self._failed = True

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    __del__ = close

    def vouches_nonce(self, node_id: str, nonce: str | None) -> bool:
        """Does `nonce` prove the caller is the agent process the roster recorded as `node_id`?"""
        expected = self.nonces.get(node_id)
        return expected is not None and nonce is not None and hmac.compare_digest(expected, digest(nonce))


def _parse(line: str) -> dict[str, Any] | None:
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None
