"""Fault vocabulary shared by agents, the master and the classifier (docs/design.md, "Faults: classes and the
three actions"; every signal: docs/fault-model.md).

Everything here is plain data: enums with stable string values (they appear in events.jsonl and on the wire)
and a frozen ``Signal`` that says what was observed, where and when. Deciding what it means is classify.py's job.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, Mapping


class FaultClass(str, Enum):
    """The rows of the PHOENIX paper's Table II (docs/design.md)."""

    TRANSIENT_COMM = "transient_comm"  # cause does not outlive the processes: a local reset clears it
    GPU_MEMORY = "gpu_memory"
    HOST_PCIE = "host_pcie"  # PCIe / host / kernel / reboot
    NETWORK_STORAGE = "network_storage"
    SOFTWARE_UNKNOWN = "software_unknown"  # user bug, numerics, or a fault we cannot name
    # the node's agent vanished (its connections refused) or went silent: the node is gone, why is not known from
    # here (a host crash or reboot, power, a kill, a partition). Not a hardware verdict: nothing named the hardware.
    NODE_LOST = "node_lost"


class Action(str, Enum):
    """What recovery does with the node acted on."""

    LOCAL_RESET = "local_reset"  # restart this node's workers, restore from its own host memory
    NODE_REPLACE = "node_replace"  # hot-swap a spare into the node's logical slot
    EXTERNAL_FALLBACK = "external_fallback"  # never hot-swap: stop cleanly or restart from persistent checkpoint


class SignalKind(str, Enum):
    WORKER_EXIT = "worker_exit"  # code: Popen returncode (negative = killed by that signal number)
    WORKER_HANG = "worker_hang"  # no progress heartbeat past --hang-timeout
    NODE_HEARTBEAT_LOST = "node_heartbeat_lost"  # master: agent silent past --node-timeout, or refuses connections
    NODE_UNREACHABLE = "node_unreachable"  # master: the agent said it leaves (it got SIGTERM, its drain refused)
    XID = "xid"  # code: Xid number
    ECC_UNCORRECTABLE = "ecc_uncorrectable"
    ROW_REMAP_FAILURE = "row_remap_failure"
    GPU_RECOVERY_ACTION = "gpu_recovery_action"  # code: NVML_GPU_RECOVERY_ACTION_* value (non-zero)
    COLLECTIVE_ERROR = "collective_error"  # detail: the exception text seen by the worker
    NAN_LOSS = "nan_loss"
    USER_EXCEPTION = "user_exception"  # detail: the exception text / traceback tail
    NIC_DOWN = "nic_down"
    STORAGE_ERROR = "storage_error"
    SNAPSHOT_SPACE = "snapshot_space"  # detail: the agent cannot create or grow a snapshot slot on this host


# Kinds whose payload lives in ``Signal.code``; for the others ``code`` is optional context.
_NEEDS_CODE = frozenset({SignalKind.WORKER_EXIT, SignalKind.XID, SignalKind.GPU_RECOVERY_ACTION})


@dataclass(frozen=True)
class Signal:
    """One observation that something may be wrong.

    ``node`` is the logical node slot (docs/design.md, "Identity"), not a hostname, so signals survive a hot-swap.
    A clean exit (code 0) and recovery action NONE (0) are not faults and are rejected here, so every
    valid Signal has exactly one classification.
    """

    kind: SignalKind
    node: int | None = None
    rank: int | None = None
    code: int | None = None
    detail: str = ""
    timestamp: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        # Accept the string value too: signals arrive as JSON from agents and `phoenixrun inject`.
        object.__setattr__(self, "kind", SignalKind(self.kind))
        if self.kind in _NEEDS_CODE and self.code is None:
            raise ValueError(f"{self.kind.value} signal needs a code")
        if self.kind is SignalKind.WORKER_EXIT and self.code == 0:
            raise ValueError("worker_exit with code 0 is a clean exit, not a fault")
        if self.kind is SignalKind.GPU_RECOVERY_ACTION and self.code == 0:
            raise ValueError("gpu_recovery_action NONE (0) is not a fault")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["kind"] = self.kind.value
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Signal":
        known = {"kind", "node", "rank", "code", "detail", "timestamp"}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass(frozen=True)
class Classification:
    fault_class: FaultClass
    action: Action
    root_cause: bool  # False: a symptom of a fault elsewhere (e.g. a survivor's collective error)
    reason: str
    # True: a root cause only if nothing better explains it. A hang or an exit without a reason on a survivor is
    # often just a peer dying mid-collective; correlate.py demotes these to symptoms when a definite root cause
    # exists elsewhere in the window.
    ambiguous: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "fault_class": self.fault_class.value,
            "action": self.action.value,
            "root_cause": self.root_cause,
            "reason": self.reason,
            "ambiguous": self.ambiguous,
        }


# The one precedence of actions (larger wins): which action wins when one node reports several signals, and
# which node's decision the master carries out first when an incident acts on several (control/decide.py). A
# hardware verdict beats a user exception on the same node because GPU faults surface in Python as exceptions
# ("CUDA error: ..."). Across nodes each node keeps its own action; any external_fallback then decides the job
# (correlate.py's Correlation.external_fallback), whatever this order says.
ACTION_PRECEDENCE: Mapping[Action, int] = {
    Action.LOCAL_RESET: 0,
    Action.EXTERNAL_FALLBACK: 1,
    Action.NODE_REPLACE: 2,
}
