"""Collectives whose waits an abort ends, whatever gloo does with the op itself.

Gloo has no call that ends a wait on a collective already enqueued: ProcessGroupGloo implements no abort() and its
collective Work none either (only send/recv Work do). Shutting a generation's sockets down fails most such ops
within milliseconds, but not all: in `benchmarks/detection.py --faults comm-timeout` (3 of 9 trials on
2026-12-07) a survivor's training thread sat in gloo's Work::wait - once in DDP's backward (its gradient bucket),
once in ZeroRedundancyOptimizer's parameter broadcast, with no connection of the process left but gloo's
listener - until the agent's quiesce grace (5 s) killed it and its rank restarted from the node's snapshot.

So every collective of CPU tensors that a group forwards returns an `AbortableWork`: its own future, completed
with the backend's result, or failed with DistBackendError by `InFlight.fail` (the generation's abort), whichever
comes first (a "gate" future that is completed once, with either outcome, and a `then` that raises for a failure:
see `_settle`). A wait on it - `work.wait()` in Python, DDP's reducer at the end of backward, a functional
collective's wait_tensor - then raises at once, which the step treats as any collective error. The gloo op itself
stays where it is, on the aborted generation (kept referenced until exit: generations.py).

Ops of CUDA tensors are not wrapped: their future is CUDA-aware (a wait orders the caller's stream after the
collective's), a CPU future would not be, and NCCL's abort ends those waits itself.
"""
from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Work


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
    """A collective's Work whose future is ours: completed by the backend's, or failed by `InFlight.fail`.
    C++ callers (DDP's reducer, functional collectives) reach `wait` and `get_future` through torch's PyWork
    trampoline; the other methods serve Python callers, who get the backend's own exception (or
    DistBackendError) back, not the callback error that C++ callers see."""

    def __init__(self, inner: Work, gate: torch.futures.Future[Outcome]):
        super().__init__()
        self.inner = inner       # the backend's Work, kept alive while its op runs
        self.gate = gate
        self.fut: torch.futures.Future[Any] = gate.then(_settle)

    def wait(self, timeout: object = None) -> bool:
        # the backend's own timeout (the generation's collective timeout) still ends the op: it then fails the gate
        kind, payload = self.gate.wait()
        if kind == "error":
            raise payload
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        return self.fut

    def is_completed(self) -> bool:
        return self.gate.done()

    def is_success(self) -> bool:
        return self.gate.done() and self.gate.value()[0] == "ok"

    def exception(self) -> BaseException | None:
        if not self.gate.done() or self.gate.value()[0] == "ok":
            return None
        error: BaseException = self.gate.value()[1]
        return error

    def result(self) -> Any:
        self.wait()
        return self.gate.value()[1]

    def synchronize(self) -> None:
        self.gate.wait()


class InFlight:
    """The collectives of one generation that were issued and have not completed, so that its abort fails their
    waits. Thread-safe: ops complete on gloo's threads, the abort comes from the agent-link thread."""

    def __init__(self, generation: int):
        self.generation = generation
        self._lock = threading.Lock()
        self._pending: set[torch.futures.Future[Outcome]] = set()
        self.aborted = False

    def track(self, work: Work) -> Work:
        """`work` (just issued on this generation's backend) as an AbortableWork; `work` itself where it has no
        future to follow (gloo's reduce-scatter in torch 2.13: "Work::getFuture not implemented")."""
        try:
            inner_fut = work.get_future()
        except RuntimeError:
            return work
        gate: torch.futures.Future[Outcome] = torch.futures.Future()
        tracked = AbortableWork(work, gate)
        with self._lock:
            aborted = self.aborted
            if not aborted:
                self._pending.add(gate)
        if aborted:
            gate.set_result(("error", self._error()))
            return tracked

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

        inner_fut.add_done_callback(completed)
        return tracked

    def fail(self) -> int:
        """Fail every pending op's wait, and every later one's at once. The number failed."""
        with self._lock:
            self.aborted = True
            pending, self._pending = self._pending, set()
        for gate in pending:
            gate.set_result(("error", self._error()))
        return len(pending)

    def _error(self) -> dist.DistBackendError:
        return dist.DistBackendError(f"phoenixrun: generation {self.generation} was aborted with this collective in "
                                     "flight (a peer failed or the master ordered a quiesce)")
