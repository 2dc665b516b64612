"""A default process group whose backend can be replaced in place, generation by generation.

DDP and ZeroRedundancyOptimizer keep a reference to the process group they were built with.
This group keeps rank and world size fixed (a replacement node takes the failed node's ranks)
and forwards every collective to an inner backend that recovery swaps for a fresh one on a new
store prefix, so the training script's objects survive a node replacement (FINDINGS: accepted
by dist.*, DDP and ZeRO).

Gloo offers no call that unblocks an op stuck on a dead or hung peer; shutting down the
generation's own TCP sockets does (within milliseconds). `abort_sockets_since(baseline)` shuts
down every socket created after a baseline taken when the generation began (never gloo's
listening socket: that aborts the process).
"""
from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup, ProcessGroupGloo, _create_work_from_future

BACKEND_NAME = "phoenixrun"


def _socket_inodes() -> dict[str, int]:
    out: dict[str, int] = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            out.setdefault(target, int(fd))
    return out


class Generation:
    """One generation's store connection and gloo backend (on a fresh key prefix)."""

    def __init__(self, master_addr: str, master_port: int, rank: int, world_size: int, generation: int,
                 timeout: timedelta, store_prefix: str | None = None):
        self.generation = generation
        self.store = dist.TCPStore(master_addr, master_port, world_size, is_master=False, timeout=timeout,
                                   use_libuv=True)
        # the master's per-generation prefix (generation fencing); the plain one for an agent that sends none
        prefix = dist.PrefixStore(store_prefix or f"/phoenixrun/gen{generation}/", self.store)
        self.backend = ProcessGroupGloo(prefix, rank, world_size, timeout)


def abort_sockets_since(baseline: set[str]) -> int:
    n = 0
    for inode, fd in _socket_inodes().items():
        if inode in baseline:
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


class ReconfigurableProcessGroup(ProcessGroup):
    """Forwards collectives to the current generation's backend.

    Without a backend (a replacement that is still restoring) collectives complete locally:
    DDP's constructor checks parameter shapes and broadcasts rank 0's weights, and the
    replacement's weights are overwritten by the restore anyway.
    """

    def __init__(self, rank: int, world_size: int):
        super().__init__(rank, world_size)
        self.inner: ProcessGroupGloo | None = None

    def set_backend(self, backend: ProcessGroupGloo | None) -> None:
        self.inner = backend

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def _local(self, result=None):
        fut = torch.futures.Future()
        fut.set_result(result)
        return _create_work_from_future(fut)

    def _fwd(name: str):  # noqa: N805 - builds forwarding methods
        def method(self, *args, **kwargs):
            if self.inner is None:
                return self._local_op(name, args)
            return getattr(self.inner, name)(*args, **kwargs)
        method.__name__ = name
        return method

    for _name in ("allreduce", "allreduce_coalesced", "broadcast", "allgather", "_allgather_base",
                  "allgather_coalesced", "allgather_into_tensor_coalesced", "reduce_scatter",
                  "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "barrier", "gather", "scatter",
                  "send", "recv", "recv_anysource", "alltoall", "alltoall_base", "reduce", "monitored_barrier"):
        locals()[_name] = _fwd(_name)
    del _name

    def _local_op(self, name: str, args):
        if name == "allgather":            # outputs[i][j] = inputs[i] from every rank: ours
            outputs, inputs = args[0], args[1]
            for outs, inp in zip(outputs, inputs):
                for o in outs:
                    o.copy_(inp)
        elif name == "_allgather_base":
            out, inp = args[0], args[1]
            out.copy_(inp.repeat(self.size(), *([1] * (inp.dim() - 1))).view_as(out))
        elif name not in ("broadcast", "barrier"):
            raise RuntimeError(f"phoenixrun: collective {name} called while this rank is still restoring; "
                               "call phoenixrun.protect() before any collective of your own")
        return self._local()


_registered = False


def install_default_group(rank: int, world_size: int) -> ReconfigurableProcessGroup:
    """Make a ReconfigurableProcessGroup the default (WORLD) group."""
    global _registered
    pg = ReconfigurableProcessGroup(rank, world_size)
    if not _registered:
        dist.Backend.register_backend(BACKEND_NAME, lambda store, r, w, t: _current[0], devices=["cpu", "cuda"])
        _registered = True
    _current[0] = pg
    dist.init_process_group(BACKEND_NAME, store=dist.HashStore(), rank=rank, world_size=world_size)
    return pg


_current: list[ReconfigurableProcessGroup | None] = [None]
