"""Hot swap for the HF Trainer: `PhoenixTrainer`, a drop-in subclass of `transformers.Trainer`.

    import phoenixrun
    from phoenixrun.integrations.transformers import PhoenixTrainer
    phoenixrun.init()                  # first: TrainingArguments sets up torch.distributed when it is built
    args = TrainingArguments(...)
    trainer = PhoenixTrainer(model=model, args=args, train_dataset=ds)
    trainer.train()

Under plain torchrun (or PHOENIXRUN_PROTECT=0) it is `Trainer`, unchanged. Under phoenixrun each optimizer step
is a protected step: model, optimizer, LR scheduler and RNG are snapshotted at its end (`on_step_end`). On a
recovery every rank - survivors in the processes they already have, replacements in new ones - takes the same way
back into the loop: the Trainer's own resume at the restored step, with the weights, optimizer, scheduler and RNG
from the in-memory snapshot instead of a checkpoint directory. A survivor unwinds out of the interrupted step and
re-enters `train()` in place (no new interpreter, nothing reloaded from disk), so every rank issues the same
collectives in the same order (the Trainer's per-step token count, accelerate's RNG broadcast when an epoch's
loader starts): none is left waiting alone for a peer that replays from elsewhere. The Trainer's resume
fast-forwards the data loader exactly (seeded sampler, skipped batches), as it does for a checkpoint.

Limits (docs/porting.md): DeepSpeed and FSDP through the Trainer are not covered; `state.log_history` restarts at
the restored step; gradient accumulation is covered as the Trainer's resume covers it (an optimizer step is the
unit that is snapshotted and replayed).
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import TYPE_CHECKING, Any

import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import TrainOutput

from phoenixrun.integrations import rng_states, set_rng_states
from phoenixrun.runtime.api import Job, init, joining_step, protect

if TYPE_CHECKING:
    from phoenixrun.runtime.api import StepScope


class PhoenixTrainer(Trainer):
    """`transformers.Trainer` with phoenixrun's hot swap (see the module doc)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phoenix: _Steps | None = None
        if init().managed:
            if self.args.ddp_find_unused_parameters is None:   # the bucket layout a replacement must share
                self.args.ddp_find_unused_parameters = True
            self._phoenix = _Steps(self)
            self.add_callback(_StepBoundaries(self._phoenix))

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any,
              **kwargs: Any) -> TrainOutput:
        p = self._phoenix
        if p is None:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        step = joining_step()           # a replacement process: resume at the step its snapshot holds
        while True:
            with tempfile.TemporaryDirectory(prefix="phoenixrun-resume-") as d:
                if step is not None:
                    p.resuming = self._write_resume_state(d, step)
                try:
                    return super().train(p.resuming or resume_from_checkpoint, *args, **kwargs)
                except Exception as e:   # noqa: BLE001 - the step scope tells a recovery from the script's own error
                    if not p.recovered(e):
                        raise
                    assert p.job is not None   # recovered() is True only with a job
                    step = p.job.next_step   # restored: back into the loop at that step, as every rank does
                finally:
                    p.resuming = None

    def _write_resume_state(self, directory: str, step: int) -> str:
        """What the Trainer's resume reads to fast-forward: the global step (and its logging figures, so it does
        not warn that they changed)."""
        with open(os.path.join(directory, "trainer_state.json"), "w") as f:
            json.dump({"global_step": step, "train_batch_size": self._train_batch_size,
                       "logging_steps": self.args.logging_steps, "eval_steps": self.args.eval_steps,
                       "save_steps": self.args.save_steps}, f)
        return directory

    # the Trainer's resume loads these from the checkpoint directory; here they come from the snapshot
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        if self._phoenix is None or resume_from_checkpoint != self._phoenix.resuming:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        return None

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self._phoenix is None or checkpoint != self._phoenix.resuming:
            return super()._load_optimizer_and_scheduler(checkpoint)
        return None

    def _load_scaler(self, checkpoint: str | None) -> None:
        if self._phoenix is None or checkpoint != self._phoenix.resuming:
            return super()._load_scaler(checkpoint)
        return None

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if self._phoenix is None or checkpoint != self._phoenix.resuming:
            return super()._load_rng_state(checkpoint)
        self._phoenix.put_back_restored_rng()   # after the fast-forward drew from it, as a checkpoint resume does
        return None


class _Steps:
    """The protected job inside the Trainer's loop: a step scope from on_step_begin to on_step_end, and what a
    re-entered loop must find again (RNG, the scheduler's state, the optimizer's hyperparameters) after a restore."""

    def __init__(self, trainer: PhoenixTrainer):
        self.trainer = trainer
        self.job: Job | None = None
        self.scope: StepScope | None = None
        self.resuming: str | None = None
        self._restored_rng: list[torch.Tensor] | None = None
        self._restored_sched: dict[str, Any] | None = None
        self._restored_groups: list[dict[str, Any]] | None = None

    def train_begin(self) -> None:
        t = self.trainer
        # the Trainer's loop has made both before its on_train_begin
        assert t.optimizer is not None and t.lr_scheduler is not None
        if self.job is None:             # the first train(): protect (a replacement restores here)
            job = protect(t.model_wrapped, t.optimizer, stateful={"lr_scheduler": t.lr_scheduler})
            assert isinstance(job, Job)   # _Steps exists only under phoenixrun (init().managed): protect() made a Job
            self.job = job
            self._remember_restored()
            return
        # a survivor back in the loop: the Trainer made a new scheduler (and stepped it once, setting the
        # optimizer's learning rates); the snapshot's values go back in and the job snapshots the new object
        assert self._restored_sched is not None and self._restored_groups is not None   # recovered() kept them
        self.job.position.objects.objects["lr_scheduler"] = t.lr_scheduler
        t.lr_scheduler.load_state_dict(self._restored_sched)
        for group, saved in zip(self.job.optimizer.param_groups, self._restored_groups):
            group.update(saved)

    def _remember_restored(self) -> None:
        t = self.trainer
        assert self.job is not None and t.lr_scheduler is not None   # called once protect() has made the job
        self._restored_rng = rng_states()
        self._restored_sched = t.lr_scheduler.state_dict()
        self._restored_groups = [{k: v for k, v in g.items() if k != "params"}
                                 for g in self.job.optimizer.param_groups]

    def recovered(self, exc: BaseException) -> bool:
        """`exc` ended the loop: True if it was a fault and this rank is restored (every rank then re-enters)."""
        if self.job is None:
            return False
        scope, self.scope = self.scope, None
        if scope is None:                # between two steps (the Trainer's logging collectives, say)
            scope = self.job.step(self.job.next_step)
        if not scope.__exit__(type(exc), exc, exc.__traceback__):
            return False
        self._remember_restored()
        return True

    def put_back_restored_rng(self) -> None:
        if self._restored_rng is not None:
            set_rng_states(self._restored_rng)

    def step_begin(self, step: int) -> None:
        assert self.job is not None   # on_train_begin made it, before the first step
        self.scope = self.job.step(step)
        self.scope.__enter__()

    def step_end(self) -> None:
        scope, self.scope = self.scope, None
        if scope is not None:
            scope.__exit__(None, None, None)


class _StepBoundaries(TrainerCallback):
    def __init__(self, steps: _Steps):
        self.steps = steps

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        self.steps.train_begin()

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        self.steps.step_begin(state.global_step)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        self.steps.step_end()
