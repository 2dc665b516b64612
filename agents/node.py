"""What this node is in the job, as the master last said it, and whether the agent is stopping.

Shared by the agent's parts (directive executor, worker supervisor, worker-op handlers, replicator, master
link); every change happens under `lock`, one lock for the whole agent (the parts call each other while
holding it, hence re-entrant).
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field, replace

from phoenixrun.protocol.directives import Directive, World
from phoenixrun.protocol.figures import Figures
from phoenixrun.protocol.replies import JobTerms
from phoenixrun.protocol.reshard import WorkerReshard
from phoenixrun.agents.persister import Persister
from phoenixrun.agents.roles import AgentRole, role_move

log = logging.getLogger("phoenixrun.agent")


@dataclass(frozen=True)
class Handover:
    """A shrink or grow's restart on this node (control/reshape.py): the old world's size, which old rank each new
    rank continues, and the old ranks' snapshots this node exported for its new workers (old rank -> (the local
    rank that reads it, its file))."""
    old_world: int
    predecessor: dict[int, int]
    files: dict[int, tuple[int, str]]

    def for_worker(self, rank: int, local_rank: int) -> WorkerReshard:
        """The `reshard` of one new worker's assignment: the images it reads and the old rank it continues."""
        return WorkerReshard(self.old_world, self.predecessor.get(rank),
                             {old: path for old, (reader, path) in self.files.items() if reader == local_rank})


@dataclass(eq=False)
class NodeState:
    node_id: str
    nproc_per_node: int
    lock: threading.RLock = field(default_factory=threading.RLock)
    role: AgentRole = AgentRole.UNKNOWN     # changed only through become() (roles.ROLE_MOVES)
    slot: int | None = None
    generation: int = 0
    store_prefix: str | None = None   # the generation's rendezvous prefix, from the master's directives
    store_port: int | None = None     # a restart attempt's own TCPStore (None: the job's)
    master_host: str = "127.0.0.1"    # the host of the master this node (re)joined last: its TCPStore's
    restart_count: int = 0
    world: World = field(default_factory=lambda: World({}, {}))
    job: JobTerms | None = None      # the job's terms, as the master's reply to our registration gave them
    restore_step: int | None = None
    api: bool = False                  # a worker said hello through the phoenixrun API
    token: str | None = None           # from the master's reply to our registration: our later calls carry it
    protection: dict[int, Figures] = field(default_factory=dict)   # per rank: its figures, for the heartbeat
    persister: Persister | None = None   # with --persist-every, once registered
    reshard: Handover | None = None   # a shrink or grow's restart: what its new workers read

    def become(self, role: AgentRole) -> None:
        """The node's new role; an illegal move raises RoleError (call with the lock held)."""
        self.role = role_move(self.role, role)

    def rank(self, local_rank: int) -> int:
        if self.slot is None:
            raise RuntimeError(f"local rank {local_rank}'s global rank asked before the master gave this node a slot")
        return self.slot * self.nproc_per_node + local_rank

    def reshard_of(self, local_rank: int) -> WorkerReshard | None:
        """The `reshard` part of a new worker's assignment (None: not a shrink or grow's restart)."""
        return None if self.reshard is None else self.reshard.for_worker(self.rank(local_rank), local_rank)

    def local_ranks(self) -> range:
        return range(self.nproc_per_node)

    def terms(self) -> JobTerms:
        if self.job is None:
            raise RuntimeError("the job's terms asked before this node registered with the master")
        return self.job

    def job_store_port(self) -> int:
        return self.store_port or self.terms().store_port

    def store_host(self) -> str:
        """The host of the master whose TCPStore the workers rendezvous on: the one this node (re)joined last."""
        return self.master_host

    def joined(self, terms: JobTerms, master_host: str) -> None:
        """A master admitted our registration or rejoin: the job's terms the first time, after that where its
        TCPStore is (a restarted master's own; call with the lock held)."""
        self.job = terms if self.job is None else replace(self.job, store_port=terms.store_port)
        self.master_host = master_host

    def take_directive(self, d: Directive) -> None:
        """The fields every directive may carry (call with the lock held)."""
        if d.generation is not None:
            self.generation = d.generation
        if d.store_prefix is not None:
            self.store_prefix = d.store_prefix
        if d.own.slot is not None:
            self.slot = d.own.slot
        if d.own.world is not None:
            self.world = d.own.world
        if d.own.nnodes is not None:       # the job shrank or grew (control/reshape.py)
            self.job = replace(self.terms(), nnodes=d.own.nnodes)
        restart_count = getattr(d.order, "restart_count", None)
        if restart_count is not None:
            self.restart_count = restart_count


class Lifecycle:
    """Whether the agent is stopping, and with which exit code."""

    def __init__(self) -> None:
        self.stopped = threading.Event()
        self.exit_code: int | None = None

    def stop(self, exit_code: int | None) -> None:
        self.exit_code = exit_code
        self.stopped.set()

    @property
    def stopping(self) -> bool:
        return self.stopped.is_set()

    def fenced(self, reason: str | None, exit_code: int = 0) -> None:
        """The master says this node was replaced: it must never rejoin. Kill the workers and exit."""
        log.error("%s; killing this node's workers and exiting", reason or "fenced by the master")
        self.stop(exit_code)
