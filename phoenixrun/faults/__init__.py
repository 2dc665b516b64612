"""Fault taxonomy, classification and root-cause correlation (pure), and health sources (NVML, injected)."""
from .classify import classify
from .correlate import Correlation, NodeDecision, Verdict, correlate
from .health import HealthSource, InjectedHealthSource, NvmlHealthSource, poll_all
from .taxonomy import Action, Classification, FaultClass, Signal, SignalKind

__all__ = [
    "Action", "Classification", "Correlation", "FaultClass", "HealthSource", "InjectedHealthSource",
    "NodeDecision", "NvmlHealthSource", "Signal", "SignalKind", "Verdict", "classify", "correlate", "poll_all",
]
