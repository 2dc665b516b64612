"""Generations of the reconfigurable groups' backends (runtime/process_group.py): each recovery rendezvouses a
fresh one on the new generation's store prefix, over the same membership.

Gloo offers no call that unblocks an op stuck on a dead or hung peer; shutting down the
generation's own TCP sockets does (within milliseconds), and the waits it does not end (an op enqueued as the
connections went down) the generation's `InFlight` fails (runtime/abortable.py). A generation notes the sockets
its own creation calls open (the store client, the backends' pairs) and `abort()` shuts those down (never
gloo's listening socket: that aborts the process); a socket the script opens itself is left alone.

A generation is one object behind a small interface (`Generation`: create over a membership, abort from
any thread while work may hang, destroy when idle), driven by one lifecycle (`Generations`) whatever the
backend: `GlooGeneration` (the CPU path, the default) and `NcclGeneration` (`PHOENIXRUN_BACKEND=nccl`: a
ProcessGroupNCCL per group per generation for CUDA tensors, aborted with ProcessGroupNCCL.abort(); torchft's
ProcessGroupNCCL wrapper likewise aborts and recreates the communicator on reconfiguration).
"""
from __future__ import annotations

import logging
import os
import socket
import threading
from abc import ABC, abstractmethod
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence, TypeVar

import torch
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, Store, TCPStore

from phoenixrun.runtime.abortable import InFlight

if TYPE_CHECKING:   # torch's CUDA build only: imported where it is built (make_nccl_backend)
    from torch._C._distributed_c10d import ProcessGroupNCCL

log = logging.getLogger("phoenixrun.runtime")
T = TypeVar("T")


def socket_inodes() -> dict[str, int]:
    out: dict[str, int] = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            out.setdefault(target, int(fd))
    return out


class Generation(ABC):
    """One generation of every group's backend, over one membership: a fresh rendezvous on its own store prefix.

    The lifecycle (driven by `Generations`, the same for every backend):
      - create: `__init__` does no I/O (it only notes the sockets that exist before it); `open()` connects the store
        and builds the world's backend, `subgroup_backend()` one per group the script created;
      - abort(): from any thread, while work of this generation may hang (a dead or hung peer): every op of it fails
        or returns now, and nothing is freed - the training thread may still be inside one of its calls;
      - destroy(): only when idle (no op of it can be in flight): the backends are released.
    `destroy_after_abort` says whether an aborted generation counts as idle once the training thread has left it
    (it is rebuilding): NCCL's yes (ncclCommAbort already tore the communicators down), gloo's no (below).
    """

    kind = ""
    destroy_after_abort = False

    def __init__(self, master_addr: str, master_port: int, rank: int, world_size: int, generation: int,
                 timeout: timedelta, store_prefix: str | None = None):
        self.generation = generation
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.master_addr, self.master_port = master_addr, master_port
        # the master's per-generation prefix (generation fencing); the plain one for an agent that sends none
        self.prefix_name = store_prefix or f"/phoenixrun/gen{generation}/"
        # the sockets this generation made (its store client, its backends' pairs): abort() shuts down these, and
        # while a creation is under way every socket since it began (`_creating`: a rendezvous may block inside
        # it). Not every socket since the generation began: the script's own, opened later (a logger's
        # connection, a data loader's), were shut down at every recovery.
        self.owned: set[str] = set()
        self._creating: set[str] | None = None
        self._own_lock = threading.Lock()
        self.in_flight = InFlight(generation)    # its collectives' waits, which abort() fails (abortable.py)
        self.aborted = False
        self.destroyed = False
        self.store: TCPStore | None = None
        self.prefix: PrefixStore | None = None
        self.backend: Backend | None = None
        self.subgroups: list[Backend] = []

    def open(self) -> "Generation":
        """Connect the store and build the world's backend (blocks until every member has joined)."""
        self.store = self._owning(lambda: TCPStore(self.master_addr, self.master_port, self.world_size,
                                                   is_master=False, timeout=self.timeout, use_libuv=True))
        self._check_aborted()
        self.prefix = PrefixStore(self.prefix_name, self.store)
        prefix = self.prefix
        self.backend = self._owning(lambda: self._make(prefix, self.rank, self.world_size))
        self._check_aborted()
        return self

    def _owning(self, create: Callable[[], T]) -> T:
        """create(), the sockets it opened noted as this generation's (any thread's, while it runs)."""
        with self._own_lock:
            self._creating = set(socket_inodes())
        try:
            return create()
        finally:
            with self._own_lock:
                if self._creating is not None:
                    self.owned |= set(socket_inodes()) - self._creating
                self._creating = None

    def subgroup_backend(self, name: str, group_rank: int, group_size: int) -> Backend:
        """A backend for one subgroup of this generation (a rendezvous among its members only)."""
        if self.prefix is None:
            raise RuntimeError(f"phoenixrun: generation {self.generation} is not open (or destroyed): "
                               f"no backend for group {name}")
        prefix = PrefixStore(f"group/{name}/", self.prefix)
        b = self._owning(lambda: self._make(prefix, group_rank, group_size))
        self.subgroups.append(b)
        self._check_aborted()
        return b

    def _check_aborted(self) -> None:
        # abort() may run on another thread while this generation is still being built: stop building it
        if self.aborted:
            raise RuntimeError(f"phoenixrun: generation {self.generation} was aborted while it was being created")

    def abort(self) -> int:
        """Make every op of this generation fail or return now, from any thread; frees nothing. Returns the number
        of sockets shut down."""
        self.aborted = True
        for b in [self.backend, *self.subgroups]:
            if b is not None:
                self._abort_backend(b)
        # the store's sockets (a rendezvous blocked on a dead member) and, for gloo, the backends' own pairs
        with self._own_lock:
            since = self._creating
            owned = set(self.owned)
        n = shut_sockets(owned) + (abort_sockets_since(since | owned) if since is not None else 0)
        # then the waits of ops the shutdown did not fail (one enqueued as the connections went down: abortable.py)
        self.in_flight.fail()
        return n

    def destroy(self) -> None:
        """Release the backends. Only when idle: no op of this generation may be in flight."""
        if self.destroyed:
            return
        self.destroyed = True
        for b in [*self.subgroups, self.backend]:
            if b is not None:
                self._destroy_backend(b)
        self.subgroups = []
        self.backend = None
        self.prefix = None
        self.store = None

    # the backend-specific part
    @abstractmethod
    def _make(self, store: Store, rank: int, size: int) -> Backend: ...

    def _abort_backend(self, backend: Backend) -> None:
        """Backend-specific abort, on top of shutting down the generation's sockets."""

    def _destroy_backend(self, backend: Backend) -> None:
        """Backend-specific release (after this the generation drops its reference)."""


class GlooGeneration(Generation):
    """The CPU path: one ProcessGroupGloo per group. Gloo offers no call that unblocks an op stuck on a dead or
    hung peer; shutting down the generation's own TCP sockets does (within milliseconds), so abort() is the
    socket shutdown and the failing of the waits left (`InFlight.fail`). An aborted generation is kept referenced
    until the process exits: destroying a gloo backend whose peers vanished mid-collective is not a path torch
    makes safe."""

    kind = "gloo"
    destroy_after_abort = False

    def _make(self, store: Store, rank: int, size: int) -> Backend:
        return ProcessGroupGloo(store, rank, size, self.timeout)


def nccl_env(environ: Mapping[str, str], timeout_s: float) -> tuple[dict[str, str], list[str]]:
    """The ProcessGroupNCCL environment a generation needs (the variables to set, and a warning per user setting
    overridden), from the current environment. Pure: table-tested in tests/test_generations.py.

    - TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (CleanUpOnly): on a timed-out or failed collective the watchdog aborts
      the communicators and the process lives on; the next op raises DistBackendError ("NCCL communicator was
      aborted ..."), which the step treats as any collective error. Torch's default, 3 (SkipCleanUp), and 1
      (TearDown) take the whole process down: every survivor of a peer's death would die with it, turning a hot
      swap into a restart of every node. 0 (NoHandling) is kept if the user asks for it: phoenixrun aborts the
      generation itself on a quiesce.
    - TORCH_NCCL_BLOCKING_WAIT=0: keep the watchdog and asynchronous work. Blocking wait removes the watchdog and
      makes every work.wait() a CPU poll (10 ms), which serialises DDP's overlap of all-reduce and backward; the
      quiesce path aborts the generation from the agent-link thread instead. A user's 1 is kept (it is safe, only
      slower).
    - TORCH_NCCL_NONBLOCKING_TIMEOUT=the collective timeout: communicators are created non-blocking (so that
      ncclCommAbort can interrupt one still connecting to a dead peer), and this bounds waiting for one; unset it
      is 30 min (torchft sets it for the same reason).
    The collective timeout itself (PHOENIXRUN_COLLECTIVE_TIMEOUT) is the backend's Options timeout, as gloo's.
    """
    out: dict[str, str] = {}
    warnings: list[str] = []
    aeh = environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", environ.get("NCCL_ASYNC_ERROR_HANDLING"))
    if aeh not in ("0", "2"):
        if aeh is not None:
            warnings.append(f"TORCH_NCCL_ASYNC_ERROR_HANDLING={aeh} would take the process down on a peer's failure; "
                            "phoenixrun sets 2 (abort the communicators, keep the process)")
        out["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
    if environ.get("TORCH_NCCL_BLOCKING_WAIT", environ.get("NCCL_BLOCKING_WAIT")) is None:
        out["TORCH_NCCL_BLOCKING_WAIT"] = "0"
    if "TORCH_NCCL_NONBLOCKING_TIMEOUT" not in environ:
        out["TORCH_NCCL_NONBLOCKING_TIMEOUT"] = str(int(max(1, timeout_s)))
    return out, warnings


class DeviceRouted:
    """One group's backend pair in an NCCL generation: CUDA tensors go to NCCL, everything else (CPU tensors, the
    object collectives' CPU buffers, barriers) to gloo - what torch's "cpu:gloo,cuda:nccl" default group does.
    protect() and adaptive protection issue small CPU collectives; NCCL takes only device tensors."""

    def __init__(self, gloo: ProcessGroupGloo, nccl: ProcessGroupNCCL):
        self.gloo, self.nccl = gloo, nccl

    @staticmethod
    def on_cuda(args: Sequence[object]) -> bool | None:
        """Whether the first tensor in `args` (nested lists included) is on a GPU; None: no tensor at all."""
        for a in args:
            if isinstance(a, torch.Tensor):
                return a.is_cuda
            if isinstance(a, (list, tuple)):
                for x in a:
                    found = DeviceRouted.on_cuda([x])
                    if found is not None:
                        return found
        return None

    def __getattr__(self, name: str) -> Callable[..., Any]:   # torch's ops: their arguments and works
        gloo_fn, nccl_fn = getattr(self.gloo, name, None), getattr(self.nccl, name, None)
        if gloo_fn is None and nccl_fn is None:
            raise AttributeError(name)

        def call(*args: Any, **kwargs: Any) -> Any:
            fn = nccl_fn if self.on_cuda(args) else gloo_fn
            if fn is None:
                raise RuntimeError(f"phoenixrun: {name} is not available for these tensors' device")
            return fn(*args, **kwargs)
        return call


def nccl_device() -> torch.device:
    """The worker's GPU: LOCAL_RANK's (as torchrun scripts assume), made the current device. Scripts usually call
    torch.cuda.set_device after init_process_group, but the first generation is built inside phoenixrun.init():
    without this every local rank would build its communicator on GPU 0."""
    index = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def make_nccl_backend(store: Store, rank: int, size: int, timeout: timedelta) -> ProcessGroupNCCL:
    """A real ProcessGroupNCCL over `store` (torch's CUDA build only), non-blocking, connected eagerly to the
    worker's device so that the rendezvous happens now (at the rebuild) and not in the first collective."""
    from torch.distributed import ProcessGroupNCCL
    opts = ProcessGroupNCCL.Options()
    opts.config.blocking = 0
    backend = ProcessGroupNCCL(store, rank, size, opts)
    try:
        backend.set_timeout(timeout)  # every work's timeout: the watchdog aborts a collective hung this long
    except RuntimeError as e:         # a torch whose NCCL backend lacks it: torch's default (10 min) applies
        log.warning("phoenixrun: NCCL work timeout left at torch's default: %s", e)
    backend.eager_connect_single_device(nccl_device())
    return backend


class NcclGeneration(Generation):
    """One ProcessGroupNCCL per group per generation (CUDA tensors), next to a gloo backend for CPU tensors
    (`DeviceRouted`). abort() calls ProcessGroupNCCL.abort() (ncclCommAbort: kernels waiting on a dead peer
    return, the stream unblocks; the communicator is unusable and later ops raise DistBackendError) and shuts
    down the generation's sockets (its store, the gloo side). Shrinking (`dist.shrink_group`) does not fit: the
    membership never shrinks, a spare takes the lost ranks, so each generation is a fresh communicator over the
    new membership. Once aborted, a generation is destroyed as soon as the training thread rebuilds."""

    kind = "nccl"
    destroy_after_abort = True
    make_nccl = staticmethod(make_nccl_backend)   # tests on CPU replace this call (and only this one)

    def __init__(self, master_addr: str, master_port: int, rank: int, world_size: int, generation: int,
                 timeout: timedelta, store_prefix: str | None = None):
        super().__init__(master_addr, master_port, rank, world_size, generation, timeout, store_prefix)
        env, warnings = nccl_env(os.environ, self.timeout.total_seconds())
        for w in warnings:
            log.warning("phoenixrun: %s", w)
        os.environ.update(env)     # read by ProcessGroupNCCL's constructor

    def _make(self, store: Store, rank: int, size: int) -> Backend:
        gloo = ProcessGroupGloo(PrefixStore("cpu/", store), rank, size, self.timeout)
        return DeviceRouted(gloo, self.make_nccl(PrefixStore("cuda/", store), rank, size, self.timeout))

    def _abort_backend(self, backend: Backend) -> None:
        if not isinstance(backend, DeviceRouted):   # never: _make builds only these
            return
        try:
            backend.nccl.abort()
        except Exception as e:   # an already aborted or failed communicator: the point is reached either way
            log.info("phoenixrun: NCCL abort of generation %d: %s", self.generation, e)

    def _destroy_backend(self, backend: Backend) -> None:
        if not isinstance(backend, DeviceRouted):   # never: _make builds only these
            return
        try:
            backend.nccl.shutdown()
        except Exception as e:
            log.info("phoenixrun: NCCL shutdown of generation %d: %s", self.generation, e)


# a generation's backend of one group: what the group's collectives are forwarded to (process_group.py)
Backend = ProcessGroupGloo | DeviceRouted

GENERATION_KINDS: dict[str, type[Generation]] = {"gloo": GlooGeneration, "nccl": NcclGeneration}


def generation_kind(name: str) -> type[Generation]:
    """The generation class for PHOENIXRUN_BACKEND (gloo, the default; nccl)."""
    try:
        return GENERATION_KINDS[name]
    except KeyError:
        raise ValueError(f"phoenixrun: PHOENIXRUN_BACKEND={name!r} is not a backend phoenixrun rebuilds; "
                         f"use one of {', '.join(GENERATION_KINDS)}") from None


class Registry(Protocol):
    """The groups a generation's backends are attached to (process_group.GroupRegistry)."""

    def attach(self, gen: Generation | None) -> None: ...


class Generations:
    """The lifecycle of a worker's generations, the same for every backend: connect the next over the current
    membership (the previous one aborted if it was not yet, then destroyed or kept until exit), abort the current
    one from any thread, destroy them all at exit."""

    def __init__(self, kind: type[Generation], master_addr: str, master_port: int, rank: int, world_size: int,
                 timeout: timedelta, registry: Registry):
        self.kind = kind
        self.master_addr, self.master_port = master_addr, master_port
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.registry = registry
        self.current: Generation | None = None
        self.pending: Generation | None = None     # being created (its rendezvous may block)
        self.retired: list[Generation] = []        # aborted, kept referenced until exit (gloo)
        self._baseline: set[str] = set(socket_inodes())
        self._lock = threading.Lock()

    def abort(self) -> int:
        """Any thread: make whatever the training thread is blocked in (an op, a rendezvous) fail now."""
        with self._lock:
            gen = self.pending or self.current
        if gen is not None:
            return gen.abort()
        return abort_sockets_since(self._baseline)

    def connect(self, generation: int, store_prefix: str | None = None) -> Generation:
        """Rendezvous generation `generation` (blocks until the whole membership has joined) and point every group
        at it. A failure raises: in the world's rendezvous it leaves no current generation (collectives then
        complete locally), in a subgroup's the new generation current."""
        self.registry.attach(None)
        with self._lock:
            prev, self.current = self.current, None
        if prev is not None:
            self.retire(prev)
        gen = self.kind(self.master_addr, self.master_port, self.rank, self.world_size, generation, self.timeout,
                        store_prefix)
        with self._lock:
            self.pending = gen
        try:
            gen.open()
        except BaseException:
            self.retire(gen)
            raise
        finally:
            with self._lock:
                self.pending = None
        with self._lock:
            self.current = gen
        self._baseline = set(socket_inodes())
        # the world, then every subgroup the script created, in creation order; a failure here (a member lost while
        # the subgroups meet) leaves `gen` current, as the runtime always had it: the next quiesce aborts it
        self.registry.attach(gen)
        return gen

    def retire(self, gen: Generation) -> None:
        if not gen.aborted:
            gen.abort()
        if gen.destroy_after_abort:
            gen.destroy()
        else:
            self.retired.append(gen)

    def close(self) -> None:
        """At exit, idle: detach every group and destroy every generation, oldest first."""
        self.registry.attach(None)
        for gen in [*self.retired, self.current]:
            if gen is not None:
                gen.destroy()
        self.retired, self.current = [], None


def abort_sockets_since(baseline: set[str]) -> int:
    """Shut down every connected socket of this process not in `baseline` (listening ones are left: shutting
    gloo's down aborts the process). The number shut down."""
    return _shut(lambda inode: inode not in baseline)


def shut_sockets(inodes: set[str]) -> int:
    """Shut down the connected sockets among `inodes` still open in this process. The number shut down."""
    return _shut(lambda inode: inode in inodes)


def _shut(which: Callable[[str], bool]) -> int:
    n = 0
    for inode, fd in socket_inodes().items():
        if not which(inode):
            continue
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                continue
            s.shutdown(socket.SHUT_RDWR)
            n += 1
        except OSError:
            pass
        finally:
            s.close()
    return n
