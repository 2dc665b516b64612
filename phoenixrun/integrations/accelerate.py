"""Hot swap for an accelerate loop: one call after `accelerator.prepare(...)`.

    phoenixrun.init()                                   # before Accelerator(): the job's process group is phoenixrun's
    accelerator = Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    job = phoenixrun.integrations.accelerate.protect(accelerator, model, opt, dataloader=loader, scheduler=sched)
    for step in job.steps(total):
        with job.step(step):
            batch = next(job.batches)                   # the prepared loader's batches, epoch after epoch
            loss = model(**batch).loss
            accelerator.backward(loss)
            opt.step(); sched.step(); opt.zero_grad()

The prepared optimizer (AcceleratedOptimizer) is protected through the torch optimizer it wraps; the prepared
scheduler and anything in `stateful` are snapshotted with every step; the prepared loader is repositioned on every
recovery with accelerate's own `skip_first_batches` (sampler indices skipped, no batch loaded twice), on every rank
at once, so the RNG broadcast accelerate's loader makes when an epoch begins is made by every rank together.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch

from phoenixrun.runtime.api import Job, PassThroughJob, protect as _protect_job
from phoenixrun.runtime.data import Loader, Skip


class _Accelerator(Protocol):
    """What is used of `accelerate.Accelerator` (accelerate ships no type information)."""

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Iterable[Any]: ...


def protect(accelerator: _Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            dataloader: Loader | None = None, scheduler: object | None = None, state: dict[str, Any] | None = None,
            stateful: dict[str, Any] | None = None, every: int = 1) -> "Job | PassThroughJob":
    """phoenixrun.protect() for objects `accelerator.prepare()` returned; see the module doc."""
    objects = dict(stateful or {})
    if scheduler is not None:
        if "scheduler" in objects:
            raise ValueError("phoenixrun.integrations.accelerate.protect: 'scheduler' is given twice (as scheduler= "
                             "and in stateful=); name the other object differently")
        objects["scheduler"] = scheduler
    skip: Skip | None = None
    if dataloader is not None:
        skip = accelerator.skip_first_batches
    return _protect_job(model, optimizer, state=state, every=every, data=dataloader, stateful=objects,
                        skip=skip)
