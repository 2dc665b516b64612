"""GPU path of the snapshot engine (run on a machine with CUDA: `make test-gpu`)."""
import pytest
import torch

from phoenixrun.runtime.snapshot import CudaCopier, SlotMap, SnapshotWriter, StateBinding, read_slot, restore_into
from phoenixrun.slot_format import SlotHeader, crc_private, crc_shared

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _seal(slot: SlotMap) -> None:
    # what the agent does on commit: checksums into the header
    mv = slot.memview()
    h = SlotHeader.unpack(mv)
    h = SlotHeader(h.step, h.meta_cap, h.meta_len, h.private_len, h.shared_len, crc_private(mv, h), crc_shared(mv, h))
    slot.buf[:64].copy_(torch.frombuffer(bytearray(h.pack()), dtype=torch.uint8))


def test_cuda_snapshot_round_trip(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 64, device="cuda")).sum().backward()
    opt.step()
    binding = StateBinding(model, opt)
    writer = SnapshotWriter(binding, meta_cap=64 * 1024)
    assert isinstance(writer.copier, CudaCopier)
    path = tmp_path / "slot"
    path.write_bytes(b"\0" * writer.total_len)
    slot = SlotMap(str(path), writer.total_len)
    ready = torch.cuda.Event()
    ready.record()
    writer.write(slot, 1, {"pos": 1}, binding.param_groups(), 1, ready)
    _seal(slot)
    expect = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    h, meta = read_slot(slot, 1)
    restore_into(slot, h, meta, model, opt)
    for k, v in model.state_dict().items():
        assert torch.equal(v, expect[k])
