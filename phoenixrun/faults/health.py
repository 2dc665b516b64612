"""Health sources: where hardware signals enter (docs/fault-model.md, "Signals").

The agent polls every enabled source and forwards the Signals. ``NvmlHealthSource`` reads the real GPU;
``InjectedHealthSource`` lets tests and ``phoenixrun inject`` feed the same Signals on a CPU-only box, so the path
from "Xid seen" to recovery is exercised identically with and without a GPU.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from .classify import XID_INFORMATIONAL
from .taxonomy import Signal, SignalKind

log = logging.getLogger(__name__)


class HealthSource(ABC):
    """A poll-based probe. ``poll`` must return quickly and never raise."""

    name: str = "health"

    @property
    @abstractmethod
    def enabled(self) -> bool: ...

    @abstractmethod
    def poll(self) -> list[Signal]: ...

    def close(self) -> None:
        pass


class InjectedHealthSource(HealthSource):
    """Signals handed in from outside (tests, ``phoenixrun inject``). ``inject`` is thread-safe."""

    def __init__(self, node: int | None = None, name: str = "injected") -> None:
        self.name = name
        self.node = node
        self._lock = threading.Lock()
        self._pending: list[Signal] = []

    @property
    def enabled(self) -> bool:
        return True

    def inject(self, signal: Signal) -> None:
        if signal.node is None and self.node is not None:
            signal = dataclasses.replace(signal, node=self.node)
        with self._lock:
            self._pending.append(signal)

    def poll(self) -> list[Signal]:
        with self._lock:
            out, self._pending = self._pending, []
        return out


@dataclass
class _Gpu:
    index: int
    handle: Any
    ecc_uncorrected: int | None  # volatile count at the last poll; None = not supported, not probed
    remap_probe: bool = True
    remap_failed: bool = False
    remap_pending: bool = False
    recovery_probe: bool = True
    recovery_action: int = 0
    lost: bool = False


class NvmlHealthSource(HealthSource):
    """Xid events, uncorrectable ECC, row-remap failure and the GPU recovery-action field, via pynvml.

    Without pynvml or the NVML library it is disabled (one INFO line) and ``poll`` returns []. Probes a GPU
    does not support are dropped for that GPU at the first NOT_SUPPORTED. Poll from a single thread.
    """

    name = "nvml"

    def __init__(
        self,
        node: int | None = None,
        *,
        device_to_rank: Mapping[int, int] | None = None,
        wait_ms: int = 50,
        max_events_per_poll: int = 64,
    ) -> None:
        self.node = node
        self.device_to_rank = dict(device_to_rank or {})
        self.wait_ms = wait_ms
        self.max_events_per_poll = max_events_per_poll
        self._nvml: Any = None
        self._gpus: list[_Gpu] = []
        self._event_set: Any = None
        self._wait_name = "nvmlEventSetWait_v2"
        self._warned: set[str] = set()
        try:
            import pynvml  # nvidia-ml-py; optional extra `phoenixrun[nvml]`
        except ImportError:
            log.info("NVML health source disabled: pynvml (nvidia-ml-py) is not installed")
            return
        try:
            pynvml.nvmlInit()
        except Exception as e:  # NVMLError_LibraryNotFound / DriverNotLoaded on CPU-only machines
            log.info("NVML health source disabled: %s", e)
            return
        try:
            self._setup(pynvml)
        except Exception as e:
            self._gpus, self._event_set = [], None
            self._shutdown(pynvml)
            log.info("NVML health source disabled: setup failed: %s", e)
            return
        self._nvml = pynvml
        log.info("NVML health source enabled: %d GPU(s), Xid events %s", len(self._gpus),
                 "on" if self._event_set is not None else "off")

    # -- setup ---------------------------------------------------------------------------------------------

    def _setup(self, nv: Any) -> None:
        # One event set for all GPUs: a single nvmlEventSetWait_v2 per poll instead of one wait per GPU, and
        # the event names its device.
        try:
            self._event_set = nv.nvmlEventSetCreate()
        except nv.NVMLError as e:
            log.debug("NVML: no event set (%s); Xid events off", e)
        registered = 0
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            if self._event_set is not None:
                try:
                    nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, self._event_set)
                    registered += 1
                except nv.NVMLError as e:
                    log.debug("NVML: GPU %d cannot report Xid events: %s", i, e)
            try:
                ecc = nv.nvmlDeviceGetTotalEccErrors(h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)
            except nv.NVMLError:
                ecc = None  # ECC off or not supported: only the Xid path reports memory faults
            # Row-remap failure / recovery action start "clear" on purpose: a GPU already in that state when the
            # agent starts is reported on the first poll, so the node is never used.
            self._gpus.append(_Gpu(i, h, ecc))
        if self._event_set is not None and registered == 0:
            self._free_event_set(nv)

    # -- polling -------------------------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self._nvml is not None

    def poll(self) -> list[Signal]:
        if self._nvml is None:
            return []
        out: list[Signal] = []
        try:
            self._poll_events(out)
        except Exception as e:  # never let a probe take the agent down
            self._warn_once("events", "NVML event poll failed: %s", e)
        for g in self._gpus:
            if g.lost:
                continue
            try:
                self._poll_counters(g, out)
            except Exception as e:
                self._warn_once(f"gpu{g.index}", "NVML poll of GPU %d failed: %s", g.index, e)
        return out

    def _signal(self, kind: SignalKind, gpu: int | None, detail: str, code: int | None = None) -> Signal:
        rank = self.device_to_rank.get(gpu) if gpu is not None else None
        prefix = f"gpu {gpu}: " if gpu is not None else ""
        return Signal(kind, node=self.node, rank=rank, code=code, detail=prefix + detail)

    def _event_wait(self, nv: Any, timeout: int) -> Any:
        """nvmlEventSetWait_v2, or the original nvmlEventSetWait where the driver (or the binding) lacks _v2;
        without either, Xid events are turned off (one INFO line; None) and the counters keep being polled."""
        wait = getattr(nv, self._wait_name, None)
        try:
            if wait is None:
                raise AttributeError(self._wait_name)
            return wait(self._event_set, timeout)
        except _absent(nv) as e:
            if self._wait_name == "nvmlEventSetWait_v2" and getattr(nv, "nvmlEventSetWait", None) is not None:
                log.info("NVML: nvmlEventSetWait_v2 unavailable (%s); using nvmlEventSetWait", e)
                self._wait_name = "nvmlEventSetWait"
                return self._event_wait(nv, timeout)
            log.info("NVML: no event wait available (%s); Xid events off", e)
            self._free_event_set(nv)
            return None

    def _poll_events(self, out: list[Signal]) -> None:
        nv = self._nvml
        if self._event_set is None:
            return
        timeout = self.wait_ms
        for _ in range(self.max_events_per_poll):
            if self._event_set is None:
                return
            try:
                data = self._event_wait(nv, timeout)
            except nv.NVMLError_Timeout:
                return
            if data is None:
                return
            timeout = 0  # drain what is already queued without waiting again
            if not data.eventType & nv.nvmlEventTypeXidCriticalError:
                continue
            xid = int(data.eventData)
            try:
                gpu: int | None = nv.nvmlDeviceGetIndex(data.device)
            except nv.NVMLError:
                gpu = None
            if xid in XID_INFORMATIONAL:
                log.info("NVML: GPU %s Xid %d (%s), not a fault", gpu, xid, XID_INFORMATIONAL[xid])
                continue
            out.append(self._signal(SignalKind.XID, gpu, f"Xid {xid}", code=xid))

    def _poll_counters(self, g: _Gpu, out: list[Signal]) -> None:
        """Each probe on its own: one a GPU or driver does not support (NOT_SUPPORTED, or FUNCTION_NOT_FOUND from
        a driver older than the binding) is turned off for that GPU and the others go on."""
        nv = self._nvml
        try:
            if g.ecc_uncorrected is not None:
                try:
                    n = nv.nvmlDeviceGetTotalEccErrors(g.handle, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                       nv.NVML_VOLATILE_ECC)
                except _missing(nv):
                    g.ecc_uncorrected = None   # ECC turned off under us, or never readable: the Xid path remains
                else:
                    if n > g.ecc_uncorrected:
                        out.append(self._signal(SignalKind.ECC_UNCORRECTABLE, g.index,
                                                f"{n - g.ecc_uncorrected} new uncorrectable ECC error(s)"))
                    g.ecc_uncorrected = n
            if g.remap_probe:
                try:
                    _corr, _unc, pending, failure = nv.nvmlDeviceGetRemappedRows(g.handle)
                except _absent(nv):
                    g.remap_probe = False  # pre-Ampere (no row remapper), or a driver without the call
                else:
                    if failure and not g.remap_failed:
                        out.append(self._signal(SignalKind.ROW_REMAP_FAILURE, g.index, "row remapping failed"))
                    if pending and not g.remap_pending:
                        # A remap waiting for a GPU reset: the uncorrectable error that caused it is reported via
                        # ECC/Xid; this is maintenance, not a new fault.
                        log.warning("NVML: GPU %d has a row remap pending (needs a GPU reset when drained)",
                                    g.index)
                    g.remap_failed, g.remap_pending = bool(failure), bool(pending)
            if g.recovery_probe:
                self._poll_recovery_action(g, out)
        except nv.NVMLError as e:
            if getattr(e, "value", None) == nv.NVML_ERROR_GPU_IS_LOST:
                # NVML's "GPU is lost" is the fell-off-the-bus condition: report it as the Xid the kernel logs.
                g.lost = True
                out.append(self._signal(SignalKind.XID, g.index, "NVML reports the GPU is lost", code=79))
                return
            raise

    def _read_recovery_action(self, g: _Gpu) -> int | None:
        """The GPU recovery action field, or None where the binding, driver or GPU does not have it."""
        nv = self._nvml
        field_id = getattr(nv, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)  # newer drivers/bindings only
        if field_id is None:
            return None
        try:
            fv = nv.nvmlDeviceGetFieldValues(g.handle, [field_id])[0]
        except _absent(nv):
            return None
        if fv.nvmlReturn != nv.NVML_SUCCESS:
            return None  # the driver does not know the field
        return _field_value(nv, fv)

    def _poll_recovery_action(self, g: _Gpu, out: list[Signal]) -> None:
        value = self._read_recovery_action(g)
        if value is None:
            g.recovery_probe = False
            return
        if value != g.recovery_action and value != 0:
            out.append(self._signal(SignalKind.GPU_RECOVERY_ACTION, g.index, f"recovery action {value}",
                                    code=value))
        g.recovery_action = value

    def readings(self) -> list[dict[str, Any]]:
        """What each probe reads now, per GPU, without signalling (the GPU check records it; an operator can
        print it): the uncorrectable volatile ECC count, the remapped-rows tuple, the recovery action, and
        whether Xid events are on. A probe the GPU or driver does not support reads "unsupported"."""
        nv = self._nvml
        if nv is None:
            return []
        rows = []
        for g in self._gpus:
            row: dict[str, Any] = {"gpu": g.index, "xid_events": self._event_set is not None}
            try:
                row["ecc_uncorrected"] = nv.nvmlDeviceGetTotalEccErrors(
                    g.handle, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)
            except _absent(nv):
                row["ecc_uncorrected"] = "unsupported"
            try:
                corr, unc, pending, failure = nv.nvmlDeviceGetRemappedRows(g.handle)
                row["remapped_rows"] = {"correctable": corr, "uncorrectable": unc, "pending": bool(pending),
                                        "failure": bool(failure)}
            except _absent(nv):
                row["remapped_rows"] = "unsupported"
            value = self._read_recovery_action(g)
            row["recovery_action"] = "unsupported" if value is None else value
            rows.append(row)
        return rows

    # -- teardown ------------------------------------------------------------------------------------------

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    def _free_event_set(self, nv: Any) -> None:
        if self._event_set is not None:
            try:
                nv.nvmlEventSetFree(self._event_set)
            except Exception:
                pass
            self._event_set = None

    @staticmethod
    def _shutdown(nv: Any) -> None:
        try:
            nv.nvmlShutdown()
        except Exception:
            pass

    def close(self) -> None:
        nv, self._nvml = self._nvml, None
        if nv is not None:
            self._free_event_set(nv)
            self._shutdown(nv)


def _absent(nv: Any) -> tuple[type[BaseException], ...]:
    """A call the binding lacks (AttributeError) or a probe that is not there (see _missing)."""
    return (AttributeError, *_missing(nv))


def _missing(nv: Any) -> tuple[type[BaseException], ...]:
    """pynvml's errors for a probe that is not there: NOT_SUPPORTED (the GPU) and FUNCTION_NOT_FOUND (a driver
    older than the binding); the latter is absent from old bindings."""
    return tuple(c for c in (getattr(nv, "NVMLError_NotSupported", None), getattr(nv, "NVMLError_FunctionNotFound", None))
                 if isinstance(c, type))


def _field_value(nv: Any, fv: Any) -> int:
    """An integer nvmlFieldValue_t, read through the union member its valueType names."""
    member = {
        getattr(nv, "NVML_VALUE_TYPE_UNSIGNED_INT", 1): "uiVal",
        getattr(nv, "NVML_VALUE_TYPE_UNSIGNED_LONG", 2): "ulVal",
        getattr(nv, "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG", 3): "ullVal",
        getattr(nv, "NVML_VALUE_TYPE_SIGNED_LONG_LONG", 4): "sllVal",
        getattr(nv, "NVML_VALUE_TYPE_SIGNED_INT", 5): "siVal",
        getattr(nv, "NVML_VALUE_TYPE_UNSIGNED_SHORT", 6): "usVal",
    }.get(fv.valueType, "uiVal")
    return int(getattr(fv.value, member))


def poll_all(sources: Iterable[HealthSource]) -> list[Signal]:
    """Signals from every enabled source; a source that raises despite the contract is skipped and logged."""
    out: list[Signal] = []
    for src in sources:
        if not src.enabled:
            continue
        try:
            out.extend(src.poll())
        except Exception:
            log.exception("health source %s raised in poll()", src.name)
    return out
