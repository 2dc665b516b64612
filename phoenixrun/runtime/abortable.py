"""Collectives whose waits an abort ends, whatever gloo does with the op itself.

Gloo has no call that ends a wait on a collective already enqueued: ProcessGroupGloo implements no abort() and its
collective Work none either (only send/recv Work do). Shutting a generation's sockets down fails most such ops
within milliseconds, but not all: in `benchmarks/detection.py --faults comm-timeout` (3 of 9 trials on
2026-12-07) a survivor's training thread sat in gloo's Work::wait - once in DDP's backward (its gradient bucket),
once in ZeroRedundancyOptimizer's parameter broadcast, with no connection of the process left but gloo's
listener - until the agent's quiesce grace (5 s) killed it and its rank restarted from the node's snapshot.

So every collective of CPU tensors that a group forwards returns an `AbortableWork`. Its `wait()` (from Python,
or from C++ through torch's PyWork trampoline: a functional collective's wait_tensor) waits on the backend's Work in
ticks of POLL_S and raises DistBackendError once the generation's abort (`InFlight.fail`) came and the op is still
not done; its `get_future()` (DDP's reducer waits on that one) is a future of ours, completed by the backend's or
failed by the abort, whichever comes first. Either way the step treats the error as any collective error. The gloo
op itself stays where it is, on the aborted generation (kept referenced until exit: generations.py).

The success path costs no callback: only a future asked for gets one (a DDP bucket's, one or two per step). A
callback on every op (each one's completion taking the GIL on gloo's thread) cost 247 us per small all-reduce
here, 478 -> 725 us (2 processes, 2000 one-float all-reduces, 6 alternated rounds).

Ops of CUDA tensors are not wrapped: their future is CUDA-aware (a wait orders the caller's stream after the
collective's), a CPU future would not be, and NCCL's abort ends those waits itself.
"""
from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Work

POLL_S = 0.02     # how often a waiting thread looks at the abort: the abort's latency (50 wake-ups a second, waiting)


# What a gate future carries: ("ok", the backend's result) or ("error", the exception to raise).
Outcome = tuple[str, Any]


def _settle(gate: torch.futures.Future[Outcome]) -> Any:
    """The `then` callback between a gate and the future C++ callers wait on. Raising here is the one way Python
    has to fail a torch future natively: `Future.set_exception` completes it *successfully*, its value the
    exception object, which only Python's `value()` raises - DDP's reducer took such a value for its bucket's
    result and read a tensor out of it (SIGSEGV, every rank, measured)."""
    kind, payload = gate.value()
    if kind == "error":
        raise payload
    return payload


class AbortableWork(Work):
    """A collective's Work whose waits end at its generation's abort (the module doc). Python callers get the
    backend's own result or exception, or DistBackendError after the abort."""

    def __init__(self, inner: Work, in_flight: InFlight):
        super().__init__()
        self.inner = inner       # the backend's Work, kept alive while its op runs
        self.in_flight = in_flight
        self._fut: torch.futures.Future[Any] | None = None

    def wait(self, timeout: timedelta | None = None) -> bool:
        deadline = time.monotonic() + timeout.total_seconds() if timeout else None
        while True:
            if self.in_flight.aborted and not self.inner.is_completed():
                raise self.in_flight.error()
            tick = POLL_S if deadline is None else max(0.001, min(POLL_S, deadline - time.monotonic()))
            try:
                return bool(self.inner.wait(timedelta(seconds=tick)))
            except RuntimeError:
                if self.inner.is_completed():
                    # done since: its own outcome (the exception caught may be the tick's "Operation timed out!",
                    # raised just before the op completed - it once ended a healthy step)
                    return bool(self.inner.wait())
                if deadline is not None and time.monotonic() >= deadline:
                    raise                    # the caller's timeout ("Operation timed out!", as the backend's)

    def get_future(self) -> torch.futures.Future[Any]:
        if self._fut is None:
            self._fut = self.in_flight.follow(self.inner.get_future())
        return self._fut

    def is_completed(self) -> bool:
        return bool(self.inner.is_completed()) or self.in_flight.aborted

    def is_success(self) -> bool:
        return self.is_completed() and self.exception() is None

    def exception(self) -> BaseException | None:
        if self.inner.is_completed():
            try:
                self.inner.wait()
            except BaseException as e:
                return e
            return None
        return self.in_flight.error() if self.in_flight.aborted else None

    def result(self) -> Any:
        self.wait()
        return self.inner.result()

    def synchronize(self) -> None:
        self.wait()


class InFlight:
    """One generation's abort as its collectives see it: the flag their waits look at, and the futures asked for
    that are not completed yet, which `fail` fails. Thread-safe: ops complete on gloo's threads, the abort comes
    from the agent-link thread."""

    def __init__(self, generation: int):
        self.generation = generation
        self._lock = threading.Lock()
        self._pending: set[torch.futures.Future[Outcome]] = set()
        self.aborted = False

    def track(self, work: Work) -> Work:
        """`work` (just issued on this generation's backend) as an AbortableWork."""
        return AbortableWork(work, self)

    def follow(self, inner: torch.futures.Future[Any]) -> torch.futures.Future[Any]:
        """A future completed with `inner`'s outcome, or failed by `fail`, whichever comes first (once)."""
        gate: torch.futures.Future[Outcome] = torch.futures.Future()
        with self._lock:
            aborted = self.aborted
            if not aborted:
                self._pending.add(gate)
        if aborted:
            gate.set_result(("error", self.error()))

        def completed(inner: torch.futures.Future[Any]) -> None:   # on a gloo thread (or here, if already done)
            with self._lock:
                mine = gate in self._pending    # else fail() claimed it first
                self._pending.discard(gate)
            if not mine:
                return
            try:
                outcome: Outcome = ("ok", inner.value())
            except BaseException as e:
                outcome = ("error", e)
            gate.set_result(outcome)

        if not aborted:
            inner.add_done_callback(completed)
        return gate.then(_settle)

    def fail(self) -> int:
        """Fail every pending wait, and every later one at once. The number of futures failed."""
        with self._lock:
            self.aborted = True
            pending, self._pending = self._pending, set()
        for gate in pending:
            gate.set_result(("error", self.error()))
        return len(pending)

    def error(self) -> dist.DistBackendError:
        return dist.DistBackendError(f"phoenixrun: generation {self.generation} was aborted with this collective in "
                                     "flight (a peer failed or the master ordered a quiesce)")
