"""Process groups whose backends are replaced in place, generation by generation.

DDP, ZeroRedundancyOptimizer, DeviceMesh and the script itself keep references to the process
groups they were built with. Every group here keeps its members, rank and size fixed (a
replacement node takes the failed node's ranks) and forwards every collective to an inner
backend that recovery swaps for a fresh one on the new generation's store prefix, so the
script's objects survive a node replacement. The default group is the world; each `new_group`
(and so each DeviceMesh dimension) is a real group of its own members with its own backend per
generation (`GroupRegistry`), the same pattern as torchft's reconfigurable ProcessGroup wrappers
(torchft/process_group.py: a stable Python ProcessGroup whose `configure()` swaps the wrapped one).
The generations each group's backend comes from - their rendezvous, abort and release - are runtime/generations.py.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, NoReturn, Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup, Store, Work
from torch._C._distributed_c10d import _create_work_from_future  # type: ignore[attr-defined]  # absent from stubs

from phoenixrun.runtime.abortable import InFlight
from phoenixrun.runtime.collective_check import CHECKS
from phoenixrun.runtime.generations import DeviceRouted, Generation

if TYPE_CHECKING:
    from torch._C._distributed_c10d import _DistributedBackendOptions

BACKEND_NAME = "phoenixrun"


# ProcessGroup method -> the gloo backend's method. The left side is every name torch 2.13 calls on a group:
# from Python (torch.distributed's functions) and from C++ through the pybind11 trampoline (PyProcessGroup.hpp:
# DDP's reducer, functional collectives). The old names stay for callers of the previous spelling.
FORWARDED = {
    "allreduce": "allreduce", "allreduce_coalesced": "allreduce_coalesced", "broadcast": "broadcast",
    "reduce": "reduce", "allgather": "allgather", "allgather_coalesced": "allgather_coalesced",
    "all_gather_single": "_allgather_base", "_allgather_base": "_allgather_base",
    "reduce_scatter": "reduce_scatter", "reduce_scatter_single": "_reduce_scatter_base",
    "_reduce_scatter_base": "_reduce_scatter_base",
    "alltoall": "alltoall", "all_to_all_single": "alltoall_base", "alltoall_base": "alltoall_base",
    "gather": "gather", "scatter": "scatter", "barrier": "barrier", "monitored_barrier": "monitored_barrier",
    "send": "send", "recv": "recv", "recv_anysource": "recv_anysource",
}

# point-to-point ops keep the backend's Work (recv_anysource's source_rank() is on it): the socket shutdown alone
# ends their waits; monitored_barrier's waits are its own (send/recv inside gloo)
NOT_WRAPPED = {"send", "recv", "recv_anysource", "monitored_barrier"}

# coalesced ops (lists of tensors) -> the single-tensor gloo op they are decomposed into
COALESCED = {
    "all_gather_single_coalesced": "_allgather_base", "allgather_into_tensor_coalesced": "_allgather_base",
    "reduce_scatter_single_coalesced": "_reduce_scatter_base",
    "reduce_scatter_tensor_coalesced": "_reduce_scatter_base",
}

# Group-level calls that would hand out a group or backend outliving the generation: a clear error, never a
# stale object (a stale backend's shut sockets would read as a collective error and loop recovery).
UNSUPPORTED = {
    "split_group": "a split group would not be rebuilt on recovery; create groups with dist.new_group",
    "merge_remote_group": "groups spanning jobs are not rebuilt on recovery",
    "_get_backend": "the backend object changes at every recovery; call collectives on the group itself",
    # dist._coalescing_manager: under torchrun gloo raises "Backend gloo does not implement startCoalescing" too
    "_start_coalescing": "gloo does not implement coalescing",
    "_end_coalescing": "gloo does not implement coalescing",
}


# called as each collective is issued (the runtime's straggler measure: a step's compute before its first collective)
ON_COLLECTIVE: Callable[[], None] | None = None

# A group's method built from a table below: torch's arguments (tensors, lists of them, options) in, a Work out
GroupMethod = Callable[..., Work]


def forwarding(name: str, target: str) -> GroupMethod:
    """The group's method `name`: forwarded to the backend's `target` (locally completed without a backend)."""
    def method(self: ReconfigurableProcessGroup, *args: Any, **kwargs: Any) -> Work:
        if ON_COLLECTIVE is not None:
            ON_COLLECTIVE()
        if self.inner is None:
            return self.local_op(name, args)
        CHECKS.before(self.inner, target, self.size(), self.global_ranks, self.tracked)
        fn = getattr(self.inner, target, None)
        if fn is None:
            raise RuntimeError(f"phoenixrun: {name} is not available on a gloo group (torch 2.13 exposes no "
                               f"{target} for it); use the uncoalesced collective")
        work: Work = fn(*args, **kwargs)
        return work if name in NOT_WRAPPED else self.tracked(work, args)
    method.__name__ = name
    return method


def coalesced(name: str, single: str) -> GroupMethod:
    """The coalesced op `name` as one `single` op per (output, input) pair."""
    # torch 2.13's gloo binding has no coalesced all-gather/reduce-scatter: one op per pair, each waited for
    # (every member issues the same list in the same order, so the results are those of the coalesced op)
    def method(self: ReconfigurableProcessGroup, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
               opts: object = None) -> Work:
        if self.inner is None:
            return self.local_op(name, (outputs, inputs))
        CHECKS.before(self.inner, single, self.size(), self.global_ranks, self.tracked)
        for out, inp in zip(outputs, inputs):
            fn = getattr(self.inner, single)
            self.tracked(fn(out, inp) if opts is None else fn(out, inp, opts), (out, inp)).wait()
        return local_work()
    method.__name__ = name
    return method


def unsupported(name: str, why: str) -> Callable[..., NoReturn]:
    """The group's method `name`, refused with a clear error."""
    def method(self: ReconfigurableProcessGroup, *args: object, **kwargs: object) -> NoReturn:
        raise RuntimeError(f"phoenixrun: {name} on a process group is not supported under phoenixrun ({why}); "
                           "run this script without phoenixrun.init() (plain torchrun) or avoid this call")
    method.__name__ = name
    return method


def local_work(result: object = None) -> Work:
    """A Work already completed with `result`."""
    fut: torch.futures.Future[object] = torch.futures.Future()
    fut.set_result(result)
    work: Work = _create_work_from_future(fut)
    return work


class ReconfigurableProcessGroup(ProcessGroup):
    """A process group of fixed members whose backend is replaced in place, generation by generation.

    `ranks` are the members' global ranks (None: the whole world, the default group). Every entry
    point torch 2.13 calls on a group object (from Python: `dist.*`; from C++: the pybind11
    trampoline's virtual methods) is forwarded to the current generation's gloo backend of this
    group. Without a backend (a replacement that is still restoring) the few collectives a model
    wrapper's constructor issues complete locally: DDP's constructor checks parameter shapes and
    broadcasts rank 0's weights, tensor parallelism's `distribute_tensor` scatters the root's shards, and the
    replacement's weights are overwritten by the restore anyway.
    """

    def __init__(self, rank: int, world_size: int, ranks: tuple[int, ...] | None = None):
        super().__init__(rank, world_size)  # type: ignore[call-arg]  # torch's (rank, size) overload, not in its stubs
        self.global_ranks = ranks
        # what collectives are forwarded to, looked up by name: the current generation's backend
        # (generations.Backend) or a stand-in refusing every op while quiesced (api.QuiescedBackend)
        self.inner: object | None = None
        # the generation's ops in flight (runtime/abortable.py): its abort fails their waits
        self.in_flight: InFlight | None = None
        self.registry: GroupRegistry | None = None    # the registry that rebuilds it (None: the world group)
        self._name = ""
        self._desc = ""

    def set_backend(self, backend: object | None) -> None:
        self.inner = backend

    def getBackendName(self) -> str:  # noqa: N802 - the C++ virtual's name (pybind11 trampoline)
        return BACKEND_NAME

    # torch stores a group's name on its C++ backends; a Python group has none registered, so without
    # these `group.group_name` raised "ProcessGroup name not set" (init_device_mesh does read it)
    def getGroupName(self) -> str:  # noqa: N802
        return self._name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._name = name

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._desc = desc

    def __repr__(self) -> str:
        who = "world" if self.global_ranks is None else f"ranks {list(self.global_ranks)}"
        return f"<phoenixrun group {self._name or '?'} ({who}), rank {self.rank()}/{self.size()}>"

    def shutdown(self) -> None:
        """`dist.destroy_process_group(group)`: a destroyed group is no longer rebuilt on recovery."""
        if self.registry is not None:
            self.registry.forget(self)
        self.inner = None

    for _name, _target in FORWARDED.items():
        locals()[_name] = forwarding(_name, _target)
    del _name, _target

    for _name, _single in COALESCED.items():
        locals()[_name] = coalesced(_name, _single)
    del _name, _single

    for _name, _why in UNSUPPORTED.items():
        locals()[_name] = unsupported(_name, _why)
    del _name, _why

    def tracked(self, work: Work, tensors: Sequence[Any] = ()) -> Work:
        """`work`, just issued on this group's backend, with a wait the generation's abort ends (abortable.py);
        as it is for CUDA tensors (their future is CUDA-aware) or with no generation attached."""
        if self.in_flight is None or DeviceRouted.on_cuda(tensors):
            return work
        return self.in_flight.track(work)

    def local_op(self, name: str, args: Sequence[Any]) -> Work:
        """Collective `name` with no backend (a replacement still restoring): completed locally."""
        if name == "allgather":            # outputs[i][j] = inputs[i] from every rank: ours
            outputs, inputs = args[0], args[1]
            for outs, inp in zip(outputs, inputs):
                for o in outs:
                    o.copy_(inp)
        elif name in ("_allgather_base", "all_gather_single"):
            out, inp = args[0], args[1]
            out.copy_(inp.repeat(self.size(), *([1] * (inp.dim() - 1))).view_as(out))
        elif name == "scatter":            # DTensor's distribute_tensor (TP's parallelize_module) before protect():
            outputs, inputs = args[0], args[1]  # the root keeps its own chunk; the others get zeros. Either way the
            for i, out in enumerate(outputs):   # values are the model's, overwritten by the restore that follows
                out.copy_(inputs[i][self.rank()]) if inputs else out.zero_()
        elif name not in ("broadcast", "barrier"):
            raise RuntimeError(f"phoenixrun: collective {name} called while this rank is still restoring; "
                               "call phoenixrun.protect() before any collective of your own")
        return local_work()


class GroupRegistry:
    """Every group the script created, in creation order, and the generation they currently live in.

    Torch requires every rank to create groups in the same order, so creation order is a global order: rebuilding
    each rank's member groups in that order cannot deadlock (the lowest group not yet rebuilt has all its members
    waiting on it), and a group's name (torch's, identical on every rank) keys its rendezvous on the generation's
    store.
    """

    def __init__(self) -> None:
        self.world: ReconfigurableProcessGroup | None = None
        self.subgroups: list[ReconfigurableProcessGroup] = []
        self.generation: Generation | None = None
        self.sealed = False      # set by protect(): see create()

    def create(self, opts: _DistributedBackendOptions, backend_options: object = None) -> ReconfigurableProcessGroup:
        """The backend creator torch calls in `new_group` (extended API: it names the members and the group)."""
        ranks = tuple(opts.global_ranks_in_group)
        if not ranks:                          # init_process_group: the default group
            if self.world is None:
                raise RuntimeError("phoenixrun: the default group is created by phoenixrun.init(), not by "
                                   "dist.init_process_group(backend='phoenixrun')")
            return self.world
        if self.sealed:
            # a replacement process runs the script up to protect() and then joins: a group created later exists on
            # the survivors only, and rebuilding it would wait for a member that never creates it
            raise RuntimeError(f"phoenixrun: process group over ranks {list(ranks)} created after phoenixrun.protect(); "
                               "create every group (dist.new_group, init_device_mesh) before protect(), so that a "
                               "replacement process has them too")
        pg = ReconfigurableProcessGroup(opts.group_rank, opts.group_size, ranks)
        pg.setGroupName(str(opts.group_id))
        pg.registry = self
        self.subgroups.append(pg)
        if self.generation is not None:        # created while training: its members meet now
            pg.in_flight = self.generation.in_flight
            pg.set_backend(self.generation.subgroup_backend(pg.getGroupName(), pg.rank(), pg.size()))
        return pg

    def forget(self, pg: ReconfigurableProcessGroup) -> None:
        if pg in self.subgroups:
            self.subgroups.remove(pg)

    def attach(self, gen: Generation | None) -> None:
        """Point every group at generation `gen` (None: detach all; collectives then complete locally)."""
        self.generation = None
        for pg in [self.world, *self.subgroups]:
            if pg is not None:
                pg.set_backend(None)
                pg.in_flight = gen.in_flight if gen is not None else None
        if gen is None:
            return
        if self.world is not None:
            self.world.set_backend(gen.backend)
        for pg in self.subgroups:
            pg.set_backend(gen.subgroup_backend(pg.getGroupName(), pg.rank(), pg.size()))
        self.generation = gen
        if gen.generation > 0:   # a recovery: until the next step ends, collectives are compared (collective_check.py)
            CHECKS.arm()


class NoBuiltinBackendStore(Store):
    """The default group's store. A group made with an explicit built-in backend (`new_group(backend="gloo")`)
    rendezvouses on it; it would be a group of no generation, never rebuilt, and on a per-process store its
    rendezvous would wait for peers that never arrive (30 min). Any use is a clear error instead."""

    def _refuse(self, *args: object, **kwargs: object) -> NoReturn:
        raise RuntimeError("phoenixrun: a process group with an explicit backend (dist.new_group(..., backend='gloo' "
                           "or 'nccl')) cannot be rebuilt after a failure; under phoenixrun.init() create groups "
                           "without backend= (they use phoenixrun's gloo generations), or run without phoenixrun")

    set = get = add = compare_set = wait = check = delete_key = num_keys = multi_get = multi_set = append = _refuse


# held here: torch keeps only the C++ side, and a Python store whose object was collected answers every call
# with "INTERNAL ASSERT FAILED ... Not implemented" instead of its own message
DEFAULT_STORE = NoBuiltinBackendStore()
GROUPS = GroupRegistry()
_registered = False


def install_default_group(rank: int, world_size: int) -> ReconfigurableProcessGroup:
    """Make a ReconfigurableProcessGroup the default (WORLD) group; later `new_group`s get their own."""
    global _registered
    pg = ReconfigurableProcessGroup(rank, world_size)
    GROUPS.world = pg
    if not _registered:
        dist.Backend.register_backend(BACKEND_NAME, GROUPS.create, extended_api=True, devices=["cpu", "cuda"])
        _registered = True
    dist.init_process_group(BACKEND_NAME, store=DEFAULT_STORE, rank=rank, world_size=world_size)
    return pg
