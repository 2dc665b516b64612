"""After a recovery, every member's collectives are compared before they run: one issued by some ranks only fails
at once on all of them, naming the op and the call site on each rank, instead of hanging for the collective timeout.

Why: a replacement process runs code a survivor ran long ago (a library's first `next()` that broadcasts its RNG
state, a lazily built helper that all-reduces once). Alone in a collective, it would wait until the collective
timeout, and the survivors' next collective would be paired with it: a hang, or worse, two different ops matched.
Torch's own guard for this (TORCH_DISTRIBUTED_DEBUG=DETAIL's ProcessGroupWrapper) checks every collective of the
run; here only the collectives of the first step after a recovery are checked - the only ones that can differ,
since before it every member ran the same program from the same start.

The check is one all-gather of a fixed-size record (the op, the caller's file:line) on the group's own backend
before the op itself. Point-to-point ops (send/recv: a pipeline's, asymmetric by design) are not checked.
"""
from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import torch
from torch._C._distributed_c10d import Work

import phoenixrun

OP_BYTES, SITE_BYTES = 32, 224
RECORD_BYTES = OP_BYTES + SITE_BYTES
UNCHECKED = frozenset({"send", "recv", "recv_anysource"})   # point to point: asymmetric by design
FROM_CPP = "from C++ (e.g. DDP's gradient reducer)"

def _package_root(package: ModuleType) -> str:
    if package.__file__ is None:
        raise ImportError(f"{package.__name__} is not a regular package")
    return os.path.dirname(package.__file__) + os.sep


_SKIPPED_ROOTS = tuple(_package_root(m) for m in (torch, phoenixrun))


class CollectiveMismatch(RuntimeError):
    """Members of a group issued different collectives in the first step after a recovery."""


@dataclass(frozen=True)
class Issued:
    """One member's collective: the op (its gloo name: aliases compare equal) and where the script issued it."""
    op: str
    site: str


def call_site() -> str:
    """The innermost frame outside torch and phoenixrun - the script's or a library's line that issued the op."""
    f = inspect.currentframe()
    while f is not None:
        name = f.f_code.co_filename
        if not name.startswith(_SKIPPED_ROOTS):
            return f"{name}:{f.f_lineno} in {f.f_code.co_name}"
        f = f.f_back
    return FROM_CPP


def encode(issued: Issued) -> torch.Tensor:
    op = issued.op.encode()[:OP_BYTES].ljust(OP_BYTES, b"\0")
    site = issued.site.encode()
    if len(site) > SITE_BYTES:    # keep the end: the file name and line
        site = b"..." + site[-(SITE_BYTES - 3):]
    return torch.frombuffer(bytearray(op + site.ljust(SITE_BYTES, b"\0")), dtype=torch.uint8).clone()


def decode(record: torch.Tensor) -> Issued:
    raw = bytes(record.tolist())
    return Issued(raw[:OP_BYTES].rstrip(b"\0").decode(errors="replace"),
                  raw[OP_BYTES:].rstrip(b"\0").decode(errors="replace"))


def mismatch(records: list[Issued], members: tuple[int, ...] | None) -> str | None:
    """None when every member issued the same op; else the message each member raises: who issued what, where."""
    if len({r.op for r in records}) <= 1:
        return None
    ranks = members if members is not None else tuple(range(len(records)))
    lines = "; ".join(f"rank {rank}: {r.op} at {r.site}" for rank, r in zip(ranks, records))
    return ("collective mismatch in the first step after a recovery - the ranks of one group issued different "
            f"collectives ({lines}). A collective only some ranks issue (typically one a restored process issues "
            "once at start-up, e.g. a data loader syncing its random state on its first batch) cannot be paired; "
            "issue it on every rank, or move it before phoenixrun.protect(), or keep its result in `state` / "
            "`stateful=` so a restored process does not need it")


class Checks:
    """Whether collectives are compared now: armed when a new generation's groups are attached after a
    recovery, disarmed when the step that follows ends (the same point of every member's sequence of ops)."""

    def __init__(self) -> None:
        self.armed = False

    def arm(self) -> None:
        self.armed = True

    def disarm(self) -> None:
        self.armed = False

    def before(self, backend: object, op: str, size: int, members: tuple[int, ...] | None,
               track: Callable[[Work], Work] = lambda w: w) -> None:
        """Compare `op` across the group (one all-gather on `backend`, its Work through `track`: a wait the
        generation's abort ends); raise CollectiveMismatch on a difference."""
        if not self.armed or op in UNCHECKED or size <= 1:
            return
        mine = encode(Issued(op, call_site()))
        out = [torch.empty_like(mine) for _ in range(size)]
        track(backend.allgather([out], [mine])).wait()  # type: ignore[attr-defined]  # any group backend: by name
        msg = mismatch([decode(t) for t in out], members)
        if msg is not None:
            self.armed = False     # every member raises here; nothing after it is compared
            raise CollectiveMismatch(msg)


CHECKS = Checks()
