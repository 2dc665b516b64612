"""protocol/worker_orders.py and worker_messages.py: what an agent and its workers tell each other crosses the
channel as the same types, both ways."""
from __future__ import annotations

import json

import pytest

from phoenixrun.protocol import worker_messages as wm
from phoenixrun.protocol import worker_orders as wo
from phoenixrun.protocol.names import WorkerOp
from phoenixrun.protocol.timings import Timings

ASSIGN = wo.Assign(rank=3, local_rank=1, slot=1, nnodes=2, nproc_per_node=2, world_size=4, generation=5,
                   store_prefix="/p/", restart_count=0, restore_step=None, master_addr="h", master_port=29500,
                   tp=1, pp=1, run_id="r", reshard=None)


@pytest.mark.parametrize("order", [ASSIGN, wo.Rebuild(generation=2, restore_step=7, store_prefix=None,
                                                      master_addr="h", master_port=1),
                                   wo.Quiesce(generation=2), wo.Quiesce(generation=2, at_step=9), wo.ChannelClosed()])
def test_every_order_round_trips_the_channel(order):
    assert wo.decode(json.loads(json.dumps(order.to_wire()))) == order


def test_the_wire_keeps_its_shape():
    assert wo.Quiesce(generation=2).to_wire() == {"op": "quiesce", "generation": 2}     # no at_step: not a drain
    assert ASSIGN.to_wire()["op"] == "assign" and ASSIGN.to_wire()["rank"] == 3


def test_other_ops_are_not_orders_and_a_missing_field_names_the_order():
    assert wo.decode({"op": "ping"}) is None and wo.decode({"op": 5}) is None
    with pytest.raises(ValueError, match="worker channel 'rebuild'"):
        wo.decode({"op": "rebuild", "generation": 1})
    assert wo.decode({"op": "quiesce", "generation": 1, "extra": True}) == wo.Quiesce(generation=1)


@pytest.mark.parametrize("msg", [wm.Hello(local_rank=1, pid=7, api=True), wm.Alloc(nbytes=10, id=3), wm.Slots(id=4),
                                 wm.Write(nbytes=5, id=5), wm.Written(slot=1, step=9, stats={"h2h_s": 0.1}),
                                 wm.Progress(step=3), wm.Progress(step=3, step_s=0.5), wm.Pong(),
                                 wm.Quiesced(generation=2, next_step=8),
                                 wm.Resumed(generation=2, timings=Timings(rebuild_s=1.5, state_s=0.25)),
                                 wm.CommError(text="boom", step=4), wm.NanLoss(text="nan", step=4),
                                 wm.ScriptError(text="ValueError: x", step=None), wm.ProtectionMode(every=2, step=6),
                                 wm.Stats(stats={"every": 1}), wm.Layout(peers=None)])
def test_every_worker_message_round_trips_the_channel(msg):
    assert wm.decode(json.loads(json.dumps(msg.to_wire()))) == msg


def test_every_worker_op_but_the_agents_orders_has_a_message():
    orders = {o.value for o in (WorkerOp.REPLY, WorkerOp.ASSIGN, WorkerOp.REBUILD, WorkerOp.QUIESCE,
                                WorkerOp.COMMITTED, WorkerOp.COMMIT_FAILED, WorkerOp.PING, WorkerOp.ABORT_COMM,
                                WorkerOp.POISON_LOSS, WorkerOp.SLOW, WorkerOp.AGENT_GONE)}
    assert set(wm.MESSAGES) == {op.value for op in WorkerOp} - orders
