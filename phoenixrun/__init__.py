"""phoenixrun: fault-tolerant launcher for PyTorch training (PHOENIX hot-swap).

The worker API is imported lazily so that the launcher (`phoenixrun` CLI, master, agents)
starts without importing torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:   # the types only: importing the runtime would import torch
    from phoenixrun.runtime.api import Context, Job, PassThroughJob

__version__ = "0.1.0"


def init(*args: Any, **kwargs: Any) -> Context:
    from phoenixrun.runtime.api import init as _init
    return _init(*args, **kwargs)


def protect(*args: Any, **kwargs: Any) -> Job | PassThroughJob:
    from phoenixrun.runtime.api import protect as _protect
    return _protect(*args, **kwargs)


def __getattr__(name: str) -> type[Exception]:
    if name == "NonFiniteLoss":   # raised by job.observe_loss() for a NaN/inf loss
        from phoenixrun.runtime.api import NonFiniteLoss
        return NonFiniteLoss
    if name == "ProtectionRefused":   # raised by protect() for state it cannot restore correctly (docs/api.md)
        from phoenixrun.runtime.layout_check import ProtectionRefused
        return ProtectionRefused
    if name == "CollectiveMismatch":   # ranks issued different collectives in the first step after a recovery
        from phoenixrun.runtime.collective_check import CollectiveMismatch
        return CollectiveMismatch
    raise AttributeError(f"module 'phoenixrun' has no attribute {name!r}")
