"""The data position phoenixrun snapshots (runtime/data.py): a stream restored from any step's position yields
exactly the batches an uninterrupted stream yields from there - across epochs, for the samplers and loader settings
people use - and a survivor that replays a step on other inputs is caught."""
import json

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

try:
    from torchdata.stateful_dataloader import StatefulDataLoader
except ImportError:   # the integrations extra is not installed
    StatefulDataLoader = None

from phoenixrun.runtime.data import (BatchStream, DataPositionLost, InputWatch, StatefulObjects, decode, encode)

N = 22   # not a multiple of the batch size: a short last batch, epochs of 6 batches


def _dataset():
    return TensorDataset(torch.arange(N))


def _loaders():
    """name -> a factory of the same loader (each run of a 'script' builds its own, as a new process would)."""
    ds = _dataset()
    return {
        "distributed": lambda: DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, 2, 1, shuffle=True, seed=3)),
        "random_global": lambda: DataLoader(ds, batch_size=4, shuffle=True),
        "random_generator": lambda: DataLoader(ds, batch_size=4, shuffle=True,
                                               generator=torch.Generator().manual_seed(11)),
        "sequential_drop_last": lambda: DataLoader(ds, batch_size=4, drop_last=True),
        "workers": lambda: DataLoader(ds, batch_size=4, shuffle=True, num_workers=2),
        "iterable_list": lambda: [torch.tensor([i, i + 1]) for i in range(0, 10, 2)],
        **({"stateful_dataloader": lambda: StatefulDataLoader(ds, batch_size=4, shuffle=True)}
           if StatefulDataLoader is not None else {}),
    }


def _flat(batch) -> list[int]:
    b = batch[0] if isinstance(batch, (list, tuple)) else batch
    return b.tolist()


def _batches(make, steps: int, restore_at: int | None = None) -> list[list[int]]:
    torch.manual_seed(0)
    stream = BatchStream(make())
    out, saved = [], None
    for step in range(steps):
        if step == restore_at:
            saved = (json.loads(json.dumps(stream.position())), torch.get_rng_state())
        out.append(_flat(next(stream)))
        torch.rand(3)                        # the loop's own use of the global RNG (dropout...)
    if restore_at is None:
        return out
    # a replacement: another process's loader, the global RNG elsewhere, then the snapshot's RNG and position
    torch.manual_seed(12345)
    other = BatchStream(make())
    for _ in range(3):
        next(other)                          # a survivor's stream that ran ahead works the same way
    torch.set_rng_state(saved[1])
    other.restore(saved[0])
    replay = []
    for _ in range(restore_at, steps):
        replay.append(_flat(next(other)))
        torch.rand(3)
    return out[:restore_at] + replay


@pytest.mark.parametrize("name", list(_loaders()))
@pytest.mark.parametrize("restore_at", [0, 1, 5, 6, 7, 13])
def test_a_restored_stream_yields_the_uninterrupted_batches(name, restore_at):
    make = _loaders()[name]
    assert _batches(make, 16, restore_at) == _batches(make, 16)


def test_the_stream_is_the_epoch_loop_people_write():
    loader = _loaders()["distributed"]()
    by_hand = []
    for epoch in range(3):
        loader.sampler.set_epoch(epoch)
        by_hand += [_flat(b) for b in loader]
    stream = BatchStream(_loaders()["distributed"]())
    assert [_flat(next(stream)) for _ in range(len(by_hand))] == by_hand
    assert by_hand[:3] != by_hand[3:6]                   # set_epoch reshuffled


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 30), st.integers(1, 3))
def test_any_restore_point_over_several_epochs(restore_at, seed):
    ds = _dataset()

    def make():
        return DataLoader(ds, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(seed))
    assert _batches(make, 31, restore_at) == _batches(make, 31)


def test_stateful_objects_round_trip_exactly():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    objects = StatefulObjects({"scheduler": sched})
    for _ in range(3):
        opt.step()
        sched.step()
    saved = json.loads(json.dumps(objects.capture()))
    want = sched.state_dict()
    for _ in range(4):
        opt.step()
        sched.step()
    objects.restore(saved)
    assert sched.state_dict() == want and sched.get_last_lr() == [0.05]


def test_stateful_objects_refuse_what_cannot_round_trip():
    with pytest.raises(TypeError, match="state_dict"):
        StatefulObjects({"x": object()})

    class Holder:
        def state_dict(self):
            return {"f": lambda: 1}

        def load_state_dict(self, d):
            pass
    with pytest.raises((TypeError, AttributeError), match="x|lambda|pickle"):
        StatefulObjects({"x": Holder()}).capture()


def test_encoded_state_keeps_tuples_and_int_keys():
    obj = {"betas": (0.9, 0.99), 3: torch.arange(3)}
    back = decode(encode(obj))
    assert back["betas"] == (0.9, 0.99) and torch.equal(back[3], torch.arange(3))


def test_a_replay_on_other_inputs_is_caught_and_the_same_inputs_pass():
    watch = InputWatch()
    inputs = {s: torch.full((2, 3), float(s)) for s in range(6)}
    for s in range(5):
        watch.record(s, (inputs[s],), {})
    watch.rollback(3)
    watch.record(3, (inputs[3].clone(),), {})            # the same batch again: fine
    watch.record(4, (inputs[4],), {})
    watch.step_end(3)
    watch.rollback(4)
    watch.record(4, (), {"input_ids": inputs[5]})        # the iterator ran ahead: step 5's batch
    with pytest.raises(DataPositionLost, match="step 4.*protect\\(model, opt, data=loader\\)"):
        watch.step_end(4)                                # caught when the replayed step is over


def test_a_missed_replay_is_caught_at_the_next_step_if_its_end_was_not_seen():
    watch = InputWatch()
    for s in range(3):
        watch.record(s, (torch.full((2,), float(s)),), {})
    watch.rollback(2)
    watch.record(2, (torch.full((2,), 9.0),), {})
    with pytest.raises(DataPositionLost, match="step 2"):
        watch.record(3, (torch.full((2,), 3.0),), {})


def test_a_dry_run_forward_before_the_data_is_not_a_mismatch():
    """A rebuilt pipeline stage runs a shape-inference forward on empty buffers first (a 3D job was stopped)."""
    watch = InputWatch()
    data = {s: torch.full((2, 4), float(s)) for s in range(3)}
    for s in range(3):
        watch.record(s, (data[s],), {})
    watch.rollback(1)
    watch.record(1, (torch.full((2, 4), float("nan")),), {})   # the dry run
    watch.record(1, (data[1].clone(),), {})                    # the data's forward
    watch.step_end(1)
    watch.record(2, (data[2],), {})


def test_a_refilled_buffer_is_compared_by_what_it_held():
    watch = InputWatch()
    buf = torch.zeros(4)
    for s in range(3):
        buf.fill_(s)                                     # the script copies each batch into one buffer
        watch.record(s, (buf,), {})
    watch.rollback(1)
    buf.fill_(1)
    watch.record(1, (buf,), {})                          # step 1's data again: no false alarm
    watch.step_end(1)


def test_large_inputs_are_not_kept():
    watch = InputWatch()
    watch.record(0, (torch.zeros(InputWatch.LIMIT_BYTES // 4 + 1),), {})
    watch.rollback(0)
    watch.record(0, (torch.ones(3),), {})
    watch.step_end(0)                                    # nothing was kept of step 0: nothing to compare


def test_a_loader_that_is_not_iterable_is_refused():
    with pytest.raises(TypeError, match="not iterable"):
        BatchStream(42)
