"""Signal -> (fault class, action): the PHOENIX paper's Table II as a pure, table-tested function.

The classes and actions: docs/design.md, "Faults: classes and the three actions"; every row and the reasoning
behind it: docs/fault-model.md.
"""
from __future__ import annotations

import signal as _signal
from typing import Iterable, Mapping

from .taxonomy import Action, Classification, FaultClass, Signal, SignalKind

DEFAULT_MAX_LOCAL_RESETS = 3
# Signals closer together than this are one incident (several ranks of a node die within milliseconds of each
# other); a local reset plus resume takes longer than this, so separate incidents do not merge.
DEFAULT_INCIDENT_GAP_S = 2.0

XID_GPU_MEMORY: Mapping[int, str] = {
    48: "double-bit ECC error",
    64: "ECC page retirement / row remap failure",
    95: "uncontained ECC error",
}
XID_HOST_PCIE: Mapping[int, str] = {
    79: "GPU has fallen off the bus",
    119: "GSP RPC timeout",
    120: "GSP error",
}
# Contained to the faulting context: the GPU is usable again once the processes using it exit, so a local reset
# is enough - unless it keeps happening, which points at the hardware.
XID_CONTAINED: Mapping[int, str] = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    94: "contained ECC error",
}
# Reported by the driver but not faults in themselves; health sources drop these instead of emitting a Signal
# (classified, they would be "unknown Xid" and stop the job). 45 in particular follows every worker we kill.
XID_INFORMATIONAL: Mapping[int, str] = {
    45: "preemptive cleanup after a process was killed",
    63: "ECC page retirement / row remap recorded",
    92: "high single-bit ECC error rate (corrected)",
}

# Substrings (case-insensitive) of exception texts that mean "a collective failed". They are what survivors see
# when a peer dies, so they are symptoms, never a root cause.
# The NCCL ones are ProcessGroupNCCL's own texts (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp, NCCLUtils.cpp):
# the watchdog's timeout and the message it logs before acting on any failed work, blocking wait's timeout, the
# exception an aborted communicator raises at its next use (what a survivor sees after the watchdog, with
# TORCH_NCCL_ASYNC_ERROR_HANDLING=2, or phoenixrun's quiesce aborted it), the watchdog thread's own exit and the
# heartbeat monitor's kill of a stuck watchdog; tests/test_faults_classify.py holds them verbatim.
COLLECTIVE_ERROR_PATTERNS: tuple[str, ...] = (
    # NCCL / ProcessGroupNCCL
    "Watchdog caught collective operation timeout",
    "Some NCCL operations have failed or timed out",
    "timed out in blocking wait",
    "Process group watchdog thread terminated with exception",
    "ProcessGroupNCCL's watchdog got stuck",
    "NCCL error",
    "ncclInternalError",
    "ncclSystemError",
    "ncclRemoteError",
    "NCCL communicator was aborted",
    "DistBackendError",
    "DistNetworkError",
    # gloo / TCPStore
    "Connection reset by peer",
    "Connection closed by peer",
    "Timed out waiting",
    # gloo's unbound_buffer.cc: when one op's wait passes the group's timeout, gloo fails every other op pending on
    # the context with this (a ZeRO rank's list of broadcasts once ended on it as a "user exception", the job exit 1)
    "Application timeout caused pair closure",
    "Read error",
    "Broken pipe",
    "timed out",
)
# cudaErrorECCUncorrectable's message: the GPU, not the user's code, failed.
GPU_ECC_ERROR_PATTERNS: tuple[str, ...] = ("uncorrectable ECC error encountered",)
# A CUDA error in the rank's own context ("CUDA error: an illegal memory access was encountered"). ProcessGroupNCCL's
# watchdog reports one as "Process group watchdog thread terminated with exception: CUDA error: ..." (a
# DistBackendError), but it is this rank's fault, not a peer's death: never a collective symptom. NCCL's own
# "unhandled cuda error" has no colon after "cuda error" and stays a collective error.
CUDA_ERROR_PATTERNS: tuple[str, ...] = ("CUDA error:",)

# nvml.h nvmlDeviceGpuRecoveryAction_t; hard-coded because pynvml may be absent where signals are classified.
GPU_RECOVERY_ACTION_NAMES: Mapping[int, str] = {
    1: "gpu_reset",
    2: "node_reboot",
    3: "drain_p2p",
    4: "drain_and_reset",
    5: "recover_imex_domain",
    6: "bus_reset",
    7: "system_reboot",
}


def _matches(text: str, patterns: Iterable[str]) -> bool:
    low = text.lower()
    return any(p.lower() in low for p in patterns)


def is_collective_error_text(text: str) -> bool:
    """A collective failed, and not because of this rank's own GPU (a CUDA error or ECC error it names)."""
    return _matches(text, COLLECTIVE_ERROR_PATTERNS) and not is_gpu_error_text(text)


def is_gpu_error_text(text: str) -> bool:
    """The text names a CUDA error of this rank's context (an uncorrectable ECC error among them)."""
    return _matches(text, CUDA_ERROR_PATTERNS) or _matches(text, GPU_ECC_ERROR_PATTERNS)


def collective_cause(exc: BaseException | None, kinds: tuple[type, ...] = ()) -> BaseException | None:
    """The collective failure `exc` is or was raised from (an exception of `kinds`, or a RuntimeError whose text
    is a collective error), walking `raise ... from` and implicit chaining; None if it has none. Libraries wrap
    them: torch.distributed.pipelining re-raises a neighbour's closed connection as
    `RuntimeError("[Stage 1] failed to run forward ...") from e`."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, kinds) or (isinstance(exc, RuntimeError) and is_collective_error_text(str(exc))):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def exit_signal_number(code: int) -> int | None:
    """The signal that killed a worker, from a Popen returncode (-N) or a shell wrapper's 128+N; else None."""
    if code < 0:
        return -code
    if 128 < code < 128 + 65:
        return code - 128
    return None


def _signal_name(num: int) -> str:
    try:
        return _signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _c(fc: FaultClass, action: Action, reason: str, *, root_cause: bool = True,
       ambiguous: bool = False) -> Classification:
    return Classification(fc, action, root_cause, reason, ambiguous)


_COMM_SYMPTOM = (FaultClass.TRANSIENT_COMM, Action.LOCAL_RESET)


def _classify_text(text: str, what: str, *, ambiguous_if_empty: bool) -> Classification:
    """An exception/exit text: comm error (symptom), GPU ECC (hardware), a CUDA error or else the user's code."""
    if is_collective_error_text(text):
        return _c(*_COMM_SYMPTOM, f"{what}: collective error", root_cause=False)
    if _matches(text, GPU_ECC_ERROR_PATTERNS):
        return _c(FaultClass.GPU_MEMORY, Action.NODE_REPLACE, f"{what}: uncorrectable ECC error reported by CUDA")
    if _matches(text, CUDA_ERROR_PATTERNS):
        # the rank's own kernel (or its GPU) failed: a replacement would run the same kernels
        return _c(FaultClass.SOFTWARE_UNKNOWN, Action.EXTERNAL_FALLBACK, f"{what}: CUDA error in this rank's context")
    if not text.strip():
        return _c(FaultClass.SOFTWARE_UNKNOWN, Action.EXTERNAL_FALLBACK, f"{what} with no exception text",
                  ambiguous=ambiguous_if_empty)
    return _c(FaultClass.SOFTWARE_UNKNOWN, Action.EXTERNAL_FALLBACK, f"{what}: exception in user code")


def _base(sig: Signal) -> Classification:
    """The table, without history."""
    k = sig.kind
    if k is SignalKind.WORKER_EXIT:
        assert sig.code is not None
        num = exit_signal_number(sig.code)
        if num is not None:
            if sig.detail and is_collective_error_text(sig.detail):  # e.g. NCCL watchdog's SIGABRT
                return _c(*_COMM_SYMPTOM, f"worker killed by {_signal_name(num)} after a collective error",
                          root_cause=False)
            # The process died but the node is healthy (agent alive, host memory intact): restart its workers
            # from local memory. Covers OOM-killer SIGKILL, native crashes (SIGSEGV/SIGBUS/SIGABRT), stray SIGTERM.
            return _c(FaultClass.TRANSIENT_COMM, Action.LOCAL_RESET, f"worker killed by {_signal_name(num)}")
        # A non-zero exit code is Python's way of saying "uncaught exception": the text decides what it was.
        # Without text it may be a survivor whose collective raised, hence ambiguous.
        return _classify_text(sig.detail, f"worker exited with code {sig.code}", ambiguous_if_empty=True)
    if k is SignalKind.WORKER_HANG:
        # Definite: the agent reports a hang only when the worker's own process did not answer its liveness
        # question (agents/watchdog.py), and has killed it. A peer blocked on it answers and is never reported.
        # (When the watchdog went by progress messages alone, a hung rank and the peers blocked on it looked
        # alike, and the master waited out the correlation window on every hang: 0.5 s of each hang's 3.5 s
        # fault -> training at --hang-timeout 3, measured 2026-12-07, docs/benchmarks.md.)
        return _c(FaultClass.TRANSIENT_COMM, Action.LOCAL_RESET, "worker did not answer past the hang timeout")
    if k is SignalKind.NODE_HEARTBEAT_LOST:
        # The agent is gone (its peer port refuses) or silent: that is all the master knows. A dead host, a
        # kill, a reboot and a partition look alike from here, so the class says so instead of guessing at
        # hardware (docs/fault-model.md, "The table"); the detail says what was seen.
        return _c(FaultClass.NODE_LOST, Action.NODE_REPLACE,
                  f"node lost, cause unknown: {sig.detail}" if sig.detail else "node lost, cause unknown")
    if k is SignalKind.NODE_UNREACHABLE:
        # the agent said it leaves (SIGTERM with its drain refused): its slot needs a spare all the same
        return _c(FaultClass.NODE_LOST, Action.NODE_REPLACE, f"node left: {sig.detail}" if sig.detail else "node left")
    if k is SignalKind.XID:
        x = sig.code
        assert x is not None
        if x in XID_GPU_MEMORY:
            return _c(FaultClass.GPU_MEMORY, Action.NODE_REPLACE, f"Xid {x}: {XID_GPU_MEMORY[x]}")
        if x in XID_HOST_PCIE:
            return _c(FaultClass.HOST_PCIE, Action.NODE_REPLACE, f"Xid {x}: {XID_HOST_PCIE[x]}")
        if x in XID_CONTAINED:
            return _c(FaultClass.GPU_MEMORY, Action.LOCAL_RESET, f"Xid {x}: {XID_CONTAINED[x]}")
        return _c(FaultClass.SOFTWARE_UNKNOWN, Action.EXTERNAL_FALLBACK, f"Xid {x}: unknown Xid")
    if k is SignalKind.ECC_UNCORRECTABLE:
        return _c(FaultClass.GPU_MEMORY, Action.NODE_REPLACE, "uncorrectable ECC error")
    if k is SignalKind.ROW_REMAP_FAILURE:
        return _c(FaultClass.GPU_MEMORY, Action.NODE_REPLACE, "row remap failure")
    if k is SignalKind.GPU_RECOVERY_ACTION:
        assert sig.code is not None
        # Every non-NONE value asks for a GPU reset, a drain or a reboot: none can happen under a running job.
        name = GPU_RECOVERY_ACTION_NAMES.get(sig.code, f"value {sig.code}")
        return _c(FaultClass.HOST_PCIE, Action.NODE_REPLACE, f"driver asks for GPU recovery action {name}")
    if k is SignalKind.COLLECTIVE_ERROR:
        if sig.detail and is_gpu_error_text(sig.detail):
            # the worker took it for a collective failure (NCCL's watchdog raised it as a DistBackendError), but it
            # names a CUDA error of its own context: classified by that, as the same text in any exception
            return _classify_text(sig.detail, "collective error", ambiguous_if_empty=False)
        return _c(*_COMM_SYMPTOM, "collective error", root_cause=False)
    if k is SignalKind.NAN_LOSS:
        return _c(FaultClass.SOFTWARE_UNKNOWN, Action.EXTERNAL_FALLBACK, "non-finite loss")
    if k is SignalKind.USER_EXCEPTION:
        return _classify_text(sig.detail, "user exception", ambiguous_if_empty=False)
    if k is SignalKind.NIC_DOWN:
        return _c(FaultClass.NETWORK_STORAGE, Action.NODE_REPLACE, "NIC down")
    if k is SignalKind.STORAGE_ERROR:
        return _c(FaultClass.NETWORK_STORAGE, Action.NODE_REPLACE, "storage error")
    if k is SignalKind.SNAPSHOT_SPACE:
        # The host cannot hold the rank's snapshot any more (shared memory full). Not transient - a local reset
        # would fail the same way at the same step - and a spare would fill up alike as the state keeps
        # growing: restart from a persistent checkpoint, else stop with the agent's message (size, room, remedy).
        return _c(FaultClass.HOST_PCIE, Action.EXTERNAL_FALLBACK,
                  f"snapshot memory exhausted: {sig.detail}" if sig.detail else "snapshot memory exhausted")
    raise AssertionError(f"unhandled signal kind {k!r}")  # SignalKind is closed; a new kind must be added here


def count_incidents(timestamps: Iterable[float], gap_s: float = DEFAULT_INCIDENT_GAP_S) -> int:
    """Number of clusters of timestamps, a new cluster starting after a gap longer than ``gap_s``."""
    n, last = 0, None
    for t in sorted(timestamps):
        if last is None or t - last > gap_s:
            n += 1
        last = t
    return n


def classify(
    signal: Signal,
    history: Iterable[Signal] = (),
    *,
    max_local_resets: int = DEFAULT_MAX_LOCAL_RESETS,
    incident_gap_s: float = DEFAULT_INCIDENT_GAP_S,
) -> Classification:
    """Classify one signal; ``history`` holds earlier signals of the same node (any order, others ignored).

    A signal whose table action is local_reset escalates to node_replace when the node already had
    ``max_local_resets`` earlier local-reset incidents: the "transient" fault keeps coming back, so the node is
    suspect. Signals within ``incident_gap_s`` of each other count as one incident, and those within
    ``incident_gap_s`` of ``signal`` belong to the current incident, not to the past.
    """
    base = _base(signal)
    if base.action is not Action.LOCAL_RESET:
        return base
    past = [
        h.timestamp
        for h in history
        if (h.node is None or signal.node is None or h.node == signal.node)
        and h.timestamp < signal.timestamp - incident_gap_s
        and _base(h).action is Action.LOCAL_RESET
    ]
    repeats = count_incidents(past, incident_gap_s)
    if repeats < max_local_resets:
        return base
    return Classification(
        base.fault_class,
        Action.NODE_REPLACE,
        base.root_cause,
        f"{base.reason}; escalated after {repeats} earlier local resets (limit {max_local_resets})",
        base.ambiguous,
    )
