"""protocol/worker_orders.py and worker_messages.py: what an agent and its workers tell each other crosses the
channel as the same types, both ways."""
from __future__ import annotations

import json

import pytest

from phoenixrun.protocol import worker_messages as wm
from phoenixrun.protocol import worker_orders as wo
from phoenixrun.protocol.figures import Figures
from phoenixrun.protocol.names import WorkerOp
from phoenixrun.protocol.timings import Timings

ASSIGN = wo.Assign(rank=3, local_rank=1, slot=1, nnodes=2, nproc_per_node=2, world_size=4, generation=5,
                   store_prefix="/p/", restart_count=0, restore_step=None, master_addr="h", master_port=29500,
                   tp=1, pp=1, run_id="r", reshard=None)


@pytest.mark.parametrize("order", [ASSIGN, wo.Rebuild(generation=2, restore_step=7, store_prefix=None,
                                                      master_addr="h", master_port=1),
                                   wo.Quiesce(generation=2), wo.Quiesce(generation=2, at_step=9), wo.ChannelClosed(),
                                   wo.Committed(step=4, h2h_s=0.01, replicated_bytes=9), wo.Committed(step=4),
                                   wo.CommitFailed(step=4, error="peer gone"), wo.Ping(), wo.AbortComm(),
                                   wo.PoisonLoss(), wo.Slow(factor=3.0)])
def test_every_order_round_trips_the_channel(order):
    assert wo.decode(json.loads(json.dumps(order.to_wire()))) == order


def test_the_wire_keeps_its_shape():
    assert wo.Quiesce(generation=2).to_wire() == {"op": "quiesce", "generation": 2}     # no at_step: not a drain
    assert ASSIGN.to_wire()["op"] == "assign" and ASSIGN.to_wire()["rank"] == 3


def test_other_ops_are_not_orders_and_a_missing_field_names_the_order():
    assert wo.decode({"op": "pong"}) is None and wo.decode({"op": 5}) is None
    assert wo.decode({"op": "reply", "id": 1}) is None       # a reply is decoded by its request (below)
    with pytest.raises(ValueError, match="worker channel 'rebuild'"):
        wo.decode({"op": "rebuild", "generation": 1})
    assert wo.decode({"op": "quiesce", "generation": 1, "extra": True}) == wo.Quiesce(generation=1)


@pytest.mark.parametrize("msg", [wm.Hello(local_rank=1, pid=7, api=True), wm.Alloc(nbytes=10, id=3), wm.Slots(id=4),
                                 wm.Write(nbytes=5, id=5), wm.Written(slot=1, step=9, stats=Figures(h2h_s=0.1)),
                                 wm.Progress(step=3), wm.Progress(step=3, step_s=0.5), wm.Pong(),
                                 wm.Quiesced(generation=2, next_step=8),
                                 wm.Resumed(generation=2, timings=Timings(rebuild_s=1.5, state_s=0.25)),
                                 wm.CommError(text="boom", step=4), wm.NanLoss(text="nan", step=4),
                                 wm.ScriptError(text="ValueError: x", step=None), wm.ProtectionMode(every=2, step=6),
                                 wm.Layout(peers=None)])
def test_every_worker_message_round_trips_the_channel(msg):
    assert wm.decode(json.loads(json.dumps(msg.to_wire()))) == msg


def test_every_worker_op_is_a_message_one_way_or_an_order_or_reply_the_other():
    assert set(wm.MESSAGES).isdisjoint(wo.ORDERS)
    assert set(wm.MESSAGES) | set(wo.ORDERS) | {WorkerOp.REPLY.value} == {op.value for op in WorkerOp}


@pytest.mark.parametrize("request_, reply", [
    (wm.Alloc(nbytes=10, id=3), wo.Paths(id=3, paths=["/dev/shm/a", "/dev/shm/b"])),
    (wm.Slots(id=4), wo.Paths(id=4, paths=[])),
    (wm.Write(nbytes=5, id=5), wo.SlotGrant(id=5, slot=1, path="/dev/shm/b", nbytes=4096)),
    (wm.Slots(id=6), wo.Paths(id=6, error="fetch failed", unavailable=True)),
])
def test_each_request_decodes_its_reply_as_the_type_it_names(request_, reply):
    got = request_.decode_reply(json.loads(json.dumps(reply.to_wire())))
    assert got == reply and type(got) is type(request_).REPLY
    assert reply.to_wire()["op"] == "reply"


def test_a_reply_of_another_op_is_a_value_error_and_unknown_fields_are_ignored():
    with pytest.raises(ValueError, match="where the reply to 'slots' was expected"):
        wm.Slots(id=1).decode_reply({"op": "ping"})
    assert wm.Write(id=1).decode_reply({"op": "reply", "id": 1, "extra": 7}) == wo.SlotGrant(id=1)
