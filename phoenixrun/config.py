"""Every setting of a phoenixrun job, defined once: validated frozen dataclasses with one doc per field.

- `MasterConfig`: the job as the master runs it (size, layout, recovery policy, persistence).
- `AgentConfig`: one node's agent.

Torch-free and side-effect free: the master imports it (`import phoenixrun.control.master` pulls no torch).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # the agent's worker spec: agents/workers.py (psutil), only a type here
    from phoenixrun.agents.workers import WorkerSpec


@dataclass(frozen=True)
class MasterConfig:
    run_dir: Path
    nnodes: int
    nproc_per_node: int
    run_id: str = "phoenixrun"
    tp: int = 1
    pp: int = 1
    replicas: int = 1
    max_restarts: int = 0
    host: str = "127.0.0.1"
    port: int = 0
    store_port: int = 0
    node_timeout: float = 5.0
    spare_wait: float = 30.0
    recovery_timeout: float = 60.0
    correlation_window: float = 0.5
    max_local_resets: int = 3
    fault_domains: dict[int, str] = field(default_factory=dict)
    persist_dir: Path | None = None    # persistent checkpoints (written by the agents); None: none
    persist_every: int = 0
    persist_keep: int = 2
    max_fallbacks: int = 3             # restarts from a persistent checkpoint before giving up
    spares: int | None = None          # spare nodes admitted at a time (None: any number)


@dataclass(frozen=True)
class AgentConfig:
    endpoint: str                  # master host:port
    secret: str
    spec: WorkerSpec
    nproc_per_node: int
    host: str = "127.0.0.1"        # address peers and workers use to reach this node
    fault_domain: str = ""
    heartbeat_interval: float = 0.5
    log_dir: Path | None = None
    tee: bool = True
    node_id: str = ""
    # a worker with no progress this long (outside recovery) is hung. 20, as the CLI (`phoenixrun` and
    # `phoenixrun agent --hang-timeout`) and docs/cli.md have always said; this class said 30, unused by the CLI
    hang_timeout: float = 20.0
    node_rank: int | None = None   # the slot this node asks for (torchrun's --node-rank); None: any
    local_ranks_filter: frozenset[int] | None = None   # local ranks whose output reaches the console (None: all)
    shutdown_timeout: float = 2.0  # SIGTERM -> SIGKILL grace when workers are stopped
