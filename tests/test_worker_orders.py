"""protocol/worker_orders.py: the orders an agent gives its workers cross the channel as the same types."""
from __future__ import annotations

import json

import pytest

from phoenixrun.protocol import worker_orders as wo

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
    with pytest.raises(ValueError, match="worker order 'rebuild'"):
        wo.decode({"op": "rebuild", "generation": 1})
    assert wo.decode({"op": "quiesce", "generation": 1, "extra": True}) == wo.Quiesce(generation=1)
