"""The GPU paths, on one CUDA GPU (`make test-gpu`; tools/gpu_check.sh runs it on the device machine).

- an NCCL generation's lifecycle on one rank: create, abort mid-collective from another thread, recreate, a
  collective succeeds (multi-rank recovery needs several GPUs: tests/test_generations.py covers the same
  `Generations` logic on CPU);
- the snapshot slot registered as pinned memory (cudaHostRegister);
- the D2H snapshot of a model with >= 1 GB of state overlapped with the next step: step time protected vs
  unprotected (the paper's "zero overhead"), then a bit-exact restore;
- the NVML reads.

Figures go to $PHOENIXRUN_GPU_RESULTS (JSON) when set; docs/benchmarks.md, "GPU", names the command.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from phoenixrun.runtime.snapshot import (CudaCopier, BackgroundCopier, SlotMap, SnapshotWriter, StateBinding,
                                         read_slot, restore_into)
from phoenixrun.slot_format import SlotHeader, crc_private, crc_shared

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

RESULTS: dict = {}


@pytest.fixture(scope="module", autouse=True)
def results_file():
    yield
    path = os.environ.get("PHOENIXRUN_GPU_RESULTS")
    if path and RESULTS:
        RESULTS["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        RESULTS["torch"] = torch.__version__
        Path(path).write_text(json.dumps(RESULTS, indent=2, default=str))


def _seal(slot: SlotMap) -> None:
    # what the agent does on commit: checksums into the header
    mv = slot.memview()
    h = SlotHeader.unpack(mv)
    h = SlotHeader(h.step, h.meta_cap, h.meta_len, h.private_len, h.shared_len, crc_private(mv, h), crc_shared(mv, h))
    slot.buf[:64].copy_(torch.frombuffer(bytearray(h.pack()), dtype=torch.uint8))


def _slot_dir(tmp_path: Path, nbytes: int) -> Path:
    """/dev/shm, where the agent keeps slots, when it has room (a container's may be 64 MB); else the test's dir."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > nbytes * 1.2:
        d = shm / f"phoenixrun-gpu-test-{os.getpid()}"
        d.mkdir(exist_ok=True)
        return d
    return tmp_path


def _slot(directory: Path, name: str, nbytes: int) -> SlotMap:
    path = directory / name
    with open(path, "wb") as f:
        f.truncate(nbytes)
    return SlotMap(str(path), nbytes)


def test_cuda_snapshot_round_trip(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 64, device="cuda")).sum().backward()
    opt.step()
    binding = StateBinding(model, opt)
    writer = SnapshotWriter(binding, meta_cap=64 * 1024)
    assert isinstance(writer.copier, CudaCopier)
    slot = _slot(tmp_path, "slot", writer.total_len)
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


def test_slot_is_registered_as_pinned_memory(tmp_path):
    slot = _slot(_slot_dir(tmp_path, 1 << 26), "pinned", 1 << 26)
    assert not slot.buf.is_pinned()
    copier = CudaCopier(torch.device("cuda"))
    src = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    copier.copy([(slot.buf[:src.numel() * 4].view(torch.float32), src)], slot)
    assert copier.registered(slot) and slot.buf.is_pinned()
    assert torch.equal(slot.buf[:src.numel() * 4].view(torch.float32), src.cpu())
    # a second copier over the same mapping (a new binding after a restore) takes the registration as it is
    again = CudaCopier(torch.device("cuda"))
    again.copy([(slot.buf[:4].view(torch.float32), src[:1])], slot)
    copier.release(slot)
    assert not slot.buf.is_pinned()
    RESULTS["pinned_registration"] = {"bytes": slot.nbytes, "is_pinned_after_register": True}


class Big(torch.nn.Module):
    """Two 8192x8192 layers: 0.54 GB of fp32 parameters, 1.07 GB of AdamW state - 1.6 GB to snapshot a step."""

    def __init__(self, width: int = 8192, depth: int = 2):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def _state_bytes(model, opt) -> int:
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    return n + sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values() if torch.is_tensor(t))


def test_snapshot_of_a_large_model_hides_behind_the_next_step_and_restores_bit_exact(tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = False     # fp32 GEMMs: a step long enough to be a real training step
    torch.manual_seed(0)
    model = Big().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(8192, 8192, device="cuda")

    def step():
        model(x).float().pow(2).mean().backward()

    step()
    opt.step()
    opt.zero_grad(set_to_none=True)
    state = _state_bytes(model, opt)
    assert state >= 1 << 30

    def timed(n, protected, writer=None, slots=None, copier=None, d2h=None):
        times = []
        for i in range(n):
            t0 = time.perf_counter()
            step()
            if protected:
                copier.wait()                 # S_k committed before the optimizer mutates the state (Job's rule)
                assert copier.error is None, copier.error
                d2h.append(copier.last_seconds)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if protected:
                ready = torch.cuda.Event()
                ready.record()
                slot = slots[i % 2]
                writer.b.refresh_volatile()
                copier.submit(lambda slot=slot, k=i, ready=ready:
                              writer.write(slot, k, {"step": k}, writer.b.param_groups(), 1, ready))
            torch.cuda.current_stream().synchronize()   # the training stream only, never the snapshot stream
            times.append(time.perf_counter() - t0)
        return times

    timed(3, False)                                     # warm-up
    unprotected = timed(12, False)
    binding = StateBinding(model, opt)
    writer = SnapshotWriter(binding, meta_cap=1 << 20)
    directory = _slot_dir(tmp_path, 2 * writer.total_len)
    slots = [_slot(directory, f"slot{i}", writer.total_len) for i in range(2)]
    copier, d2h = BackgroundCopier(), []
    try:
        timed(2, True, writer, slots, copier, d2h)      # warm-up: registers both slots
        d2h.clear()
        protected = timed(12, True, writer, slots, copier, d2h)
        copier.wait()
        assert copier.error is None, copier.error
        d2h.append(copier.last_seconds)
        base, prot = statistics.median(unprotected), statistics.median(protected)
        overhead = (prot - base) / base
        RESULTS["snapshot_overlap"] = {
            "state_bytes": state, "slot_bytes": writer.total_len, "slot_dir": str(directory),
            "step_s_unprotected_median": base, "step_s_protected_median": prot, "overhead": overhead,
            "d2h_s_median": statistics.median(d2h), "d2h_GBps": writer.total_len / statistics.median(d2h) / 1e9,
            "steps": {"unprotected": unprotected, "protected": protected}}
        assert statistics.median(d2h) > 0

        # the last snapshot (step 11, in slots[1]) restores bit for bit
        last = 11
        _seal(slots[last % 2])
        expect = {k: v.clone() for k, v in model.state_dict().items()}
        params = list(model.parameters())
        expect_opt = {(i, k): v.clone() for i, p in enumerate(params) for k, v in opt.state[p].items()
                      if torch.is_tensor(v)}
        step()
        opt.step()                                       # move on: the restore must bring the snapshot back
        opt.zero_grad(set_to_none=True)
        found = read_slot(slots[last % 2], last)
        assert found is not None, "the snapshot failed its checksums"
        t0 = time.perf_counter()
        restore_into(slots[last % 2], *found, model, opt)
        torch.cuda.synchronize()
        RESULTS["restore"] = {"h2d_s": time.perf_counter() - t0, "bytes": writer.total_len}
        for k, v in model.state_dict().items():
            assert v.is_cuda and torch.equal(v, expect[k]), k
        for (i, k), v in expect_opt.items():
            got = opt.state[params[i]][k]
            assert torch.equal(got.to(v.device), v), (i, k)
        RESULTS["restore"]["bit_exact"] = True
        # the paper's claim, measured: the copy hides behind the next step's compute
        assert overhead < 0.10, RESULTS["snapshot_overlap"]
    finally:
        for s in slots:
            writer.copier.release(s)
        if str(directory).startswith("/dev/shm"):
            shutil.rmtree(directory, ignore_errors=True)


def test_nccl_generation_cycle_on_one_rank():
    """create -> abort mid-collective from another thread -> recreate -> a collective succeeds, with the real
    ProcessGroupNCCL and the same Generations lifecycle the runtime uses."""
    from phoenixrun.runtime.generations import DeviceRouted, Generations, NcclGeneration
    from phoenixrun.runtime.process_group import GroupRegistry, ReconfigurableProcessGroup
    assert dist.is_nccl_available()
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, use_libuv=True)
    reg = GroupRegistry()
    reg.world = ReconfigurableProcessGroup(0, 1)
    gens = Generations(NcclGeneration, "127.0.0.1", server.port, 0, 1, timedelta(seconds=60), reg)
    out: dict = {}
    t0 = time.perf_counter()
    gens.connect(0, "/gpu-check/gen0/")
    out["create_s"] = time.perf_counter() - t0
    gen0 = gens.current
    assert isinstance(gen0.backend, DeviceRouted)
    t = torch.full((1 << 20,), 2.0, device="cuda")
    reg.world.allreduce([t]).wait()
    torch.cuda.synchronize()
    assert t[0].item() == 2.0
    cpu = torch.ones(4)
    reg.world.allreduce([cpu]).wait()                    # CPU tensors take the generation's gloo side
    assert cpu.sum().item() == 4.0

    big = torch.ones(1 << 26, device="cuda")             # 256 MB a collective: many in flight when abort comes
    errors, done = [], []

    def loop():
        try:
            for _ in range(200):
                reg.world.allreduce([big]).wait()
            torch.cuda.synchronize()
            done.append(True)
        except Exception as e:  # noqa: BLE001 - what an aborted generation raises is the point
            errors.append(f"{type(e).__name__}: {e}")
    th = threading.Thread(target=loop, daemon=True)
    th.start()
    time.sleep(0.05)
    t_abort = time.perf_counter()
    gens.abort()
    th.join(60)
    assert not th.is_alive(), "abort did not end the collectives in flight"
    out["abort_to_return_s"] = time.perf_counter() - t_abort
    out["in_flight_outcome"] = errors[0][:300] if errors else "completed"
    assert gen0.aborted
    try:                                                 # the aborted communicator refuses further work
        gen0.backend.nccl.allreduce([torch.ones(1, device="cuda")]).wait()
        torch.cuda.synchronize()
        out["after_abort"] = "accepted"
    except Exception as e:  # noqa: BLE001
        out["after_abort"] = f"{type(e).__name__}: {e}"[:300]

    t0 = time.perf_counter()
    gens.connect(1, "/gpu-check/gen1/")
    out["recreate_s"] = time.perf_counter() - t0
    assert gen0.destroyed and gens.current.generation == 1
    t = torch.full((1 << 20,), 3.0, device="cuda")
    reg.world.allreduce([t]).wait()
    torch.cuda.synchronize()
    assert t.eq(3.0).all().item()
    gens.close()
    RESULTS["nccl_generation"] = out
    assert out["after_abort"] != "accepted", out


def test_nvml_reads():
    from phoenixrun.faults.health import NvmlHealthSource
    src = NvmlHealthSource(node=0, wait_ms=10)
    try:
        if not src.enabled:
            pytest.skip("NVML not available (pynvml or the driver library missing)")
        rows = src.readings()
        RESULTS["nvml"] = {"readings": rows, "healthy_poll": [s.to_dict() for s in src.poll()]}
        assert rows and all({"gpu", "ecc_uncorrected", "remapped_rows", "recovery_action", "xid_events"} <= set(r)
                            for r in rows)
        assert RESULTS["nvml"]["healthy_poll"] == []        # a healthy GPU reports nothing
    finally:
        src.close()
