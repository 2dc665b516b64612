"""The snapshot engine: copy a rank's state into its agent-owned slot every step, off the hot path.

The layout is computed when the state is bound: each live tensor (optimizer shard state, RNG,
parameters) gets a fixed offset in the slot, so a snapshot is a sequence of plain copies into
pre-faulted shared memory, no pickling. It is computed again only when the state outgrows it (the
metadata - mostly the script's state dict - past its capacity, or optimizer state that appears late). On CPU the copy runs on a background thread (tensor copies release the
GIL) and overlaps the next forward/backward; on CUDA it would be one async D2H copy on a side
stream into the mapping registered as pinned memory (`CudaCopier`).
"""
from __future__ import annotations

import ctypes
import json
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, TypedDict

import torch

from phoenixrun.runtime.layout_check import is_dtensor, placement_name
from phoenixrun.testing import pause_point
from phoenixrun.slot_format import (HEADER_SIZE, Entry, SlotHeader, crc_private, crc_shared, grown_capacity,
                                    slot_bytes)

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

# the dtype names slot metadata records (`Entry.dtype`, str(torch.dtype)) -> the dtype
DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                              torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


def entry_view(buf: torch.Tensor, region_off: int, e: Entry) -> torch.Tensor:
    """The tensor `e` describes, as a view of `buf` (a slot image as uint8) whose region starts at `region_off`."""
    start = region_off + e.offset
    return buf[start:start + e.nbytes].view(DTYPES[e.dtype]).view(e.shape)


def _is_zero(optimizer: torch.optim.Optimizer) -> bool:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    return isinstance(optimizer, ZeroRedundancyOptimizer)


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's state (ZeRO's local shard optimizer)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        local: torch.optim.Optimizer = optimizer.optim
        return local
    return optimizer


class DTensorRecord(TypedDict):
    """A DTensor entry's layout as the slot metadata records it (`meta["dtensors"][name]`)."""
    placements: list[str]
    shape: list[int]
    stride: list[int]


class StateBinding:
    """Where each live tensor of the rank goes: private (replicated) or shared (DP-redundant).

    DTensors (FSDP2 / HSDP / tensor-parallel parameters, buffers and optimizer state): their local shard is
    rank-private unless protect() proved otherwise. A recovery takes shared state from the plan's peer, and
    for a sharded DTensor a data-parallel peer of the --tp/--pp layout holds another shard; so by default every
    local shard is snapshotted into the private region, replicated with it, and restored in place from the
    rank's own replica. Where every rank's DTensors live on one world mesh and a rank on another node has the
    same coordinates along every dimension they are sharded over (HSDP with the replicate dimension across
    nodes; TP with DP peers across nodes: layout_check.dtensor_verdict), they go to the shared region
    instead, and the plan takes them from such a peer (the runtime tells the master the peer set). `dtensors` records each one's global shape, stride and placements, so the
    restore can check it lands in the same layout and re-wrap optimizer state with its parameter's mesh."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, peer_shared: bool = True,
                 dtensor_shared: bool = False):
        self.model, self.optimizer = model, optimizer
        # dtensor_shared (protect() proved every rank's DTensor shards have an identical copy on another node:
        # layout_check.dtensor_verdict): local shards go to the shared region, taken from that peer on recovery
        self.dtensor_shared = dtensor_shared
        self.local_opt = local_optimizer(optimizer)
        # peer_shared=False (protect() found plain state its DP peers may not hold: runtime/layout_check.py):
        # every tensor is rank-private and the shared region is empty
        self.peer_shared = peer_shared
        # Optimizer state is rank-private only when it is sharded (ZeRO); a plain optimizer under DDP
        # is identical on every DP peer, so it travels with the parameters and is never replicated.
        self.optimizer_private = _is_zero(optimizer) or not peer_shared
        self.private: list[tuple[str, torch.Tensor]] = []
        self.shared: list[tuple[str, torch.Tensor]] = []
        self.scalars: dict[str, Any] = {}
        self.dtensors: dict[str, DTensorRecord] = {}
        opt_sd = self.local_opt.state_dict()
        opt_list = self.private if self.optimizer_private else self.shared
        for idx, st in opt_sd["state"].items():
            for k, v in st.items():
                if torch.is_tensor(v):
                    self._add(f"optim/{idx}/{k}", v, opt_list)
                else:
                    self.scalars[f"{idx}/{k}"] = v
        for name, t in model.state_dict().items():
            self._add(f"model/{name}", t, self.shared if peer_shared else self.private)
        self.private.append(("rng/cpu", torch.get_rng_state()))
        cuda_ready = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        self._cuda_rng = torch.cuda.is_available() and cuda_ready
        if self._cuda_rng:
            self.private += [(f"rng/cuda{i}", s) for i, s in enumerate(torch.cuda.get_rng_state_all())]
        # param group hyperparameters in state_dict() form, without packing the state every step
        self._group_params = [g["params"] for g in opt_sd["param_groups"]]
        self._state_count = self.state_count()
        self.private_entries = _entries(self.private)
        self.shared_entries = _entries(self.shared)
        self.signature = (tuple(e.to_json().__repr__() for e in self.private_entries),
                          tuple(e.to_json().__repr__() for e in self.shared_entries))

    def _add(self, name: str, t: torch.Tensor, otherwise: list[tuple[str, torch.Tensor]]) -> None:
        """A DTensor's local shard goes to the private region (see the class doc), or the shared one where protect()
        proved a peer on another node holds the same bytes; any other tensor to `otherwise`."""
        if not is_dtensor(t):
            otherwise.append((name, t))
            return
        placements = [placement_name(p) for p in t.placements]
        partial = [p for p in placements if p.startswith("Partial")]
        if partial:   # protect() refuses these first (layout_check); a binding must never snapshot one either
            raise ValueError(f"{name} is a DTensor with a pending reduction ({', '.join(partial)}): its local "
                             "tensor is not state that can be restored")
        self.dtensors[name] = {"placements": placements, "shape": list(t.shape), "stride": list(t.stride())}
        (self.shared if self.dtensor_shared else self.private).append((name, t.to_local()))

    def state_count(self) -> tuple[int, int]:
        """How many parameters have optimizer state, and how many entries in all (cheap: no tensors touched)."""
        st = self.local_opt.state
        return len(st), sum(len(v) for v in st.values())

    def stale(self) -> bool:
        """The optimizer state gained or lost entries since binding (state created lazily for a parameter that
        got its first gradient late, a param group added): the snapshot layout must be computed again."""
        return self.state_count() != self._state_count

    def refresh_volatile(self) -> None:
        """Tensors that are re-created rather than updated in place (RNG states)."""
        rng = [("rng/cpu", torch.get_rng_state())]
        if self._cuda_rng:
            rng += [(f"rng/cuda{i}", s) for i, s in enumerate(torch.cuda.get_rng_state_all())]
        self.private[len(self.private) - len(rng):] = rng

    def param_groups(self) -> list[dict[str, Any]]:
        return [{**{k: v for k, v in g.items() if k != "params"}, "params": ids}
                for g, ids in zip(self.local_opt.param_groups, self._group_params)]

    def nbytes(self) -> tuple[int, int]:
        return (sum(e.nbytes for e in self.private_entries), sum(e.nbytes for e in self.shared_entries))


def _entries(items: list[tuple[str, torch.Tensor]]) -> list[Entry]:
    out, off = [], 0
    for name, t in items:
        n = t.numel() * t.element_size()
        out.append(Entry(name, str(t.dtype), tuple(t.shape), off, n))
        off += (n + 63) // 64 * 64
    return out


def _region_len(entries: list[Entry]) -> int:
    return entries[-1].offset + entries[-1].nbytes if entries else 0


class SlotMap:
    """A worker's mapping of one agent-owned slot file."""

    def __init__(self, path: str, nbytes: int | None = None):
        import os
        self.path = path
        self.nbytes = nbytes or os.path.getsize(path)
        self.buf = torch.from_file(path, shared=True, size=self.nbytes, dtype=torch.uint8)

    def memview(self) -> ctypes.Array[ctypes.c_uint8]:
        return (ctypes.c_uint8 * self.nbytes).from_address(self.buf.data_ptr())

    def view(self, region_off: int, e: Entry) -> torch.Tensor:
        return entry_view(self.buf, region_off, e)


class SnapshotWriter:
    """Writes S_k into a slot: header, metadata, private region, shared region.

    The layout is (meta_cap, private region, shared region). `meta_cap` grows (`fit`) when the metadata -
    mostly the script's state dict, which may grow every step - outgrows it; the tensor regions follow the
    binding (a new binding when the optimizer state changes). Each slot's header records the layout it was
    written with, so slots of different layouts coexist (slot_format.py)."""

    def __init__(self, binding: StateBinding, meta_cap: int):
        self.b = binding
        self.private_len, self.shared_len = _region_len(binding.private_entries), _region_len(binding.shared_entries)
        self.meta_cap = meta_cap
        # the part of the metadata fixed by the binding, encoded once (per step only the state dict and the
        # param groups are)
        self._meta_tail = json.dumps({
            "scalars": binding.scalars, "optimizer_private": binding.optimizer_private, "dtensors": binding.dtensors,
            "peer_shared": binding.peer_shared, "dtensor_shared": binding.dtensor_shared,
            "private": [e.to_json() for e in binding.private_entries],
            "shared": [e.to_json() for e in binding.shared_entries]})[1:]
        cuda = [t for _, t in binding.private + binding.shared if t.is_cuda]
        self.copier = CudaCopier(cuda[0].device) if cuda else CpuCopier()

    @property
    def total_len(self) -> int:
        """Bytes a slot needs for the current layout."""
        return slot_bytes(self.meta_cap, self.private_len, self.shared_len)

    def encode_meta(self, step: int, extra_json: str, param_groups: list[dict[str, Any]], every: int = 1,
                    objects_json: str = "{}") -> bytes:
        """The metadata of S_step; `extra_json` is the script's state dict, `objects_json` the data position and
        stateful objects (runtime/data.py), both already JSON."""
        head = json.dumps({"step": step, "every": every, "param_groups": param_groups})
        return f'{head[:-1]}, "extra": {extra_json}, "objects": {objects_json}, {self._meta_tail}'.encode()

    def fit(self, meta_len: int) -> bool:
        """Make room for `meta_len` bytes of metadata: True if the layout grew (geometric headroom)."""
        if meta_len <= self.meta_cap:
            return False
        self.meta_cap = grown_capacity(self.meta_cap, meta_len)
        return True

    def write(self, slot: SlotMap, step: int, extra: dict[str, Any], param_groups: list[dict[str, Any]], every: int = 1,
              ready: "torch.cuda.Event | None" = None) -> None:
        """`ready`: on CUDA, an event recorded after the optimizer step on the training stream."""
        meta = self.encode_meta(step, json.dumps(extra), param_groups, every)
        self.fit(len(meta))
        self.write_encoded(slot, step, meta, self.meta_cap, ready)

    def write_encoded(self, slot: SlotMap, step: int, meta: bytes, meta_cap: int,
                      ready: "torch.cuda.Event | None" = None) -> None:
        """Write S_step with metadata `meta` laid out for `meta_cap` (the capacity `fit` chose for this snapshot,
        passed along: the training thread may grow the writer's for the next one meanwhile)."""
        b = self.b
        if len(meta) > meta_cap:
            raise ValueError(f"snapshot metadata ({len(meta)} bytes) does not fit the layout ({meta_cap} bytes)")
        h = SlotHeader(step, meta_cap, len(meta), self.private_len, self.shared_len)
        if slot.nbytes < h.total_len:
            raise ValueError(f"slot {slot.path} holds {slot.nbytes} bytes, snapshot {step} needs {h.total_len}")
        with torch.no_grad():
            self.copier.copy([(slot.view(h.private_off, e), t) for (_, t), e in zip(b.private, b.private_entries)],
                             slot, ready)
            pause_point("d2h", step)   # tests: die with the slot half written
            self.copier.copy([(slot.view(h.shared_off, e), t) for (_, t), e in zip(b.shared, b.shared_entries)],
                             slot, ready)
        slot.buf[HEADER_SIZE:HEADER_SIZE + len(meta)].copy_(torch.frombuffer(bytearray(meta), dtype=torch.uint8))
        # header last: a slot whose header names step k holds all of S_k
        slot.buf[:HEADER_SIZE].copy_(torch.frombuffer(bytearray(h.pack()), dtype=torch.uint8))


class CpuCopier:
    """CPU path: plain copies on the calling (background) thread; tensor copies release the GIL."""

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], slot: SlotMap,
             ready: torch.cuda.Event | None = None) -> None:
        for dst, src in pairs:
            dst.copy_(src)

    def release(self, slot: SlotMap) -> None:
        """The slot is being unmapped (replaced by a larger one)."""


# cudaHostRegisterPortable: the pages count as pinned in every CUDA context, not only in the one current on the
# (background) thread that registers them - a worker on GPU 3 registers from a thread whose default device is 0
CUDA_HOST_REGISTER_PORTABLE = 1
CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712


class CudaCopier:
    """GPU path: the agent's shm slot registered as pinned memory (cudaHostRegister, portable) so the D2H copy is
    one async DMA batch on a dedicated stream, ordered after the optimizer step by `ready` (an event the training
    thread records after `optimizer.step()`; without one, the copy waits for the device's current stream at the
    time of the copy), and completed by an event. It runs on the snapshot thread while the next step's forward and
    backward run on the training stream. Not exercised on the CPU-only project machine: tests/test_gpu.py runs it
    on a GPU (tools/gpu_check.sh)."""

    # Registrations are the process's, not one copier's: a new binding (after a restore, or optimizer state that
    # appeared late) makes a new writer and copier over the same slot mappings, and registering a mapping twice
    # fails (cudaErrorHostMemoryAlreadyRegistered, which also lingers as the thread's last CUDA error).
    _pinned: set[int] = set()
    _pin_lock = threading.Lock()

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]  # torch's

    def _register(self, slot: SlotMap) -> None:
        ptr = slot.buf.data_ptr()
        with CudaCopier._pin_lock:
            if ptr in CudaCopier._pinned:
                return
            with torch.cuda.device(self.device):
                cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # torch's
                rc = int(cudart.cudaHostRegister(ptr, slot.nbytes, CUDA_HOST_REGISTER_PORTABLE))
            # registered by someone else in this process over the same mapping: pinned all the same
            if rc not in (0, CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED):
                raise RuntimeError(f"cudaHostRegister of {slot.path} failed (cudaError {rc})")
            CudaCopier._pinned.add(ptr)

    @staticmethod
    def registered(slot: SlotMap) -> bool:
        return slot.buf.data_ptr() in CudaCopier._pinned

    def release(self, slot: SlotMap) -> None:
        """Unpin a slot that is being unmapped (replaced by a larger one): pinned pages must not outlive it."""
        ptr = slot.buf.data_ptr()
        with CudaCopier._pin_lock:
            if ptr in CudaCopier._pinned:
                torch.cuda.synchronize(self.device)
                torch.cuda.cudart().cudaHostUnregister(ptr)  # type: ignore[no-untyped-call]  # torch's
                CudaCopier._pinned.discard(ptr)

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], slot: SlotMap,
             ready: torch.cuda.Event | None = None) -> None:
        self._register(slot)
        with torch.cuda.device(self.device):
            if ready is None:   # no event from the training thread: everything queued on the default stream so far
                ready = torch.cuda.default_stream(self.device).record_event()
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            for dst, src in pairs:
                if src.is_cuda:
                    # the source is read on this stream: the caching allocator must not hand its memory out again
                    # before the copy is done, even if the training thread frees the tensor meanwhile
                    src.record_stream(self.stream)
                dst.copy_(src, non_blocking=src.is_cuda)
            done = self.stream.record_event()
        done.synchronize()


def read_slot(slot: SlotMap, step: int) -> tuple[SlotHeader, dict[str, Any]] | None:
    """Header and metadata of the slot if it holds a checksum-valid S_step."""
    mv = slot.memview()
    try:
        h = SlotHeader.unpack(mv)
    except ValueError:
        return None
    if h.step != step or crc_private(mv, h) != h.crc_private or crc_shared(mv, h) != h.crc_shared:
        return None
    return h, json.loads(bytes(mv[HEADER_SIZE:HEADER_SIZE + h.meta_len]))


def restore_into(slot: SlotMap, h: SlotHeader, meta: dict[str, Any], model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer) -> None:
    """Load S_step from a slot into the live model/optimizer/RNG (survivor or replacement alike).

    DTensor entries (meta["dtensors"]) are local shards: a parameter's or buffer's is copied in place into the live
    DTensor's local tensor (the objects FSDP2 and the optimizer hold stay the same); optimizer state is re-wrapped
    with its parameter's mesh and placements. Each must land in the layout it was taken from: a different mesh
    layout or shard shape is an error, never a restore."""
    reset_fsdp(model)
    private = [Entry.from_json(j) for j in meta["private"]]
    shared = [Entry.from_json(j) for j in meta["shared"]]
    dtensors: dict[str, DTensorRecord] = meta.get("dtensors", {})
    tensors = {e.name: slot.view(h.private_off, e).clone() for e in private}
    tensors.update({e.name: slot.view(h.shared_off, e).clone() for e in shared})
    model_sd = {k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")}
    sharded = {k for k in model_sd if f"model/{k}" in dtensors}
    if sharded:
        live = model.state_dict()          # FSDP2's state-dict hook swaps its sharded parameters in first
        with torch.no_grad():
            for k in sorted(sharded):
                local = _check_dtensor(f"model/{k}", live.get(k), dtensors[f"model/{k}"]).to_local()
                if tuple(local.shape) != tuple(model_sd[k].shape):
                    raise ValueError(f"restore: model/{k} holds a local shard of shape {tuple(local.shape)}, the "
                                     f"snapshot one of {tuple(model_sd[k].shape)}")
                local.copy_(model_sd.pop(k))
        missing, unexpected = model.load_state_dict(model_sd, strict=False)
        if set(missing) != sharded or unexpected:
            raise ValueError(f"restore: the snapshot does not match the model's state: missing "
                             f"{sorted(set(missing) - sharded)}, unexpected {sorted(unexpected)}")
    else:
        model.load_state_dict(model_sd)
    local_opt = local_optimizer(optimizer)
    params = [p for g in local_opt.param_groups for p in g["params"]]   # state_dict() numbers them in this order
    state: dict[int, dict[str, Any]] = {}
    for k, v in tensors.items():
        if k.startswith("optim/"):
            _, idx, name = k.split("/", 2)
            if k in dtensors:
                v = _rewrap(k, v, params[int(idx)], dtensors[k])
            state.setdefault(int(idx), {})[name] = v
    for k, v in meta["scalars"].items():
        idx, name = k.split("/", 1)
        state.setdefault(int(idx), {})[name] = v
    local_opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    if local_opt is not optimizer:  # ZeRO syncs outer -> inner at every step: make the outer agree
        for outer, inner in zip(optimizer.param_groups, local_opt.param_groups):
            for key, value in inner.items():
                if key != "params":
                    outer[key] = value
    torch.set_rng_state(tensors["rng/cpu"])
    cuda_rng = [tensors[k] for k in sorted(tensors) if k.startswith("rng/cuda")]
    if cuda_rng:
        torch.cuda.set_rng_state_all(cuda_rng)


def reset_fsdp(model: torch.nn.Module) -> None:
    """Put FSDP2 back into its between-iterations state (`FSDPModule.reset_iter_state()` on each root), as torch
    documents after a forward or backward that raised. Without it, a survivor whose step was abandoned mid-forward
    kept its iteration state (which groups are unsharded, what to prefetch) and issued other all-gathers than the
    fresh replacement: gloo aborted with "op.preamble.length <= op.nbytes. 24992 vs 8768" (FSDP2, 4 ranks, node
    killed at step 4)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return
    roots: list[str] = []
    for name, m in model.named_modules():
        if isinstance(m, FSDPModule) and not any(name == r or name.startswith(r + ".") if r else True for r in roots):
            roots.append(name)
            # a root that never ran a forward (a replacement process restoring inside protect()) has nothing to
            # reset, and reset_iter_state() needs FSDP's lazy init: it raised AttributeError ('FSDPCommContext'
            # has no 'all_gather_state') there. Asked through the public method, not FSDP's private state
            try:
                m.reset_iter_state()
            except AttributeError:
                pass


def _check_dtensor(name: str, live: object, recorded: DTensorRecord, shape: bool = True) -> DTensor:
    """The live tensor a DTensor snapshot entry is restored into must have the layout it was taken with: it,
    checked."""
    if not is_dtensor(live):
        raise ValueError(f"restore: {name} was a DTensor when snapshotted but the live model holds "
                         f"{type(live).__name__}: the script must build the same mesh and wrappers before protect()")
    placements = [placement_name(p) for p in live.placements]
    if placements != recorded["placements"] or (shape and list(live.shape) != recorded["shape"]):
        raise ValueError(f"restore: {name} was snapshotted as {recorded['shape']} with placements "
                         f"{recorded['placements']}, the live one is {list(live.shape)} with {placements}")
    return live


def _rewrap(name: str, local: torch.Tensor, param: torch.Tensor, recorded: DTensorRecord) -> DTensor:
    """Optimizer state of a DTensor parameter: its local shard, wrapped with the parameter's mesh and placements."""
    from torch.distributed.tensor import DTensor
    param = _check_dtensor(name, param, recorded, shape=False)  # state may be shaped unlike its parameter; placed alike
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                              shape=torch.Size(recorded["shape"]), stride=tuple(recorded["stride"]))


class BackgroundCopier:
    """Runs one snapshot at a time on a helper thread; `wait()` joins the one in flight."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.last_seconds = 0.0

    def submit(self, fn: Callable[[], None]) -> None:
        self.wait()

        def run() -> None:
            t0 = time.perf_counter()
            try:
                fn()
            except BaseException as e:  # surfaced to the training thread at the next wait
                self.error = e
            self.last_seconds = time.perf_counter() - t0
        self._thread = threading.Thread(target=run, daemon=True, name="phoenixrun-snapshot")
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
