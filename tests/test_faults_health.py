import importlib.util
import logging
import sys
import threading

import pytest

from phoenixrun.faults.classify import classify
from phoenixrun.faults.health import InjectedHealthSource, NvmlHealthSource, poll_all
from phoenixrun.faults.taxonomy import Action, Signal, SignalKind

LOGGER = "phoenixrun.faults.health"
HAS_PYNVML = importlib.util.find_spec("pynvml") is not None


def _nvml_library_present() -> bool:
    if not HAS_PYNVML:
        return False
    import pynvml
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def _assert_disabled_with_one_info_line(src, caplog):
    assert not src.enabled
    assert src.poll() == []
    src.close()
    assert src.poll() == []
    records = [r for r in caplog.records if r.name == LOGGER]
    assert len(records) == 1 and records[0].levelno == logging.INFO
    assert "disabled" in records[0].getMessage()


def test_nvml_disabled_when_pynvml_missing(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    src = NvmlHealthSource(node=0)
    _assert_disabled_with_one_info_line(src, caplog)
    assert "not installed" in caplog.records[0].getMessage()


@pytest.mark.skipif(not HAS_PYNVML, reason="pynvml (nvidia-ml-py) not installed")
@pytest.mark.skipif(_nvml_library_present(), reason="NVML library present (GPU machine)")
def test_nvml_disabled_when_library_missing(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    _assert_disabled_with_one_info_line(NvmlHealthSource(node=0), caplog)


@pytest.mark.gpu
@pytest.mark.skipif(not _nvml_library_present(), reason="needs NVML (a GPU machine)")
def test_nvml_enabled_on_gpu_machine():
    src = NvmlHealthSource(node=3, wait_ms=10)
    try:
        assert src.enabled
        assert src.poll() == []  # a healthy GPU reports nothing
    finally:
        src.close()
    assert not src.enabled


def test_injected_source_feeds_signals_through_classification():
    src = InjectedHealthSource(node=2)
    assert src.enabled and src.poll() == []
    src.inject(Signal(SignalKind.XID, code=79, rank=5))
    src.inject(Signal(SignalKind.ECC_UNCORRECTABLE, node=7))
    got = src.poll()
    assert [s.kind for s in got] == [SignalKind.XID, SignalKind.ECC_UNCORRECTABLE]
    assert [s.node for s in got] == [2, 7]  # the source's node fills in only where the signal has none
    assert got[0].rank == 5
    assert all(classify(s).action is Action.NODE_REPLACE for s in got)
    assert src.poll() == []


def test_injected_source_is_thread_safe():
    src = InjectedHealthSource(node=0)
    drained: list[Signal] = []
    stop = threading.Event()

    def drain():
        while not stop.is_set():
            drained.extend(src.poll())

    def feed(t):
        for i in range(500):
            src.inject(Signal(SignalKind.XID, code=13, rank=t, detail=str(i)))

    reader = threading.Thread(target=drain)
    reader.start()
    feeders = [threading.Thread(target=feed, args=(t,)) for t in range(4)]
    for f in feeders:
        f.start()
    for f in feeders:
        f.join()
    stop.set()
    reader.join()
    drained.extend(src.poll())
    assert len(drained) == 2000
    for t in range(4):  # per-thread order preserved
        assert [s.detail for s in drained if s.rank == t] == [str(i) for i in range(500)]


def test_poll_all_skips_disabled_sources(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    inj = InjectedHealthSource(node=1)
    inj.inject(Signal(SignalKind.NIC_DOWN))
    assert [s.kind for s in poll_all([NvmlHealthSource(), inj])] == [SignalKind.NIC_DOWN]


class FakeNvml:
    """A stand-in for the third-party pynvml module (not our code), so the polling logic runs on a CPU box."""

    class NVMLError(Exception):
        def __init__(self, value):
            super().__init__(f"NVML error {value}")
            self.value = value

    class NVMLError_Timeout(NVMLError):
        def __init__(self):
            FakeNvml.NVMLError.__init__(self, 10)

    class NVMLError_NotSupported(NVMLError):
        def __init__(self):
            FakeNvml.NVMLError.__init__(self, 3)

    NVML_SUCCESS, NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_GPU_IS_LOST = 0, 3, 15
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC = 1, 0
    NVML_VALUE_TYPE_UNSIGNED_INT = 1
    NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230
    nvmlEventTypeXidCriticalError = 0x8

    def __init__(self, ngpus=2):
        self.ecc = [0] * ngpus
        self.remap = [(0, 0, 0, 0)] * ngpus
        self.recovery = [0] * ngpus
        self.lost = [False] * ngpus
        self.events = []  # (gpu, xid)
        self.registered = []
        self.shut = False

    def nvmlInit(self): pass
    def nvmlShutdown(self): self.shut = True
    def nvmlDeviceGetCount(self): return len(self.ecc)
    def nvmlDeviceGetHandleByIndex(self, i): return ("h", i)
    def nvmlDeviceGetIndex(self, h): return h[1]
    def nvmlEventSetCreate(self): return "set"
    def nvmlEventSetFree(self, s): pass
    def nvmlDeviceRegisterEvents(self, h, mask, s): self.registered.append((h[1], mask))

    def nvmlEventSetWait_v2(self, s, timeout_ms):
        if not self.events:
            raise self.NVMLError_Timeout()
        gpu, xid = self.events.pop(0)
        return type("Ev", (), dict(device=("h", gpu), eventType=self.nvmlEventTypeXidCriticalError, eventData=xid))

    def _check(self, h):
        if self.lost[h[1]]:
            raise self.NVMLError(self.NVML_ERROR_GPU_IS_LOST)

    def nvmlDeviceGetTotalEccErrors(self, h, etype, ctype):
        self._check(h)
        return self.ecc[h[1]]

    def nvmlDeviceGetRemappedRows(self, h):
        self._check(h)
        return self.remap[h[1]]

    def nvmlDeviceGetFieldValues(self, h, ids):
        self._check(h)
        value = type("V", (), dict(uiVal=self.recovery[h[1]]))
        return [type("FV", (), dict(nvmlReturn=0, valueType=1, value=value))]


def test_nvml_polling_logic_against_a_fake_library(monkeypatch, caplog):
    nv = FakeNvml(ngpus=2)
    nv.ecc = [5, 0]  # errors from before the agent started are not reported
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    caplog.set_level(logging.INFO, logger=LOGGER)
    src = NvmlHealthSource(node=4, device_to_rank={0: 8, 1: 9}, wait_ms=1)
    assert src.enabled and len(nv.registered) == 2
    assert src.poll() == []

    nv.events += [(1, 45), (0, 79), (1, 31)]  # 45 is informational: logged, not a signal
    nv.ecc[1] = 2
    nv.remap[0] = (0, 1, 0, 1)
    nv.recovery[1] = 2
    got = src.poll()
    assert sorted((s.kind.value, s.code, s.rank) for s in got) == sorted([
        ("xid", 79, 8), ("xid", 31, 9), ("ecc_uncorrectable", None, 9), ("row_remap_failure", None, 8),
        ("gpu_recovery_action", 2, 9)])
    assert all(s.node == 4 for s in got)
    assert src.poll() == []  # edge-triggered: unchanged state reports nothing again

    nv.lost[0] = True
    got = src.poll()
    assert [(s.kind, s.code, s.rank) for s in got] == [(SignalKind.XID, 79, 8)]
    assert src.poll() == []
    src.close()
    assert nv.shut and not src.enabled and src.poll() == []


class OldDriverNvml(FakeNvml):
    """A driver older than the binding, on GPUs without some probes: nvmlEventSetWait_v2 and
    nvmlDeviceGetRemappedRows are FUNCTION_NOT_FOUND, GPU 0 has ECC off (NOT_SUPPORTED), GPU 1 lacks the
    recovery-action field (NOT_SUPPORTED)."""

    class NVMLError_FunctionNotFound(FakeNvml.NVMLError):
        def __init__(self):
            FakeNvml.NVMLError.__init__(self, 13)

    def nvmlEventSetWait_v2(self, s, timeout_ms):
        raise self.NVMLError_FunctionNotFound()

    def nvmlEventSetWait(self, s, timeout_ms):
        return FakeNvml.nvmlEventSetWait_v2(self, s, timeout_ms)

    def nvmlDeviceGetRemappedRows(self, h):
        raise self.NVMLError_FunctionNotFound()

    def nvmlDeviceGetTotalEccErrors(self, h, etype, ctype):
        if h[1] == 0:
            raise self.NVMLError_NotSupported()
        return super().nvmlDeviceGetTotalEccErrors(h, etype, ctype)

    def nvmlDeviceGetFieldValues(self, h, ids):
        if h[1] == 1:
            raise self.NVMLError_NotSupported()
        return super().nvmlDeviceGetFieldValues(h, ids)


def test_nvml_probes_a_driver_lacks_fall_back_one_by_one(monkeypatch, caplog):
    """FUNCTION_NOT_FOUND / NOT_SUPPORTED turn off that probe for that GPU only: the event wait falls back to
    nvmlEventSetWait, a missing remapped-rows call no longer hides the recovery action behind it."""
    nv = OldDriverNvml(ngpus=2)
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    caplog.set_level(logging.INFO, logger=LOGGER)
    src = NvmlHealthSource(node=2, wait_ms=1)
    assert src.enabled and src.poll() == []
    assert any("using nvmlEventSetWait" in r.getMessage() for r in caplog.records)
    assert src.readings() == [
        {"gpu": 0, "xid_events": True, "ecc_uncorrected": "unsupported", "remapped_rows": "unsupported",
         "recovery_action": 0},
        {"gpu": 1, "xid_events": True, "ecc_uncorrected": 0, "remapped_rows": "unsupported",
         "recovery_action": "unsupported"}]

    nv.events.append((1, 48))
    nv.ecc = [7, 1]          # GPU 0's count is unreadable: only GPU 1's is reported
    nv.recovery = [4, 4]     # GPU 1 has no such field: only GPU 0's is reported
    got = sorted((s.kind.value, s.code, s.detail.split(":")[0]) for s in src.poll())
    assert got == [("ecc_uncorrectable", None, "gpu 1"), ("gpu_recovery_action", 4, "gpu 0"), ("xid", 48, "gpu 1")]
    assert src.poll() == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]   # fallbacks are not failures
    src.close()


def test_nvml_without_any_event_wait_keeps_polling_the_counters(monkeypatch, caplog):
    nv = OldDriverNvml(ngpus=1)
    monkeypatch.setattr(OldDriverNvml, "nvmlEventSetWait", None, raising=False)
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    caplog.set_level(logging.INFO, logger=LOGGER)
    src = NvmlHealthSource(node=0, wait_ms=1)
    assert src.poll() == []
    assert any("Xid events off" in r.getMessage() for r in caplog.records)
    assert src.readings()[0]["xid_events"] is False
    nv.recovery = [2]
    assert [(s.kind.value, s.code) for s in src.poll()] == [("gpu_recovery_action", 2)]
    src.close()
