"""Which backend carries the workers' CUDA tensors, and the one line that says so at start (issue 29).

The workers' rebuilt process groups use gloo unless PHOENIXRUN_BACKEND=nccl (runtime/generations.py). On a GPU
node that default moved CUDA tensors over gloo without a word; now the launcher (and `phoenixrun agent`) prints
one line naming the backend and why whenever a CUDA device is visible or the variable is set. gloo stays the
default: the NCCL path has not run on a GPU yet (docs/api.md, "GPU": `tools/gpu_check.sh` is the check).

`choose` is pure (the CUDA device count is injected); `visible_cuda_devices` is the side effect, cheap enough for a
launcher that does not import torch: torch's count when torch is already imported, else the NVIDIA device files
that CUDA_VISIBLE_DEVICES leaves visible.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

BACKENDS = ("gloo", "nccl")
ENV = "PHOENIXRUN_BACKEND"
# set by the launcher for the agents it starts: the line was printed once already (not once per agent)
ANNOUNCED_ENV = "PHOENIXRUN_BACKEND_ANNOUNCED"
VERIFY = 'the NCCL path is unverified until tools/gpu_check.sh has run on a GPU (docs/api.md, "GPU")'


@dataclass(frozen=True)
class BackendChoice:
    backend: str | None        # gloo or nccl; None with an error
    line: str | None           # what the console says at start; None: nothing to say (no CUDA, the default)
    error: str | None = None   # a usage error (exit 2): a backend phoenixrun does not rebuild


def choose(env_value: str | None, cuda_devices: int) -> BackendChoice:
    """The backend for CUDA tensors given $PHOENIXRUN_BACKEND (None or "": unset) and the CUDA devices visible
    here, with the line to print. Pure."""
    name = (env_value or "").strip()
    if name and name not in BACKENDS:
        return BackendChoice(None, None, f"{ENV}={env_value!r} is not a backend phoenixrun rebuilds: use one of "
                                         f"{', '.join(BACKENDS)} (or leave it unset: gloo)")
    devices = f"{cuda_devices} CUDA device{'s' if cuda_devices != 1 else ''} visible"
    if name == "nccl":
        if not cuda_devices:
            return BackendChoice("nccl", f"backend: {ENV}=nccl but no CUDA device is visible here: the workers' NCCL "
                                         "groups will fail to start; unset it (gloo) on a machine without a GPU")
        return BackendChoice("nccl", f"backend: CUDA tensors go over NCCL ({ENV}=nccl; {devices}), CPU tensors over "
                                     f"gloo; {VERIFY}")
    if not cuda_devices:
        return BackendChoice("gloo", None)
    if name == "gloo":
        return BackendChoice("gloo", f"backend: CUDA tensors go over gloo ({ENV}=gloo, as set; {devices}): slower "
                                     f"than NCCL; {ENV}=nccl uses NCCL ({VERIFY})")
    return BackendChoice("gloo", f"backend: {devices}, but CUDA tensors go over gloo: {ENV} is not set and gloo is "
                                 f"the default until NCCL is verified here ({VERIFY}); export {ENV}=nccl for NCCL")


def visible_cuda_devices(env: dict[str, str], dev: Path = Path("/dev")) -> int:
    """The CUDA devices this node's workers would see: torch's count if torch is imported already, else the
    /dev/nvidiaN files, limited by CUDA_VISIBLE_DEVICES ("" or "-1": none)."""
    if "torch" in sys.modules:
        try:
            count: int = sys.modules["torch"].cuda.device_count()
            return count
        except Exception:      # a broken CUDA install: as if none
            return 0
    present = sum(1 for p in dev.glob("nvidia*") if re.fullmatch(r"nvidia\d+", p.name))
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return present
    ids = [v for v in visible.split(",") if v.strip()]
    if not ids or ids[0].strip() == "-1":
        return 0
    return min(present, len(ids))
