"""DTensor state in the snapshot: local shards bind as rank-private and are restored in place, on real FSDP2 objects.

One process, a world of 1 (gloo): the DTensors are the ones fully_shard and AdamW build. The end-to-end behaviour
(replaced ranks restore their shards from their own replicas) is tests/test_e2e_fsdp2.py.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, os, sys, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from phoenixrun.slot_format import HEADER_SIZE, SlotHeader, crc_private, crc_shared
    from phoenixrun.runtime.snapshot import SlotMap, SnapshotWriter, StateBinding, read_slot, restore_into
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    model.register_buffer("plain", torch.arange(3.0))         # a plain buffer: shared state, as under DDP
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    def step():
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    step()
    b = StateBinding(model, opt)
    out = {"private": [n for n, _ in b.private], "shared": [n for n, _ in b.shared], "dtensors": b.dtensors}
    w = SnapshotWriter(b, 64 * 1024)
    path = sys.argv[1]
    with open(path, "wb") as f:
        f.truncate(w.total_len)
    slot = SlotMap(path)
    w.write(slot, 1, {}, b.param_groups())
    mv = slot.memview()                                       # seal it, as the agent does
    h = SlotHeader.unpack(mv)
    h = SlotHeader(h.step, h.meta_cap, h.meta_len, h.private_len, h.shared_len, crc_private(mv, h), crc_shared(mv, h))
    slot.buf[:HEADER_SIZE].copy_(torch.frombuffer(bytearray(h.pack()), dtype=torch.uint8))
    def snap():
        sd = opt.state_dict()["state"]
        return ([v.to_local().clone() for v in model.state_dict().values() if isinstance(v, DTensor)],
                {i: {k: (v.to_local() if isinstance(v, DTensor) else v).clone() for k, v in s.items()}
                 for i, s in sd.items()})
    params, state = snap()
    live = [p.to_local() for p in model.parameters()]
    step()                                                    # move on, then roll back to the snapshot
    h, meta = read_slot(slot, 1)
    restore_into(slot, h, meta, model, opt)
    params2, state2 = snap()
    out["params_restored"] = all(torch.equal(a, b) for a, b in zip(params, params2))
    out["state_restored"] = all(torch.equal(state[i][k], state2[i][k]) for i in state for k in state[i])
    out["params_in_place"] = all(a.data_ptr() == p.to_local().data_ptr() for a, p in zip(live, model.parameters()))
    out["state_is_dtensor"] = {k: type(v).__name__ for k, v in opt.state[next(iter(model.parameters()))].items()}
    out["state_placements"] = [str(v.placements) for v in opt.state[next(iter(model.parameters()))].values()
                               if isinstance(v, DTensor)]
    step()                                                    # and it trains on from the restored state
    out["trains_on"] = True
    print(json.dumps(out))
    dist.destroy_process_group()
""")


def test_dtensor_state_binds_as_private_and_restores_in_place(tmp_path):
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "slot")], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    # every DTensor's local shard - parameters and AdamW moments - is private; never in the shared region
    dt = {"model/0.weight", "model/0.bias", "model/1.weight", "model/1.bias"}
    dt |= {f"optim/{i}/{k}" for i in range(4) for k in ("exp_avg", "exp_avg_sq")}
    assert set(out["dtensors"]) == dt
    assert dt <= set(out["private"]) and not dt & set(out["shared"])
    assert out["dtensors"]["model/0.weight"] == {"placements": ["Shard(dim=0)"], "shape": [8, 4], "stride": [4, 1]}
    # plain tensors keep their place: the buffer and AdamW's step counters are shared, the RNG private
    assert set(out["shared"]) == {"model/plain", *(f"optim/{i}/step" for i in range(4))}
    assert "rng/cpu" in out["private"]
    assert out["params_restored"] and out["state_restored"] and out["params_in_place"]
    assert out["state_is_dtensor"] == {"step": "Tensor", "exp_avg": "DTensor", "exp_avg_sq": "DTensor"}
    assert out["state_placements"] == ["(Shard(dim=0),)"] * 2
    assert out["trains_on"]
