"""Hot swap inside Lightning's own loop: `PhoenixDDPStrategy`, a drop-in for Lightning's DDPStrategy.

    import phoenixrun
    from phoenixrun.integrations.lightning import PhoenixDDPStrategy
    phoenixrun.init()                  # first: Lightning takes the process group it finds, phoenixrun's
    trainer = Trainer(strategy=PhoenixDDPStrategy(), ...)
    trainer.fit(model, loader)

Under plain torchrun (or PHOENIXRUN_PROTECT=0) it is DDPStrategy, unchanged. Under phoenixrun each training batch
is a protected step (on_train_batch_start .. on_train_batch_end): the DDP module, the optimizer, the RNG, the LR
schedulers, the precision plugin (a GradScaler) and the fit loop's `state_dict()` - its progress and the train
loader's position - are snapshotted at its end. On a recovery every rank takes the same way back into the loop:
Lightning's own resume from a mid-epoch checkpoint, with everything taken from the in-memory snapshot instead of
a file. A survivor unwinds out of `fit` (its launcher catches the fault, before Lightning's interrupt handling
tears anything down) and re-enters `_fit_impl` with a resume; a replacement starts `fit` as that resume. Every rank
thus issues Lightning's collectives (its per-batch SIGTERM broadcast, barriers, DDP's buckets) in the same order.

The train loader is wrapped so that Lightning sees it as resumable (`state_dict()`: the batches the loop has taken
this epoch and the generators' states at the epoch's start): the resume skips those batches at the sampler's index
level and draws the epoch as the fault-free run drew it (runtime/data.py). Limits: docs/porting.md.
"""
from __future__ import annotations

import signal
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
# lightning.pytorch binds __version__ by a conditional import, not an explicit re-export (mypy's implicit_reexport)
from lightning.pytorch import __version__ as _pl_version  # type: ignore[attr-defined]
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from phoenixrun.integrations import rng_states, set_rng_states
from phoenixrun.runtime.api import Job, init, joining_step, protect
from phoenixrun.runtime.data import generator_states, resume_epoch

if TYPE_CHECKING:
    from phoenixrun.runtime.api import StepScope

_T = TypeVar("_T")

SNAPSHOT = "phoenixrun:in-memory-snapshot"   # the ckpt_path of a resume from the snapshot


class PhoenixDDPStrategy(DDPStrategy):
    """Lightning's DDPStrategy with phoenixrun's hot swap (see the module doc). Unset, find_unused_parameters is
    True under phoenixrun (a replacement must share the survivors' gradient buckets)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._phoenix: _Steps | None = None
        if init().managed:
            kwargs.setdefault("find_unused_parameters", True)
            self._phoenix = _Steps(self)
        super().__init__(*args, **kwargs)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # under phoenixrun the snapshot is restored at the end of setup (protect() needs the DDP module and the
        # optimizer): what the resume reads from it comes after
        return self._phoenix is not None or super().restore_checkpoint_after_setup

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if self._phoenix is not None:
            assert self._launcher is not None   # DDPStrategy's always sets one (a subprocess-script launcher here)
            self._launcher = _Relaunch(self._launcher, self._phoenix)

    def configure_ddp(self) -> None:
        p = self._phoenix
        if p is not None and p.ddp is not None and p.ddp.module is self.model:
            self.model = p.ddp            # a survivor back in fit: the DDP module the job protects (no new buckets)
            return
        super().configure_ddp()
        if p is not None and isinstance(self.model, DistributedDataParallel):
            p.ddp = self.model

    def setup_optimizers(self, trainer: Trainer) -> None:
        p = self._phoenix
        if p is not None and p.job is not None:   # back in fit: the optimizers and schedulers the job restored
            return
        super().setup_optimizers(trainer)

    def setup(self, trainer: Trainer) -> None:
        super().setup(trainer)
        if self._phoenix is not None:
            self._phoenix.setup_done(trainer)

    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        p = self._phoenix
        if p is None or p.trainer is None or not p.trainer.training or not isinstance(dataloader, DataLoader) \
                or callable(getattr(dataloader, "state_dict", None)):   # a StatefulDataLoader resumes itself
            return dataloader
        return _ResumableLoader(dataloader, p)

    # the resume's "checkpoint": what the snapshot holds, already restored in place
    def load_checkpoint(self, checkpoint_path: _PATH, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if self._phoenix is None or checkpoint_path != SNAPSHOT:
            return super().load_checkpoint(checkpoint_path, *args, **kwargs)
        return self._phoenix.checkpoint()

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self._phoenix is None or not self._phoenix.resuming:
            super().load_model_state_dict(checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self._phoenix is None or not self._phoenix.resuming:
            super().load_optimizer_state_dict(checkpoint)

    # Between a resume's start and the end of setup a replacement's process group is not connected yet (its
    # collectives complete locally); a survivor's are kept local too, or they would meet the replacement's later ones
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if self._phoenix is None or not self._phoenix.joining:
            super().barrier(*args, **kwargs)

    def broadcast(self, obj: _T, src: int = 0) -> _T:
        if self._phoenix is not None and self._phoenix.joining:
            return obj
        return super().broadcast(obj, src)


class _Relaunch(_Launcher):
    """Lightning's launcher with a loop around fit: a fault the job recovers from re-enters `_fit_impl` as a resume
    from the snapshot, before Lightning's interrupt handling runs."""

    def __init__(self, inner: _Launcher, steps: "_Steps"):
        self.inner, self.steps = inner, steps

    @property
    def is_interactive_compatible(self) -> bool:
        return self.inner.is_interactive_compatible

    def kill(self, signum: int | signal.Signals) -> None:
        # Lightning's SIGTERM handler calls it on the strategy's launcher: the inner one's
        self.inner.kill(signum)

    def launch(self, function: Callable[..., Any], *args: Any, trainer: Trainer | None = None, **kwargs: Any) -> Any:
        p = self.steps
        if getattr(function, "__name__", "") != "_fit_impl":
            return self.inner.launch(function, *args, trainer=trainer, **kwargs)
        assert trainer is not None   # Lightning launches _fit_impl with trainer= (its _call_and_handle_interrupt)
        fit_args = list(args)
        p.attach(trainer)
        if p.job is None and joining_step() is not None:   # a replacement process: fit starts as the resume
            p.begin_resume(trainer, fit_args)
        while True:
            try:
                return self.inner.launch(function, *fit_args, trainer=trainer, **kwargs)
            except Exception as e:   # noqa: BLE001 - the step scope tells a recovery from the script's own error
                if not p.recovered(e):
                    raise
                p.begin_resume(trainer, fit_args)


def _refuse_unsupported(trainer: Trainer, optimizers: int) -> None:
    """What the step boundaries (one training batch, one optimizer step) cannot snapshot, refused in one line."""
    why = None
    if optimizers != 1:
        why = f"the LightningModule configures {optimizers} optimizers; one is supported"
    elif not trainer.lightning_module.automatic_optimization:
        why = "manual optimization is not supported (a batch may make any number of optimizer steps)"
    elif trainer.accumulate_grad_batches != 1:
        why = (f"accumulate_grad_batches={trainer.accumulate_grad_batches} is not supported (the gradients accumulated "
               "between two optimizer steps are not snapshotted)")
    if why:
        raise ValueError(f"phoenixrun.integrations.lightning: {why}; run without hot swap (PHOENIXRUN_PROTECT=0 or "
                         "plain torchrun: torchrun's restart semantics) or see docs/porting.md")


class _Protected:
    """A stateful object snapshotted with every step: its `state_dict()` is taken from `source()`; a restore keeps
    the saved state for Lightning's resume to load."""

    def __init__(self, source: Callable[[], dict[str, Any]]):
        self.source = source
        self.saved: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return self.source()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.saved = state


class _Steps:
    """The protected job inside Lightning's loop, and the state of a resume from its snapshot."""

    def __init__(self, strategy: PhoenixDDPStrategy):
        self.strategy = strategy
        self.trainer: Trainer | None = None
        self.job: Job | None = None
        self.ddp: DistributedDataParallel | None = None
        self.scope: StepScope | None = None
        self.joining = False        # a resume before the end of setup: collectives stay local
        self.resuming = False       # a resume whose "checkpoint" is the snapshot
        self.rng: list[torch.Tensor] | None = None   # the RNG the first resumed step starts from
        self.loop_state = _Protected(self._fit_loop_state)

    def _fit_loop_state(self) -> dict[str, Any]:
        assert self.trainer is not None   # snapshots are taken at step ends, after setup_done() set the trainer
        return self.trainer.fit_loop.state_dict()

    def attach(self, trainer: Trainer) -> None:
        self.trainer = trainer
        # Lightning's callback connector sets Trainer.callbacks in __init__; the class does not declare it
        callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
        if not any(isinstance(c, _StepBoundaries) for c in callbacks):
            callbacks.append(_StepBoundaries(self))

    def begin_resume(self, trainer: Trainer, args: list[Any]) -> None:
        """Make the next `_fit_impl(model, train, val, datamodule, ckpt_path, ...)` a resume from the snapshot."""
        self.joining = self.resuming = True
        while len(args) < 5:
            args.append(None)
        args[4] = SNAPSHOT
        trainer.fit_loop.teardown()   # a survivor's data fetcher: its iterator ran ahead (what a finished fit does)

    def setup_done(self, trainer: Trainer) -> None:
        """The end of the strategy's setup: a first fit protects (a replacement restores here and joins)."""
        self.trainer = trainer
        self.joining = False
        if self.job is not None:
            return
        _refuse_unsupported(trainer, len(self.strategy.optimizers))
        stateful: dict[str, Any] = {"fit_loop": self.loop_state, "precision": self.strategy.precision_plugin}
        for i, config in enumerate(self.strategy.lr_scheduler_configs):
            stateful[f"lr_scheduler{i}"] = config.scheduler
        model = self.strategy.model
        assert model is not None   # the strategy's setup has wrapped the LightningModule (configure_ddp)
        job = protect(model, self.strategy.optimizers[0], stateful=stateful)
        assert isinstance(job, Job)   # _Steps exists only under phoenixrun (init().managed): protect() made a Job
        self.job = job
        if self.resuming:
            self.rng = rng_states()

    def checkpoint(self) -> dict[str, Any]:
        """What Lightning's resume reads, from the snapshot (model, optimizer and the rest are already in place)."""
        loop = self.loop_state.saved
        if loop is None:
            raise RuntimeError("phoenixrun: the restored snapshot holds no fit-loop state")
        return {"pytorch-lightning_version": _pl_version, "state_dict": {}, "optimizer_states": [],
                "loops": {"fit_loop": loop},
                "lr_schedulers": [c.scheduler.state_dict() for c in self.strategy.lr_scheduler_configs]}

    def recovered(self, exc: BaseException) -> bool:
        """`exc` ended fit: True if it was a fault and this rank is restored (every rank then re-enters)."""
        if self.job is None:
            return False
        scope, self.scope = self.scope, None
        if scope is None:                # between two steps (a barrier, the loop's own collectives)
            scope = self.job.step(self.job.next_step)
        if not scope.__exit__(type(exc), exc, exc.__traceback__):
            return False
        self.rng = rng_states()
        return True

    def epoch_start_rng(self) -> None:
        """A resumed epoch begins afresh: its iterator draws from the restored RNG, as the fault-free run's did."""
        if self.rng is not None:
            set_rng_states(self.rng)

    def epoch_started(self) -> None:
        if self.rng is not None:
            self.rng = rng_states()

    def step_begin(self, step: int) -> None:
        if self.resuming:                # the first step of a resume: the RNG the snapshot restored
            self.resuming = False
            if self.rng is not None:
                set_rng_states(self.rng)
            self.rng = None
        assert self.job is not None   # a training batch starts after the strategy's setup made the job
        self.scope = self.job.step(step)
        self.scope.__enter__()

    def step_end(self) -> None:
        scope, self.scope = self.scope, None
        if scope is not None:
            scope.__exit__(None, None, None)


class _ResumableLoader:
    """A train DataLoader as Lightning iterates it, resumable mid-epoch: `state_dict()` is the batches the loop has
    taken this epoch and the generators' states when the epoch's iterator was made; after `load_state_dict()` the
    next epoch's iterator starts at that batch. Everything else is the loader's."""

    def __init__(self, loader: DataLoader[Any], steps: _Steps):
        self.loader, self.steps = loader, steps
        self.rng: list[str] | None = None
        self.resume: dict[str, Any] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["loader"], name)

    def __setattr__(self, name: str, value: object) -> None:   # Lightning's worker_init_fn, say: the loader's
        if name in ("loader", "steps", "rng", "resume"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.loader, name, value)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        if self.resume is None:
            self.rng = generator_states(self.loader)
            return iter(self.loader)
        return _Lazy(self)

    def start(self) -> Iterator[Any]:
        """A resumed epoch's iterator, made at its first batch (after Lightning has set the sampler's epoch)."""
        resume, self.resume = self.resume, None
        assert resume is not None   # __iter__ made the _Lazy that calls this while a resume was pending
        index = int(resume["index"])
        if 0 < index < len(self.loader):
            self.rng = list(resume["rng"])
            return resume_epoch(self.loader, index, self.rng)
        self.steps.epoch_start_rng()        # the epoch's start (the restored step ended the last one)
        self.rng = generator_states(self.loader)
        it = iter(self.loader)
        self.steps.epoch_started()
        return it

    def state_dict(self) -> dict[str, Any]:
        trainer = self.steps.trainer
        assert trainer is not None   # the loader is wrapped only once the trainer is attached (process_dataloader)
        return {"index": trainer.fit_loop.epoch_loop.batch_progress.current.ready, "rng": self.rng}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.resume = dict(state)


class _Lazy:
    def __init__(self, loader: _ResumableLoader):
        self.loader = loader
        self.it: Iterator[Any] | None = None

    def __iter__(self) -> _Lazy:
        return self

    def __next__(self) -> Any:
        if self.it is None:
            self.it = self.loader.start()
        return next(self.it)


class _StepBoundaries(Callback):
    def __init__(self, steps: _Steps):
        self.steps = steps

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.steps.step_begin(trainer.global_step)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: STEP_OUTPUT, batch: Any,
                           batch_idx: int) -> None:
        self.steps.step_end()
