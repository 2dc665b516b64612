"""Persistent checkpoints: slot image <-> DCP round trip, checksum refusal, completeness and pruning."""
import pytest
import torch
import torch.distributed.checkpoint as dcp

from phoenixrun import persist
from phoenixrun.agents.slots import LocalSlots
from phoenixrun.runtime.snapshot import SlotMap, SnapshotWriter, StateBinding, read_slot, restore_into


def _trained(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        model(torch.randn(5, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.fixture
def sealed_image():
    """A slot written by the real snapshot writer and sealed by the real agent slot store."""
    model, opt = _trained(0)
    b = StateBinding(model, opt)
    writer = SnapshotWriter(b, meta_cap=8192)
    slots = LocalSlots(prefix="phoenixrun-test-persist")
    path = slots.allocate(3, writer.total_len)[0]
    idx = slots.begin_write(3)
    writer.write(SlotMap(path, writer.total_len), step=7, extra={"seen": 42}, param_groups=b.param_groups())
    slots.finish_write(3, idx, 7)
    image = bytearray(slots.view(3, idx))
    slots.clear()
    return model, opt, image


def test_round_trip_rebuilds_the_exact_slot_image(tmp_path, sealed_image):
    model, opt, image = sealed_image
    out = persist.write_rank(tmp_path, 3, image)
    assert out == persist.rank_dir(tmp_path, 7, 3) and (out / ".metadata").exists()
    assert not [p for p in out.parent.iterdir() if ".tmp" in p.name]
    assert persist.read_rank(tmp_path, 7, 3) == image


def test_restored_state_equals_the_original(tmp_path, sealed_image):
    model, opt, image = sealed_image
    persist.write_rank(tmp_path, 3, image)
    back = persist.read_rank(tmp_path, 7, 3)
    f = tmp_path / "slot"
    f.write_bytes(bytes(back))
    slot = SlotMap(str(f))
    h, meta = read_slot(slot, 7)
    model2, opt2 = _trained(1)
    restore_into(slot, h, meta, model2, opt2)
    assert meta["extra"] == {"seen": 42}
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)
    for sa, sb in zip(opt.state.values(), opt2.state.values()):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_plain_script_loads_the_model_with_dcp(tmp_path, sealed_image):
    model, _, image = sealed_image
    persist.write_rank(tmp_path, 3, image)
    fresh, _ = _trained(2)
    sd = {"model": fresh.state_dict()}
    dcp.load(sd, checkpoint_id=str(persist.rank_dir(tmp_path, 7, 3)), no_dist=True)
    fresh.load_state_dict(sd["model"])
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)


def test_damaged_checkpoint_is_refused(tmp_path, sealed_image):
    model, _, image = sealed_image
    out = persist.write_rank(tmp_path, 3, image)
    data = out / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    weights = model[0].weight.detach().numpy().tobytes()
    at = raw.find(weights)
    assert at > 0
    raw[at + len(weights) // 2] ^= 0x01           # one flipped bit in a weight, as bit rot would
    data.write_bytes(bytes(raw))
    with pytest.raises(persist.CheckpointError, match="checksum|unreadable"):
        persist.read_rank(tmp_path, 7, 3)


def test_a_racing_copy_is_not_written(tmp_path, sealed_image):
    _, _, image = sealed_image
    torn = bytearray(image)
    torn[-100] ^= 0xFF                            # the next snapshot overwrote part of it mid-copy
    with pytest.raises(persist.CheckpointError, match="checksum"):
        persist.write_rank(tmp_path, 3, torn)
    assert not persist.rank_dir(tmp_path, 7, 3).exists()


def test_completeness_and_newest():
    on_disk = {10: {0, 1, 2, 3}, 20: {0, 1, 2, 3}, 30: {0, 2, 3}}
    assert persist.complete_steps(on_disk, 4) == [10, 20]
    assert persist.complete_steps(on_disk, 5) == []


def test_newest_complete_reads_the_directory(tmp_path):
    for step, ranks in ((10, (0, 1)), (20, (0, 1)), (30, (1,))):
        for r in ranks:
            persist.rank_dir(tmp_path, step, r).mkdir(parents=True)
    persist.rank_dir(tmp_path, 30, 0).with_name("rank_00000.tmp-1").mkdir()   # half written: not there
    assert persist.newest_complete(tmp_path, 2) == 20
    assert persist.newest_complete(tmp_path, 2, exclude=[20]) == 10
    assert persist.newest_complete(tmp_path / "missing", 2) is None


def test_prune_keeps_the_newest_complete_and_anything_newer():
    on_disk = {10: {0, 1}, 20: {0, 1}, 30: {0, 1}, 35: {0}, 5: {1}}
    # keep 2: steps 20 and 30 stay, 35 (incomplete, may still complete) stays, 10 and 5 go
    assert persist.prune_targets(on_disk, 2, keep=2) == [5, 10]
    assert persist.prune_targets(on_disk, 2, keep=3) == [5]
    assert persist.prune_targets({10: {0}}, 2, keep=1) == []        # nothing complete yet: keep everything


def test_prune_removes_old_steps_with_their_leftovers(tmp_path):
    for step in (10, 20, 30):
        for r in (0, 1):
            persist.rank_dir(tmp_path, step, r).mkdir(parents=True)
    persist.rank_dir(tmp_path, 10, 0).with_name("rank_00000.tmp-9").mkdir()   # a write cut short
    assert persist.prune(tmp_path, 2, keep=2) == [10]
    assert sorted(persist.ranks_on_disk(tmp_path)) == [20, 30]
    assert not persist.step_dir(tmp_path, 10).exists()
