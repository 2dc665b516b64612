"""What a training run's position is made of besides model and optimizer: the data stream and other stateful
objects (an LR scheduler, a GradScaler), captured with every snapshot and put back on every recovery.

    job = phoenixrun.protect(model, opt, data=loader, stateful={"scheduler": sched})
    for step in job.steps(total):
        with job.step(step):
            x, y = next(job.batches)      # the loader's batches, epoch after epoch

`BatchStream` is the loader's iterator that phoenixrun owns: it knows how many batches of which epoch it has
handed out, so on a recovery every rank - survivors whose own iterators ran ahead and replacements that start
from nothing - is put at the restored step's batch, and the replay sees exactly a fault-free run's batches. Under
plain torchrun it is the same stream without the snapshots, so both runs see the same batches.

`InputWatch` catches the loops that keep their own iterator: on a replayed step a survivor compares the first
forward's inputs with those it fed the same step before the fault; different inputs mean its data position was
not restored, and the job stops instead of finishing on the wrong batches.
"""
from __future__ import annotations

import base64
import io
import logging
from typing import Any, Callable, Iterable, Iterator, Mapping, Sized, cast

import torch
from torch.utils.data import DataLoader

log = logging.getLogger("phoenixrun.runtime")

# A loop's loader: any iterable of batches (a DataLoader, accelerate's, torchdata's StatefulDataLoader, a plain
# iterable). What it may offer beyond iteration (sampler, set_epoch, state_dict...) is looked up by duck typing.
Loader = Iterable[Any]
# skip(loader, n) -> the loader's current epoch from its batch n (an adapter's own; see skip_batches)
Skip = Callable[[Any, int], Iterable[Any]]

_POSITION_FIX = ("hand the loader to phoenixrun: protect(model, opt, data=loader) and take each step's batch with "
                 "next(job.batches); or restore the position yourself in @job.on_restore (docs/porting.md)")


class DataPositionLost(RuntimeError):
    """A survivor replayed a step on other inputs than it ran the step with before the fault: the script's data
    iterator was not put back at the restored step. Not recoverable by a hot swap; the job stops (docs/porting.md)."""


# ---------------------------------------------------------------------------------------------- encoding
def encode(obj: Any) -> str:
    """A state_dict (tensors, tuples, int keys kept as they are) as one ASCII string for the snapshot's metadata."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def decode(text: str) -> Any:
    """The inverse of `encode`; only plain containers, numbers and tensors load (`weights_only`): a snapshot or a
    replica from a peer never runs code."""
    return torch.load(io.BytesIO(base64.b64decode(text)), weights_only=True)


def _generator_state(g: torch.Generator) -> str:
    return base64.b64encode(g.get_state().numpy().tobytes()).decode("ascii")


def _set_generator_state(g: torch.Generator, text: str) -> None:
    g.set_state(torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8))


# ---------------------------------------------------------------------------------------------- data stream
def _owners(loader: object) -> list[object]:
    """The loader and the samplers inside it (a DataLoader's sampler and batch sampler, accelerate's sharded batch
    sampler around them), each once."""
    found: list[object] = []
    todo: list[object] = [loader]
    while todo:
        obj = todo.pop(0)
        if obj is None or any(obj is f for f in found) or len(found) > 8:
            continue
        found.append(obj)
        todo += [getattr(obj, a, None) for a in ("sampler", "batch_sampler")]
    return found


def _generators(loader: object) -> list[torch.Generator]:
    """Every generator a new iterator of `loader` may draw from, the global one first (a DataLoader draws its
    workers' base seed from loader.generator or the global one; a RandomSampler from its own or the global one;
    accelerate's loader broadcasts its `synchronized_generator`)."""
    found: list[torch.Generator] = [torch.default_generator]
    for owner in _owners(loader):
        for name in ("generator", "synchronized_generator"):
            g = getattr(owner, name, None)
            if isinstance(g, torch.Generator) and all(g is not f for f in found):
                found.append(g)
    return found


def _set_epoch(loader: object, epoch: int) -> None:
    """What an epoch loop over a DistributedSampler does: `sampler.set_epoch(epoch)` before iterating. A loader
    with its own `set_epoch` (accelerate's) is told instead: it passes the epoch on itself."""
    for owner in _owners(loader):
        set_epoch = getattr(owner, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
            if owner is loader:
                return


class _SkipFirst:
    """A batch sampler without its first `n` batches: skipping indices, not loading the batches."""

    def __init__(self, batch_sampler: Iterable[list[int]], n: int):
        self.batch_sampler, self.n = batch_sampler, n

    def __iter__(self) -> Iterator[list[int]]:
        for i, batch in enumerate(self.batch_sampler):
            if i >= self.n:
                yield batch

    def __len__(self) -> int:
        # a batch sampler without a length: TypeError, as the loader's own len() raises
        return max(0, len(cast(Sized, self.batch_sampler)) - self.n)


def skip_batches(loader: Loader, n: int) -> Iterator[Any]:
    """An iterator over `loader`'s current epoch from its batch `n`. A plain DataLoader over a batch sampler skips
    at the index level (a twin loader on the same dataset, sampler and workers settings); any other loader is
    iterated and its first `n` batches dropped."""
    if type(loader) is DataLoader and loader.batch_sampler is not None:
        twin = DataLoader(loader.dataset, batch_sampler=_SkipFirst(loader.batch_sampler, n),
                          num_workers=loader.num_workers, collate_fn=loader.collate_fn, pin_memory=loader.pin_memory,
                          timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
                          multiprocessing_context=loader.multiprocessing_context, generator=loader.generator,
                          prefetch_factor=loader.prefetch_factor if loader.num_workers else None,
                          in_order=getattr(loader, "in_order", True))
        return iter(twin)
    it = iter(loader)
    for _ in range(n):
        next(it)
    return it


def generator_states(loader: object) -> list[str]:
    """The states of every generator a new iterator of `loader` may draw from (`_generators`): taken when an epoch's
    iterator is made, they are what `resume_epoch` needs to draw that epoch again."""
    return [_generator_state(g) for g in _generators(loader)]


def resume_epoch(loader: Loader, index: int, rng: list[str], skip: Skip | None = None) -> Iterator[Any]:
    """`loader`'s current epoch from its batch `index`, drawn as the epoch was: the generators are set to `rng`
    (`generator_states` when the epoch's iterator was made), the sampler's order is drawn and the first remaining batch
    taken (`skip`, else `skip_batches`); the global generator is then put back as it was. Empty when the epoch had no
    batch left."""
    now = torch.default_generator.get_state()
    for g, state in zip(_generators(loader), rng):
        _set_generator_state(g, state)
    it = iter(skip(loader, index)) if skip else skip_batches(loader, index)
    try:
        first = next(it)             # the sampler draws its order now, under the epoch's generator state
    except StopIteration:            # the restored step had used the epoch's last batch
        first, it = None, iter(())
    torch.default_generator.set_state(now)
    return it if first is None else _Prepend(first, it)


class BatchStream:
    """The batches of `loader`, epoch after epoch, at a position phoenixrun snapshots and restores.

    At the start of every epoch it calls `set_epoch(epoch)` on the loader's sampler (a DistributedSampler's
    shuffle), as an epoch loop would. A loader with `state_dict`/`load_state_dict` (torchdata's
    StatefulDataLoader) is restored through them; any other loader by starting its epoch again from the state its
    random generators had when the epoch began, and skipping the batches the restored step had already used.
    """

    def __init__(self, loader: Loader, skip: Skip | None = None):
        if not hasattr(loader, "__iter__"):
            raise TypeError(f"phoenixrun.protect(data=...): {type(loader).__name__} is not iterable; pass the "
                            "DataLoader (or any iterable of batches) the loop takes its batches from")
        self.loader: Any = loader   # duck-typed beyond iteration (Loader): its state_dict and load_state_dict
        # accelerate's loaders have both methods, and load_state_dict works only over a StatefulDataLoader
        self.stateful = callable(getattr(loader, "state_dict", None)) and callable(
            getattr(loader, "load_state_dict", None)) and getattr(loader, "use_stateful_dataloader", True)
        self._skip = skip
        self.epoch, self.index = 0, 0     # the next batch is batch `index` of epoch `epoch`
        self._it: Iterator[Any] | None = None
        self._rng: list[str] | None = None   # the generators' states when this epoch's iterator was made
        self._resume: dict[str, Any] | None = None      # a restored position not yet acted on (at the next batch)

    def __iter__(self) -> "BatchStream":
        return self

    def __next__(self) -> Any:
        if self._resume is not None:
            self._reposition(self._resume)
        it = self._it if self._it is not None else self._begin_epoch()
        try:
            batch = next(it)
        except StopIteration:
            if self.index == 0:
                raise RuntimeError(f"phoenixrun: the data loader yielded no batch in epoch {self.epoch}") from None
            self.epoch, self.index = self.epoch + 1, 0
            batch = next(self._begin_epoch())
        self.index += 1
        return batch

    def _begin_epoch(self) -> Iterator[Any]:
        """The new epoch's iterator (now `_it`)."""
        _set_epoch(self.loader, self.epoch)
        self._rng = generator_states(self.loader)
        it: Iterator[Any] = iter(self.loader)
        self._it = it
        return it

    def position(self) -> dict[str, Any]:
        """Where the stream stands between two steps: JSON-able, a few KB (the generators' states: at the start of
        the current epoch, or now when the next batch begins one)."""
        pos: dict[str, Any] = {"epoch": self.epoch, "index": self.index}
        if self.stateful:
            pos["loader"] = encode(self.loader.state_dict())
        else:
            pos["rng"] = self._rng if self._it is not None and self._rng is not None else \
                generator_states(self.loader)
        return pos

    def restore(self, pos: Mapping[str, Any]) -> None:
        """Put the stream at `pos` (from `position()` in any rank's run of the same script): acted on at the next
        batch, once the rest of the snapshot (the global RNG among it) is back in place."""
        self._resume = dict(pos)
        self._it = None

    def _reposition(self, pos: dict[str, Any]) -> None:
        self._resume = None
        self.epoch, self.index = int(pos["epoch"]), int(pos["index"])
        if self.stateful and "loader" in pos:
            _set_epoch(self.loader, self.epoch)
            self.loader.load_state_dict(decode(pos["loader"]))
            self._rng, self._it = None, iter(self.loader)
            return
        # The generators go back to their states at the epoch's start (or, between epochs, at the snapshot), so the
        # sampler draws the same order and the workers the same base seed; the global one then returns to the
        # restored step's state, which the snapshot set.
        if self.index == 0:              # the epoch is begun at the next batch, as a fault-free run begins it
            now = torch.default_generator.get_state()
            for g, state in zip(_generators(self.loader), pos.get("rng", [])):
                _set_generator_state(g, state)
            torch.default_generator.set_state(now)
            return
        _set_epoch(self.loader, self.epoch)
        self._rng = list(pos["rng"])
        # empty when the restored step had used the epoch's last batch: the next batch begins the next epoch
        self._it = resume_epoch(self.loader, self.index, self._rng, self._skip)


class _Prepend:
    def __init__(self, first: Any, rest: Iterator[Any]):
        self.first, self.rest, self.used = first, rest, False

    def __iter__(self) -> _Prepend:
        return self

    def __next__(self) -> Any:
        if not self.used:
            self.used = True
            return self.first
        return next(self.rest)


# ---------------------------------------------------------------------------------------------- other objects
class StatefulObjects:
    """Named objects with `state_dict()`/`load_state_dict()` (LR schedulers, a GradScaler, a data stream's own
    helpers) snapshotted with every step and loaded on every recovery."""

    def __init__(self, objects: Mapping[str, Any] | None):
        objects = dict(objects or {})
        for name, obj in objects.items():
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise TypeError(f"phoenixrun.protect(stateful={{{name!r}: ...}}): a {type(obj).__name__} has no "
                                "state_dict()/load_state_dict(); keep what it holds in `state` instead")
        self.objects = objects
        self._checked = False

    def capture(self) -> dict[str, str]:
        out = {name: encode(obj.state_dict()) for name, obj in self.objects.items()}
        if not self._checked:   # once: what cannot be loaded back safely is refused now, not at a recovery
            for name, text in out.items():
                try:
                    decode(text)
                except Exception as e:   # noqa: BLE001 - torch names what it refused
                    raise TypeError(f"phoenixrun.protect(stateful={{{name!r}: ...}}): its state_dict() holds more "
                                    f"than containers, numbers and tensors ({e}); keep that part in `state`") from None
            self._checked = True
        return out

    def restore(self, saved: Mapping[str, str]) -> None:
        for name, obj in self.objects.items():
            if name in saved:
                obj.load_state_dict(decode(saved[name]))
            else:
                log.warning("phoenixrun: the restored snapshot holds no state for %r (protect(stateful=...) "
                            "changed?); it keeps its current state", name)


# ---------------------------------------------------------------------------------------------- the check
def _tensors(obj: object, out: list[torch.Tensor], depth: int = 0) -> list[torch.Tensor]:
    if torch.is_tensor(obj):
        out.append(obj)
    elif depth < 4 and isinstance(obj, (list, tuple)):
        for v in obj:
            _tensors(v, out, depth + 1)
    elif depth < 4 and isinstance(obj, Mapping):
        for v in obj.values():
            _tensors(v, out, depth + 1)
    return out


def _same(kept: list[torch.Tensor], now: list[torch.Tensor]) -> bool:
    return len(kept) == len(now) and all(
        a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b.detach().to(a.device)) for a, b in zip(kept, now))


class InputWatch:
    """Keeps a copy of the first forward's inputs of the last few steps and, when a recovery replays one of them,
    looks for those inputs among the replayed step's forwards.

    A copy, not a reference: a pipeline stage receives into buffers it reuses, and a script may refill one input
    buffer, so a reference shows a later step's data by the time of a recovery. Among the forwards, not only the
    first: a rebuilt pipeline stage runs a shape-inference forward on empty buffers before the data's (both seen
    stopping a correct 3D job). Inputs over LIMIT_BYTES are not kept, nor checked: the copy is an asynchronous
    device-to-device (or host) copy of a token batch in the common case, a few KB a step."""

    KEEP = 3
    LIMIT_BYTES = 4 << 20

    def __init__(self) -> None:
        self._seen: dict[int, list[torch.Tensor] | None] = {}   # step -> copies of its first forward's input tensors
        self._expect: tuple[int, list[torch.Tensor]] | None = None   # the replayed step, and the inputs it ran with before
        self._missed = False                       # a forward of the replayed step ran on other inputs

    def record(self, step: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """At a forward inside step `step`."""
        if self._expect is not None:
            self._check(step, args, kwargs)
        if step in self._seen:
            return
        tensors = _tensors((args, kwargs), [])
        size = sum(t.numel() * t.element_size() for t in tensors)
        self._seen[step] = [t.detach().clone() for t in tensors] if 0 < size <= self.LIMIT_BYTES else None
        for old in [s for s in self._seen if s <= step - self.KEEP]:
            del self._seen[old]

    def _check(self, step: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        assert self._expect is not None   # record() checks only while a replayed step is expected
        replayed, kept = self._expect
        if step == replayed:
            if _same(kept, _tensors((args, kwargs), [])):
                self._expect, self._missed = None, False   # the replay runs on the fault-free inputs
            else:
                self._missed = True
        elif step > replayed:
            self.step_end(replayed)

    def step_end(self, step: int) -> None:
        """Step `step` is over: if it was the replayed one, its inputs must have come back among its forwards."""
        if self._expect is None or self._expect[0] != step:
            return
        if self._missed:
            replayed = self._expect[0]
            raise DataPositionLost(
                f"step {replayed} was replayed on other inputs than this rank ran it with before the recovery: the "
                f"loop's data iterator was not put back at step {replayed}, and going on would train on other "
                f"batches than a fault-free run. Fix: {_POSITION_FIX}.")
        self._expect, self._missed = None, False

    def rollback(self, step: int) -> None:
        """A recovery restored step `step`, which is run again: look for what it ran with before."""
        kept = self._seen.get(step)
        self._expect, self._missed = ((step, kept) if kept is not None else None), False
        self._seen = {}


# ---------------------------------------------------------------------------------------------- together
class RunPosition:
    """What a snapshot holds besides model, optimizer and `state` (the data stream's position, the stateful
    objects), and the survivors' input check that a restore rolls back with them."""

    def __init__(self, stream: BatchStream | None, objects: StatefulObjects, watch: InputWatch | None):
        self.stream, self.objects, self.watch = stream, objects, watch

    def capture(self) -> dict[str, Any]:
        out: dict[str, Any] = {"stateful": self.objects.capture()}
        if self.stream is not None:
            out["data"] = self.stream.position()
        return out

    def restore(self, saved: Mapping[str, Any], step: int) -> None:
        """Put everything back at the snapshot of `step` (`saved`: what `capture()` gave at that step)."""
        self.objects.restore(saved.get("stateful", {}))
        if self.stream is not None:
            if "data" not in saved:
                raise RuntimeError(f"the snapshot of step {step} holds no data position (taken by a script that "
                                   "gave protect() no loader?): refusing to guess it")
            self.stream.restore(saved["data"])
        if self.watch is not None:
            self.watch.rollback(step)

    def forward(self, step: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A forward inside step `step` (the input check; see InputWatch)."""
        if self.watch is not None:
            self.watch.record(step, args, kwargs)

    def step_end(self, step: int) -> None:
        """Step `step` is over, before its snapshot: a replay on other inputs raises DataPositionLost here."""
        if self.watch is not None:
            self.watch.step_end(step)

    @property
    def batches(self) -> BatchStream:
        if self.stream is None:
            raise AttributeError("job.batches: protect() was given no loader; call phoenixrun.protect(model, opt, "
                                 "data=loader) to have phoenixrun own the loader's position")
        return self.stream
