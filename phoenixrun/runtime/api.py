"""The training-script API: `phoenixrun.init()` and `phoenixrun.protect()`.

    ctx = phoenixrun.init()                        # torch.distributed set up through phoenixrun
    model = DDP(GPT(...), find_unused_parameters=True)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=3e-4)
    job = phoenixrun.protect(model, opt, state=progress)   # progress: a JSON-able dict you own
    for step in job.steps(total):
        with job.step(step):
            loss = model(batch(step)).mean()
            job.observe_loss(loss)      # NaN/inf: stop the job before any rank applies this step
            loss.backward(); opt.step(); opt.zero_grad()

Under plain torchrun, or with PHOENIXRUN_PROTECT=0, init() is `dist.init_process_group` and
protect() returns a pass-through whose step() is a null context: no wrapper code runs per step.
Under phoenixrun, the state after each step is snapshotted into the node agent's memory while the
next step computes; `opt.step()` waits until that snapshot is committed (locally and at the
replica holders). A collective error or a quiesce order from the master makes the `with` block
abandon the step, rebuild the process group for the next generation, roll back to the restore
step and continue: `job.steps()` then yields that step again.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import math
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import Any, Callable, Iterator, Mapping, NoReturn

import torch
import torch.distributed as dist

from phoenixrun.config import WorkerSettings
from phoenixrun.protocol import worker_messages as wm
from phoenixrun.protocol import worker_orders
from phoenixrun.protocol.progress_block import ProgressBlock
from phoenixrun.protocol.reshard import WorkerReshard
from phoenixrun.protocol.worker_orders import WorkerOrder
from phoenixrun.runtime import boundaries, layout_check, process_group, stacks
from phoenixrun.runtime.agent_link import AgentGone, AgentLink
from phoenixrun.runtime.collective_check import CHECKS
from phoenixrun.runtime.data import BatchStream, DataPositionLost, InputWatch, Loader, RunPosition, Skip, StatefulObjects
from phoenixrun.runtime.protection import Protection, Quiesced
from phoenixrun.runtime.recovery_client import RecoveryClient, recoverable_cause
from phoenixrun.runtime.generations import Generations, generation_kind
from phoenixrun.runtime.process_group import GROUPS, ReconfigurableProcessGroup, install_default_group
from phoenixrun.topology import Coords, Layout

log = logging.getLogger("phoenixrun.runtime")
if not log.handlers:  # the training script may not configure logging; recovery must still be visible
    _h = logging.StreamHandler()
    _h.setFormatter(logging.Formatter("[phoenixrun %(levelname)s] %(message)s"))
    log.addHandler(_h)
    log.propagate = False


class QuiescedBackend:
    """What every group points at once its generation is quiesced, until the next one is joined: any collective
    raises Quiesced at once, on the thread that issues it. The gloo ops on the shut-down sockets fail only when
    waited for, and DDP waits for its gradient buckets at the end of backward: without this a survivor ran the rest
    of its backward (seconds) before it noticed. Raised from DDP's reducer at a bucket boundary, it abandons the
    backward there."""

    def __init__(self, generation: int):
        self.generation = generation

    def __getattr__(self, op: str) -> NoReturn:
        raise Quiesced(f"generation {self.generation} is quiesced: {op} refused")


class NonFiniteLoss(FloatingPointError):
    """The loss handed to `job.observe_loss()` is NaN or infinite.

    Not recoverable by a hot swap (a replacement would compute the same value): the job stops with a non-zero
    exit, and the step that produced it is never snapshotted, so the last committed snapshot is the state
    before that step.
    """


def check_loss(loss: float | torch.Tensor, step: int | None = None) -> None:
    """Raise NonFiniteLoss unless `loss` (a float or a tensor) is finite. One device sync for a GPU tensor."""
    if torch.is_tensor(loss):
        t = loss.detach()
        if bool(torch.isfinite(t).all()):
            return
        value = "nan" if bool(torch.isnan(t).any()) else "inf"
    else:
        v = float(loss)
        if math.isfinite(v):
            return
        value = "nan" if math.isnan(v) else "inf"
    where = f" at step {step}" if step is not None else ""
    raise NonFiniteLoss(f"loss is {value}{where}")


@dataclass
class Context:
    rank: int
    world_size: int
    local_rank: int
    coords: Coords
    tp: int
    pp: int
    dp: int
    managed: bool                   # running under a phoenixrun agent with protection on
    process_group: dist.ProcessGroup | None = None


_ctx: Context | None = None
_runtime: "_Runtime | None" = None


def _protection_enabled() -> bool:
    settings: WorkerSettings = WorkerSettings.from_env()
    return settings.managed


def init(backend: str = "gloo") -> Context:
    """Set up torch.distributed (through phoenixrun when launched by it). Idempotent."""
    global _ctx, _runtime
    if _ctx is not None:
        return _ctx
    settings: WorkerSettings = WorkerSettings.from_env()
    tp, pp = settings.tp, settings.pp
    if not _protection_enabled():
        if not dist.is_initialized():
            dist.init_process_group(backend)
        rank, world = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", "0"))
        managed = False
    else:
        stacks.install()      # its agent asks for our stacks before it kills us for not answering
        _runtime = _Runtime(settings.agent_sock, int(os.environ.get("LOCAL_RANK", "0")))
        rank, world, local = _runtime.rank, _runtime.world_size, _runtime.local_rank
        managed = True
    layout = _plan_layout(world, tp, pp)
    _ctx = Context(rank=rank, world_size=world, local_rank=local, coords=layout.coords(rank), tp=tp, pp=pp,
                   dp=layout.dp, managed=managed, process_group=dist.group.WORLD)
    return _ctx


def joining_step() -> int | None:
    """The step this process joins a running job at (a warm spare or a local reset's new worker: its state is
    restored by protect()); None at a fresh start or without phoenixrun. For a loop that must fast-forward its own
    position before protect() runs (phoenixrun.integrations)."""
    init()
    return _runtime.restore_step if _runtime is not None else None


def _plan_layout(world: int, tp: int, pp: int) -> Layout:
    """The (nodes, ranks per node, tp, pp) layout the master plans recoveries with."""
    nproc = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return Layout(max(1, world // max(1, nproc)), nproc, tp, pp) if world % max(1, nproc) == 0 \
        else Layout(1, world, tp, pp)


def protect(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any] | None = None,
            every: int = 1, *, data: Loader | None = None, stateful: Mapping[str, Any] | None = None,
            check_data: bool = True, skip: Skip | None = None) -> "Job | PassThroughJob":
    """Protect (model, optimizer, state) with per-step in-memory snapshots; see the module doc.

    state: a JSON-serialisable dict you own (metrics, counters...). It is snapshotted with
    the step and restored in place (cleared and refilled) when the job rolls back.
    data: the loader the loop takes its batches from (`next(job.batches)`); its position is restored on
    every rank at a recovery (runtime/data.py). stateful: {name: object with state_dict()/load_state_dict()}
    (LR scheduler, GradScaler...), snapshotted with the step and loaded on a recovery.
    check_data: a survivor that replays a step on other inputs than it ran it with stops the job
    (DataPositionLost) instead of training on the wrong batches; False turns the check off.
    skip: skip(loader, n) -> the loader's current epoch from its batch n (an adapter's; see runtime/data.py).
    """
    optimizer = _unwrap_optimizer(optimizer)
    position = RunPosition(BatchStream(data, skip) if data is not None else None, StatefulObjects(stateful),
                           InputWatch() if check_data else None)
    ctx = init()
    if not ctx.managed:
        return PassThroughJob(position)
    _refuse_rebucketing(model)
    rt = _runtime
    assert rt is not None   # init() made it: ctx.managed
    fresh = rt.restore_step is None
    decided = _check_layout(ctx, model, optimizer, fresh_start=fresh)
    GROUPS.sealed = True
    if fresh and ctx.rank == 0:   # the master plans shared fetches from this peer set (or the DP ring: None)
        ps = decided.dtensor_peers
        rt.link.send(wm.Layout(peers=ps.to_wire() if ps is not None else None))
    return Job(rt, model, optimizer, state if state is not None else {}, every, peer_shared=decided.peer_shared,
               dtensor_shared=decided.dtensor_peers is not None, position=position)


def _unwrap_optimizer(optimizer: object) -> torch.optim.Optimizer:
    """The torch optimizer inside a framework's wrapper (accelerate's AcceleratedOptimizer: its step() calls the
    inner one's, so the snapshot hooks on the inner one run at the same point)."""
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer) and inner is not optimizer:
        return _unwrap_optimizer(inner)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"phoenixrun.protect: {type(optimizer).__name__} is not a torch.optim.Optimizer; pass the "
                        "optimizer whose step() the loop calls")
    return optimizer


def _refuse_rebucketing(model: torch.nn.Module) -> None:
    """DDP without find_unused_parameters rebuilds its gradient buckets after the first step, and a replacement
    process would start with another bucket layout than the survivors (gloo then aborts on a size mismatch)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = [m for m in [model, getattr(model, "_orig_mod", None)] if isinstance(m, DDP)]   # torch.compile'd too
    if ddp and not (ddp[0].find_unused_parameters or ddp[0].static_graph):
        raise ValueError(
            "phoenixrun.protect: the model's DDP needs find_unused_parameters=True (DDP otherwise rebuilds its "
            "gradient buckets after the first step, and a replacement would start with another layout than the "
            "survivors). Set it where your framework builds DDP: DDP(model, find_unused_parameters=True); "
            "accelerate: Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)]); "
            "Lightning: Trainer(strategy=\"ddp_find_unused_parameters_true\"); HF Trainer: "
            "TrainingArguments(ddp_find_unused_parameters=True).")


def _check_layout(ctx: Context, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  fresh_start: bool) -> layout_check.Verdict:
    """Refuse (ProtectionRefused) what no snapshot can restore, and decide whether plain state may be taken from
    DP peers on recovery; see runtime/layout_check.py.

    At a fresh start every rank is here: one all-gather of (checksum, refused, unshared) per rank lets every rank
    take the same decision, so a refusal stops all ranks at once instead of leaving the others in a collective. A
    replacement joining a running job checks only what it sees locally (its peers passed at the start) and takes
    the sharing decision recorded in the snapshot it restores."""
    layout = _plan_layout(ctx.world_size, ctx.tp, ctx.pp)
    flags = f"--tp {ctx.tp} --pp {ctx.pp}"
    facts = layout_check.observe(model, optimizer, ctx.rank, layout.dp_peers(ctx.rank), flags, ctx.tp, ctx.pp)
    own = layout_check.local_refusal(facts)
    if not fresh_start:
        if own:
            raise layout_check.ProtectionRefused(own)
        return layout_check.Verdict()
    unshared = layout_check.unshared_reason(facts)
    mesh_peers = layout_check.dtensor_peers(facts, ctx.world_size)
    mine = torch.tensor([0 if own else layout_check.shared_checksum(model), 1 if own else 0, 1 if unshared else 0,
                         layout_check.peer_fingerprint(mesh_peers)], dtype=torch.int64)
    gathered = [torch.zeros(4, dtype=torch.int64) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, mine)   # (all_gather_into_tensor warns of its deprecation on every rank in torch 2.13)
    rows = [g.tolist() for g in gathered]
    flagged = [(ctx.rank, unshared)] if unshared else []
    flagged += [(r, "its plain state is not provably its peers' (that rank's log says why)")
                for r, (_, _, u, _) in enumerate(rows) if u and r != ctx.rank]
    decided = layout_check.verdict(own, [r for r, (_, bad, _, _) in enumerate(rows) if bad and r != ctx.rank],
                                   [c for c, _, _, _ in rows], layout_check.dp_groups(ctx.world_size, layout.dp_peers),
                                   flagged, flags)
    if decided.refusal:
        raise layout_check.ProtectionRefused(decided.refusal)
    if facts.dtensors:
        coords = layout.coords

        def same_plain_peers(rank: int, peer: int) -> bool:
            a, b = coords(rank), coords(peer)
            return (a.tp, a.pp) == (b.tp, b.pp)
        ps, why = layout_check.dtensor_verdict(mesh_peers, [fp for _, _, _, fp in rows],
                                               {r: layout.slot_of(r) for r in range(ctx.world_size)},
                                               decided.peer_shared, same_plain_peers)
        decided = dataclasses.replace(decided, dtensor_peers=ps, dtensor_why=why)
        if ctx.rank == 0:
            if ps is not None:
                log.info("phoenixrun.protect: DTensor shards are taken from a peer on another node on recovery "
                         "(mesh %s %s, sharded over %s), not replicated", list(ps.mesh.names), list(ps.mesh.shape),
                         sorted(ps.varies))
            else:
                log.info("phoenixrun.protect: DTensor shards are snapshotted as rank-private and replicated: %s", why)
    if not decided.peer_shared and ctx.rank == 0 and layout_check.has_plain_state(model, optimizer):
        log.warning("phoenixrun.protect: plain (non-DTensor) state is snapshotted as rank-private and replicated, "
                    "not taken from data-parallel peers: %s", decided.private_why)
    return decided


class PassThroughJob:
    """Under plain torchrun: a restart reruns the script from its start, so restore callbacks never run."""

    def __init__(self, position: RunPosition):
        self.position = position

    @property
    def batches(self) -> BatchStream:
        """The batches of protect(data=...), epoch after epoch: the same stream a protected run takes."""
        return self.position.batches

    @property
    def generation(self) -> int:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def on_restore(self, fn: Callable[[int, int], None]) -> Callable[[int, int], None]:
        return fn

    """Protection off: plain loop, nothing runs per step."""

    def steps(self, total: int) -> Iterator[int]:
        return iter(range(total))

    def step(self, k: int) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def observe_loss(self, loss: float | torch.Tensor) -> None:
        check_loss(loss)


class _Runtime:
    """The worker's link to its agent and its reconfigurable process group."""

    def __init__(self, sock_path: str, local_rank: int):
        self.link = AgentLink(sock_path)
        self.link.on_quiesce = self._on_quiesce
        self.link.on_abort = self.abort   # `phoenixrun inject --fault comm-timeout`: fail our collectives now
        self.link.on_drain = self._on_drain
        self.drain_at: tuple[int, int] | None = None   # (generation, step boundary) of a drain's quiesce
        self.running_step = -1            # the step the training thread has set out to run (under link.cv)
        self.final_step = 1 << 62         # job.steps()'s total: its end is the last boundary a drain can stop at
        self.link.send(wm.Hello(local_rank=local_rank, pid=os.getpid(), api=True))
        assign = self.next_order(worker_orders.Assign)
        assert isinstance(assign, worker_orders.Assign)
        self.assigned_at = time.time()             # a replacement's set-up is measured from here (Timings.setup_s)
        self.rank, self.world_size = assign.rank, assign.world_size
        self.local_rank = assign.local_rank        # a standby learns it here (agents/standby.py)
        self.master_addr, self.master_port = assign.master_addr, int(assign.master_port)
        self.generation = assign.generation
        self.store_prefix = assign.store_prefix
        self.restore_step = assign.restore_step
        self.reshard: WorkerReshard | None = assign.reshard   # a shrink or grow's restart (runtime/reshard.py)
        settings: WorkerSettings = WorkerSettings.from_env()
        self.timeout = timedelta(seconds=settings.collective_timeout)
        # a warm spare learns its identity only now: give the script what torchrun would have
        os.environ.update({"RANK": str(self.rank), "LOCAL_RANK": str(self.local_rank),
                           "WORLD_SIZE": str(self.world_size), "GROUP_RANK": str(assign.slot), "ROLE_RANK": str(self.rank),
                           "ROLE_WORLD_SIZE": str(self.world_size), "PHOENIXRUN_SLOT": str(assign.slot)})
        # every generation of the groups' backends: created, aborted and destroyed by one lifecycle
        self.gens = Generations(generation_kind(settings.backend), self.master_addr, self.master_port, self.rank,
                                self.world_size, self.timeout, GROUPS)
        self.refuse_on_quiesce = True        # protect() clears it for FSDP2 (see Job)
        self.pg: ReconfigurableProcessGroup = install_default_group(self.rank, self.world_size)
        atexit.register(self.close)
        if self.restore_step is None:
            self.connect(self.generation)   # fresh start: everyone meets now (DDP init syncs for real)

    @property
    def quiesce_pending(self) -> bool:
        return self.link.quiesce_generation >= self.generation and self._gen_stale()

    def _gen_stale(self) -> bool:
        gen = self.gens.current
        return gen is None or gen.generation < self.link.quiesce_generation

    def next_order(self, *kinds: type[WorkerOrder]) -> WorkerOrder:
        """The agent's next order of one of `kinds` (the others are moot by now)."""
        while True:
            order = self.link.orders.get()
            if isinstance(order, worker_orders.ChannelClosed):
                raise AgentGone("the node agent went away")
            if isinstance(order, kinds):
                return order

    def _on_quiesce(self, generation: int) -> None:
        # called on the reader thread: unblock whatever the training thread is stuck in, and refuse its next
        # collective (a gradient bucket's: the step is abandoned at that boundary, not at its end)
        gen = self.gens.current
        if self.refuse_on_quiesce and gen is not None and gen.generation < generation:
            refused = QuiescedBackend(gen.generation)
            for pg in [GROUPS.world, *GROUPS.subgroups]:
                if pg is not None and pg.inner is not None:
                    pg.set_backend(refused)
        self.gens.abort()

    def abort(self) -> None:
        self.gens.abort()

    def _on_drain(self, generation: int, at_step: int) -> bool:
        """A drain's quiesce (reader thread): stop at step boundary `at_step`. False when the training thread is
        already in that step or a later one: then it quiesces at once, as for a fault (the step is abandoned)."""
        with self.link.cv:
            if self.running_step >= min(at_step, self.final_step):
                return False
            self.drain_at = (generation, at_step)
            return True

    def close(self) -> None:
        """At exit, while the interpreter is whole: stop the agent-link thread and free the gloo
        backends in order. Left to interpreter teardown, a daemon thread or a late destructor
        occasionally ended the process with SIGABRT ('terminate called without an active exception')."""
        GROUPS.attach(None)
        self.link.close()
        self.gens.close()

    def connect(self, generation: int, store_prefix: str | None = None, master_addr: str | None = None,
                master_port: int | None = None) -> None:
        """Rendezvous generation `generation` (blocks until the whole world has joined), on the master's TCPStore
        at master_addr:master_port when given (it moved: a standby master took over on its own host)."""
        self.store_prefix = store_prefix or self.store_prefix
        if master_addr and master_port:
            self.master_addr, self.master_port = master_addr, int(master_port)
            self.gens.master_addr, self.gens.master_port = self.master_addr, self.master_port
        try:
            self.gens.connect(generation, self.store_prefix)
        finally:
            if self.gens.current is not None and self.gens.current.generation == generation:
                self.generation = generation


class Job:
    """A protected training loop (see the module doc): the script's facade over the protection pipeline
    (runtime/protection.py) and this rank's side of recoveries (runtime/recovery_client.py)."""

    def __init__(self, rt: _Runtime, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                 every: int, peer_shared: bool = True, dtensor_shared: bool = False,
                 position: RunPosition | None = None):
        self.rt, self.link = rt, rt.link
        self.model, self.optimizer, self.state = model, optimizer, state
        self.position = position or RunPosition(None, StatefulObjects(None), None)
        self.protection = Protection(self.link, rt.rank, model, optimizer, state, self.position, every, peer_shared,
                                     dtensor_shared, lambda: rt.quiesce_pending)
        self.recovery = RecoveryClient(rt, self.protection, lambda: self.next_step, self._restored)
        self._in_step = False
        self._last_ping = 0.0
        # each step's start, for the agent's hang watchdog: a store into memory it shares, no message
        self._progress = ProgressBlock.attach(os.environ)
        self._enter_t = 0.0             # when the current step began (0: none since the start or a recovery)
        self._longest_step_s = 0.0      # longest step since the last progress message (the agent's quiesce grace)
        self.next_step = 0
        self.current = -1
        # straggler measure: a step's time until it issues its first collective - this rank's own compute, before
        # it can wait for anyone (the step's wall time is every rank's alike: DP ranks wait for the slowest)
        self.compute_s: float | None = None
        self._base_compute_s = 0.0      # the same, without an injected slowdown (`inject --fault slow:F`)
        self._step_t0 = self._compute_t0 = 0.0
        self._first_collective: float | None = None
        process_group.ON_COLLECTIVE = self._on_collective
        self._restore_callbacks: list[Callable[[int, int], None]] = []
        self._joined_at: int | None = None   # a replacement process: the step protect() restored
        self._protected = False               # protect() has returned this job
        optimizer.register_step_pre_hook(self._before_optimizer_step)
        # a quiesce boundary at every forward (each micro-batch); first, before a wrapper's own hooks communicate
        model.register_forward_pre_hook(self._before_forward, prepend=True, with_kwargs=True)
        # a boundary at every collective (DDP: each gradient bucket) - except under FSDP2, whose backward hooks keep
        # state (parameters unsharded by a prefetch, gradients to reduce) that an exception raised inside them would
        # leave behind for the replay; there the quiesce waits for the next forward, optimizer step or collective wait
        from torch.distributed.fsdp import FSDPModule
        rt.refuse_on_quiesce = not any(isinstance(m, FSDPModule) for m in model.modules())
        if rt.refuse_on_quiesce:   # and at every layer's forward and every gradient: a survivor stops at once
            boundaries.install(model, self._check_quiesce)
        if rt.restore_step is not None and rt.reshard is not None:
            self.recovery.reshape(rt.generation, rt.restore_step, rt.reshard)
        elif rt.restore_step is not None:
            self.recovery.join(rt.generation, rt.restore_step)
        self._protected = True

    @property
    def batches(self) -> BatchStream:
        """The batches of protect(data=...), epoch after epoch, put back at the restored step on every recovery."""
        return self.position.batches

    @property
    def generation(self) -> int:
        """The job's process-group generation: 0 at a fresh start, one more for every recovery. Groups the
        script created are rebuilt in place and stay valid across generations."""
        return self.rt.generation

    def on_restore(self, fn: Callable[[int, int], None]) -> Callable[[int, int], None]:
        """Register `fn(step, generation)`, called after every recovery this process takes part in - on the
        survivors and in a replacement process alike - once model, optimizer and `state` hold the snapshot
        of `step` and the new generation's groups are up, before the next step. For what lives outside
        model and optimizer (a pipeline schedule, a data iterator's position). A replacement process
        restored inside `protect()`, before it could register anything: there `fn` runs at registration.
        Usable as a decorator."""
        self._restore_callbacks.append(fn)
        if self._joined_at is not None:
            fn(self._joined_at, self.rt.generation)
        return fn

    def _restored(self, step: int) -> None:
        self.next_step = step
        if not self._protected:   # restored inside protect(): nothing can be registered yet
            self._joined_at = step
        for fn in self._restore_callbacks:
            fn(step, self.rt.generation)

    # ---------------------------------------------------------------- the loop
    def steps(self, total: int) -> Iterator[int]:
        self.rt.final_step = total
        while True:
            while self.next_step < total:
                if self._drain_due(total):
                    self.recovery.stop_for_drain()
                    continue
                yield self.next_step
            if self._drain_due(total):     # a drain whose boundary is past the end stops at the end
                self.recovery.stop_for_drain()
                continue
            try:  # nobody leaves while a peer might still need to replay a step with them
                dist.barrier()
                self.protection.copier.wait()
                return
            except Exception as e:  # noqa: BLE001 - any failure here is a recovery
                self._recover(e)

    def _recover(self, exc: BaseException | None) -> None:
        self._enter_t = 0.0                 # the time to the next step is the recovery's, not a step's
        self.recovery.recover(exc, self.current)

    def _on_collective(self) -> None:
        if self._first_collective is None:
            self._first_collective = time.perf_counter()

    def _drain_due(self, total: int) -> bool:
        """At a step boundary: has a drain asked this rank to stop here? If not, the next step (or, at the end,
        the final barrier) is set out on: a drain order arriving from now on for this step or an earlier one
        quiesces at once (see _on_drain)."""
        rt = self.rt
        with self.link.cv:
            if rt.drain_at is not None and rt.drain_at[0] > rt.generation \
                    and self.next_step >= min(rt.drain_at[1], total):
                return True
            rt.running_step = self.next_step
            return False

    def step(self, k: int) -> "StepScope":
        return StepScope(self, k)

    def observe_loss(self, loss: float | torch.Tensor) -> None:
        """Hand the step's loss to phoenixrun (inside `with job.step(k)`, before `backward()`).

        A NaN or infinite loss raises NonFiniteLoss at once: this rank never joins the step's gradient
        all-reduce, so no rank applies the step and no snapshot of it is committed anywhere; the master is told
        (class software_unknown, external fallback) and stops the job. Costs one isfinite() on a scalar.
        """
        if self.link.poison_loss:         # fault drill (`phoenixrun inject --fault nan`)
            self.link.poison_loss = False
            loss = loss * float("nan")
        check_loss(loss, self.current)

    # ---------------------------------------------------------------- quiesce boundaries
    def _check_quiesce(self, where: str) -> None:
        """A boundary: abandon the step here when this generation was told to stop (one flag read otherwise)."""
        if self.rt.quiesce_pending:
            raise Quiesced(f"quiesced at {where} of step {self.current}")

    def _before_forward(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._in_step:
            self.position.forward(self.current, args, kwargs)
        self._check_quiesce("a forward")

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...],
                               kwargs: dict[str, Any]) -> None:
        self._check_quiesce("the optimizer step")   # an abandoned step applies nothing
        self.protection.before_optimizer_step(self.current)


class StepScope:
    """What `job.step(k)` returns: the scope of one protected step (the integrations hold one open between a
    framework's batch-start and batch-end hooks)."""

    def __init__(self, job: Job, k: int):
        self.job, self.k = job, k

    def __enter__(self) -> int:
        job = self.job
        job.current = self.k
        now = time.monotonic()
        if job._enter_t:                  # the last step, with what the loop did between steps
            job._longest_step_s = max(job._longest_step_s, now - job._enter_t)
        job._enter_t = now
        if job._progress is not None:     # the hang watchdog's clock: this step began now (protocol/progress_block.py)
            job._progress.write(job.rt.local_rank, self.k, now)
        if now - job._last_ping > 1.0:    # the longest recent step, for the agent's quiesce grace
            job._last_ping = now
            step_s = None
            if job._longest_step_s:
                step_s, job._longest_step_s = round(job._longest_step_s, 4), 0.0
            job.link.send(wm.Progress(step=self.k, step_s=step_s))
        t0 = time.perf_counter()
        if job.link.slow_factor > 1 and job._base_compute_s:
            time.sleep((job.link.slow_factor - 1) * job._base_compute_s)   # fault drill: a straggler's compute
        job._step_t0, job._compute_t0, job._first_collective = t0, time.perf_counter(), None
        job._in_step = True
        return self.k

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        job = self.job
        job._in_step = False
        CHECKS.disarm()
        if exc is None and not job.rt.quiesce_pending:
            try:   # a replayed step that ran on other inputs: stopped before its result is snapshotted
                job.position.step_end(self.k)
            except DataPositionLost as lost:
                exc = lost
        if isinstance(exc, DataPositionLost):
            log.error("rank %d: %s", job.rt.rank, exc)
            job.link.send(wm.ScriptError(text=f"DataPositionLost: {exc}"[:2000], step=self.k))
            if exc_type is None:
                raise exc
            return False
        if exc is None and not job.rt.quiesce_pending:
            if job._first_collective is not None:
                job.compute_s = job._first_collective - job._step_t0
                job._base_compute_s = job._first_collective - job._compute_t0
            job.next_step = self.k + 1
            job.protection.snapshot(self.k + 1, job.compute_s)
            return False
        if isinstance(exc, NonFiniteLoss):   # never snapshotted; the job must stop, not hot-swap
            job.link.send(wm.NanLoss(text=str(exc), step=self.k))
            return False
        if exc is not None and not job.rt.quiesce_pending and recoverable_cause(exc) is None:
            # the script's own error: not ours to hide; tell the agent what it was (classification)
            job.link.send(wm.ScriptError(text=f"{type(exc).__name__}: {exc}"[:2000], step=self.k))
            return False
        job._recover(exc)
        return True

