"""Worker processes of one node: the torchrun env contract, spawning, output, teardown.

Workers start in their own session so a signal to the agent's process group does not hit
them by accident; teardown therefore walks each worker's whole process tree (psutil) so
nothing is orphaned on any exit path.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable

import psutil

from phoenixrun.agents.prefixer import Prefixer
from phoenixrun.protocol.constants import stack_signal


@dataclass(frozen=True)
class WorkerSpec:
    """What every worker of a job runs (the part of the command line after the flags)."""
    entrypoint: str
    args: tuple[str, ...] = ()
    module: bool = False
    no_python: bool = False

    def argv(self) -> list[str]:
        if self.no_python:
            return [self.entrypoint, *self.args]
        if self.module:
            return [sys.executable, "-u", "-m", self.entrypoint, *self.args]
        return [sys.executable, "-u", self.entrypoint, *self.args]


@dataclass(frozen=True)
class Placement:
    """Where one worker sits in the job, for one generation. rank None = warm spare, unassigned."""
    local_rank: int
    nproc_per_node: int
    nnodes: int
    slot: int | None
    rank: int | None
    master_addr: str
    master_port: int
    run_id: str
    restart_count: int
    max_restarts: int
    generation: int
    agent_sock: str
    error_file: str
    gloo_ifname: str | None = None     # the interface holding the node's address: gloo binds there


def worker_env(base: dict[str, str], p: Placement) -> dict[str, str]:
    """Everything torchrun sets, plus phoenixrun's own variables. Pure."""
    env = dict(base)
    env.update({
        "LOCAL_RANK": str(p.local_rank), "LOCAL_WORLD_SIZE": str(p.nproc_per_node),
        "GROUP_WORLD_SIZE": str(p.nnodes), "ROLE_NAME": "default",
        "MASTER_ADDR": p.master_addr, "MASTER_PORT": str(p.master_port),
        "TORCHELASTIC_RUN_ID": p.run_id, "TORCHELASTIC_RESTART_COUNT": str(p.restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(p.max_restarts), "TORCHELASTIC_ERROR_FILE": p.error_file,
        # workers join the store the master hosts instead of rank 0 starting one (fresh prefix per attempt)
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "PHOENIXRUN_AGENT_SOCK": p.agent_sock, "PHOENIXRUN_GENERATION": str(p.generation),
        "PYTHONUNBUFFERED": "1",
    })
    if p.gloo_ifname and "GLOO_SOCKET_IFNAME" not in base:
        env["GLOO_SOCKET_IFNAME"] = p.gloo_ifname
    if "OMP_NUM_THREADS" not in base and p.nproc_per_node > 1:
        env["OMP_NUM_THREADS"] = "1"
    if p.rank is None:  # warm spare: the runtime waits for its assignment from the agent
        env["PHOENIXRUN_WARM_SPARE"] = "1"
        for k in ("RANK", "WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "PHOENIXRUN_SLOT"):
            env.pop(k, None)
    else:
        world = p.nnodes * p.nproc_per_node
        env.pop("PHOENIXRUN_WARM_SPARE", None)
        env.update({"RANK": str(p.rank), "WORLD_SIZE": str(world), "GROUP_RANK": str(p.slot),
                    "ROLE_RANK": str(p.rank), "ROLE_WORLD_SIZE": str(world), "PHOENIXRUN_SLOT": str(p.slot)})
    return env


def standby_env(env: dict[str, str]) -> dict[str, str]:
    """A node's standby worker (agents/standby.py): a warm worker's environment (no rank) without LOCAL_RANK - it
    may take any local rank of the node, and learns it, with the rest, at phoenixrun.init(). Pure."""
    out = {k: v for k, v in env.items() if k != "LOCAL_RANK"}
    out["PHOENIXRUN_STANDBY"] = "1"
    return out


ERR_TAIL = 64 * 1024      # bytes of each worker's stderr its agent keeps (a state_dict refusal lists every tensor)
_console_lock = threading.Lock()   # one chunk of one worker at a time on the agent's stdout/stderr


class Worker:
    def __init__(self, spec: WorkerSpec, placement: Placement, env: dict[str, str], out: IO[str] | None,
                 log_dir: Path | None, tee: bool, show: bool = True, err: IO[str] | None = None,
                 name: str | None = None, pass_fds: tuple[int, ...] = (),
                 on_exit: Callable[[Worker], None] | None = None):
        """out/err: where the worker's stdout/stderr go, prefixed (the agent's own by default); show: False
        keeps this worker off the console (torchrun's --local-ranks-filter; may change while it runs: a standby
        that takes a local rank); stdin is inherited, as under torchrun (breakpoint() and input() work); name:
        what its output and log directory are called until it has a rank [default: spare<local rank>]; pass_fds:
        descriptors it inherits (its agent's progress block: phoenixrun/protocol/progress_block.py); on_exit: called
        with this worker, on a thread of its own, as soon as its process has exited (no poll interval between a
        worker's death and its agent acting on it)."""
        self.placement = placement
        self.rank = placement.rank
        self.local_rank = placement.local_rank
        self.name = name or f"spare{placement.local_rank}"
        self.show = show
        files = None
        if log_dir is not None:
            d = (Path(log_dir) / f"attempt_{placement.restart_count}" / f"gen{placement.generation}"
                 / (name or str(placement.local_rank)))
            d.mkdir(parents=True, exist_ok=True)
            files = (open(d / "stdout.log", "ab", buffering=0), open(d / "stderr.log", "ab", buffering=0))
        self.proc = subprocess.Popen(spec.argv(), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     start_new_session=True, pass_fds=pass_fds)
        self.pid = self.proc.pid
        self.started = time.time()
        self._console = tee or files is None
        streams = ((self.proc.stdout, out or sys.stdout), (self.proc.stderr, err or sys.stderr))
        self._err_tail = bytearray()     # the end of its stderr: what its last error said (faults/mismatch.py)
        self._pumps = []
        for i, (pipe, dest) in enumerate(streams):
            t = threading.Thread(target=self._pump, args=(pipe, dest if self._console else None,
                                                          files[i] if files else None, i == 1), daemon=True)
            t.start()
            self._pumps.append(t)
        if on_exit is not None:
            threading.Thread(target=self._await_exit, args=(on_exit,), daemon=True, name=f"exit-{self.pid}").start()

    def _await_exit(self, on_exit: Callable[[Worker], None]) -> None:
        self.proc.wait()     # (poll() from other threads reads None until this has reaped it: never a stale exit)
        on_exit(self)

    def _prefix(self) -> str:
        return f"[rank{self.rank}]:" if self.rank is not None else f"[{self.name}]:"

    def err_tail(self, wait: float = 0.0) -> str:
        """The last ERR_TAIL bytes of the worker's stderr; `wait`: seconds to let an exited worker's last output
        in first."""
        if wait:
            self._pumps[1].join(timeout=wait)
        return bytes(self._err_tail).decode(errors="replace")

    def _pump(self, pipe: IO[bytes], dest: IO[str] | None, log_file: IO[bytes] | None, is_err: bool = False) -> None:
        prefixer = Prefixer(self._prefix().encode())
        fd = pipe.fileno()
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            if is_err:
                self._err_tail += chunk
                del self._err_tail[:-ERR_TAIL]
            if log_file:
                log_file.write(chunk)
            if dest is not None and self.show:
                if self.rank is not None and not prefixer.prefix.startswith(b"[rank"):
                    prefixer.prefix = self._prefix().encode()   # a warm spare or a standby got its rank
                data = prefixer.feed(chunk)
                with _console_lock:
                    target = getattr(dest, "buffer", None)
                    if target is not None:
                        dest.flush()
                        target.write(data)
                        target.flush()
                    else:
                        dest.write(data.decode(errors="replace"))
                        dest.flush()
        pipe.close()
        if log_file:
            log_file.close()

    def poll(self) -> int | None:
        return self.proc.poll()

    def ask_stacks(self) -> bool:
        """Ask a managed worker to print its threads' stacks to its stderr (runtime/stacks.py), before it is killed
        for not answering. False if it is gone. (A worker that did not install the handler dies of the signal:
        only ever sent to a worker about to be killed.)"""
        try:
            os.kill(self.pid, stack_signal())
            return True
        except ProcessLookupError:
            return False

    def kill_now(self, wait: float = 2.0) -> None:
        """SIGKILL the worker's whole tree at once (a hung worker: a stopped process cannot act on a SIGTERM, and
        there is nothing of it to save), and wait up to `wait` seconds for the worker to be gone."""
        try:
            procs = [psutil.Process(self.pid)]
            procs += procs[0].children(recursive=True)
        except psutil.NoSuchProcess:
            procs = []
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        try:
            self.proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass

    def kill_tree(self, grace: float = 2.0) -> None:
        try:
            procs = [psutil.Process(self.pid)]
            procs += procs[0].children(recursive=True)
        except psutil.NoSuchProcess:
            procs = []
        for p in procs:
            try:
                p.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=grace)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=grace)
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
