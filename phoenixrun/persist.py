"""Persistent checkpoints: a committed snapshot slot on disk in `torch.distributed.checkpoint` form.

The agents write them from a background thread (the training processes do no I/O); the master
reads the directory to pick the step a fallback restart resumes from. On disk:

    <persist_dir>/step_00000120/rank_00003/      one rank's state at step 120: a DCP checkpoint
                                                 (.metadata + __0_0.distcp), written with no_dist
    <persist_dir>/step_00000120/rank_00003.tmp-* the same while being written (ignored)

A rank directory appears by one rename, so it is complete or absent; a step is complete when
every rank of the world has its directory. Each rank is its own DCP checkpoint because its
ZeRO shard is its own: a plain torchrun script of the same world size loads it with

    dcp.load({"model": model.state_dict()}, checkpoint_id=".../step_00000120/rank_00003", no_dist=True)

Keys: `model.<name>` (the module's state_dict names), `optim.state.<idx>.<key>` (the tensors of
the rank's local optimizer state), `rng.cpu`, and `phoenixrun.meta` / `phoenixrun.header` (JSON
strings: the slot metadata - param groups, scalar state, the script's `state` dict - and the
slot header with its checksums). Loading back rebuilds the exact slot image and checks both
checksums, so a damaged checkpoint is refused, never resumed from.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Iterable

from phoenixrun.slot_format import HEADER_SIZE, SlotHeader, crc_private, crc_shared

_STEP_RE = re.compile(r"^step_(\d{8})$")
_RANK_RE = re.compile(r"^rank_(\d{5})$")


class CheckpointError(Exception):
    """A persistent checkpoint is missing, incomplete or fails its checksum."""


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def rank_dir(root: Path, step: int, rank: int) -> Path:
    return step_dir(root, step) / f"rank_{rank:05d}"


def ranks_on_disk(root: Path) -> dict[int, set[int]]:
    """step -> ranks whose directory is complete (renamed into place)."""
    out: dict[int, set[int]] = {}
    root = Path(root)
    if not root.is_dir():
        return out
    for sd in root.iterdir():
        m = _STEP_RE.match(sd.name)
        if not m or not sd.is_dir():
            continue
        ranks = {int(r.group(1)) for r in map(_RANK_RE.match, os.listdir(sd)) if r}
        out[int(m.group(1))] = ranks
    return out


def complete_steps(on_disk: dict[int, set[int]], world_size: int) -> list[int]:
    """Steps every rank of the world has written, oldest first."""
    need = set(range(world_size))
    return sorted(s for s, ranks in on_disk.items() if need <= ranks)


def newest_complete(root: Path, world_size: int, exclude: Iterable[int] = ()) -> int | None:
    steps = [s for s in complete_steps(ranks_on_disk(root), world_size) if s not in set(exclude)]
    return steps[-1] if steps else None


def prune_targets(on_disk: dict[int, set[int]], world_size: int, keep: int) -> list[int]:
    """Steps no longer needed: older than the `keep`-th newest complete step (complete or not).
    Incomplete steps newer than that stay: they may still complete."""
    done = complete_steps(on_disk, world_size)
    if len(done) < keep or keep <= 0:
        return []
    return sorted(s for s in on_disk if s < done[-keep])


# ---------------------------------------------------------------------------- slot image <-> DCP
def _tensors(image: bytearray, h: SlotHeader, meta: dict):
    import torch
    from phoenixrun.runtime.snapshot import _DTYPES, Entry
    buf = torch.frombuffer(image, dtype=torch.uint8) if len(image) else torch.empty(0, dtype=torch.uint8)
    for region, off in (("private", h.private_off), ("shared", h.shared_off)):
        for j in meta[region]:
            e = Entry.from_json(j)
            start = off + e.offset
            yield e.name, buf[start:start + e.nbytes].view(_DTYPES[e.dtype]).view(e.shape)


def _state_dict(image: bytearray, h: SlotHeader, meta: dict) -> dict:
    """DCP state dict whose tensors are views of `image` (no copy)."""
    meta_text = bytes(memoryview(image)[HEADER_SIZE:HEADER_SIZE + h.meta_len]).decode()  # verbatim: checksummed
    sd: dict = {"model": {}, "optim": {"state": {}}, "rng": {},
                "phoenixrun": {"meta": meta_text, "header": json.dumps(list(_header_fields(h)))}}
    for name, t in _tensors(image, h, meta):
        kind, rest = name.split("/", 1)
        if kind == "model":
            sd["model"][rest] = t
        elif kind == "optim":
            idx, key = rest.split("/", 1)
            sd["optim"]["state"].setdefault(idx, {})[key] = t
        else:
            sd["rng"][rest] = t
    return sd


def _header_fields(h: SlotHeader) -> tuple:
    return (h.step, h.meta_cap, h.meta_len, h.private_len, h.shared_len, h.crc_private, h.crc_shared, h.checksum)


def header_from_fields(fields: list) -> SlotHeader:
    """The slot header a checkpoint recorded. Checkpoints written before the header named its checksum
    (7 fields) carry zlib CRC32 and are verified with it. Pure."""
    if len(fields) == 7:
        return SlotHeader(*fields, checksum="crc32")
    if len(fields) == 8:
        return SlotHeader(*fields)
    raise CheckpointError(f"checkpoint header has {len(fields)} fields (expected 7 or 8): written by another "
                          "phoenixrun version; restore it with that version")


def parse_image(image) -> tuple[SlotHeader, dict]:
    """Header and metadata of a sealed slot image; CheckpointError unless both checksums hold."""
    try:
        h = SlotHeader.unpack(image)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    if len(image) < h.shared_off + h.shared_len:
        raise CheckpointError(f"snapshot image of step {h.step} is truncated")
    if crc_private(image, h) != h.crc_private or crc_shared(image, h) != h.crc_shared:
        raise CheckpointError(f"snapshot of step {h.step} fails its checksum")
    return h, json.loads(bytes(memoryview(image)[HEADER_SIZE:HEADER_SIZE + h.meta_len]))


def write_rank(root: Path, rank: int, image: bytearray) -> Path:
    """Write one rank's sealed slot image as a DCP checkpoint; returns its directory.

    The image is checked first (a copy that raced with the next snapshot fails its checksum and
    is not written). Written under a temporary name, then renamed: complete or absent."""
    import torch.distributed.checkpoint as dcp
    h, meta = parse_image(image)
    final = rank_dir(root, h.step, rank)
    if final.exists():
        return final
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():   # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(_state_dict(image, h, meta), checkpoint_id=str(tmp), no_dist=True)
    for f in tmp.iterdir():          # durable before it becomes visible
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    os.rename(tmp, final)
    return final


def read_rank(root: Path, step: int, rank: int) -> bytearray:
    """Rebuild the exact slot image of (step, rank) from disk; CheckpointError if it is not intact."""
    import torch.distributed.checkpoint as dcp
    path = rank_dir(root, step, rank)
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint of rank {rank} at step {step} in {root}")
    head = {"phoenixrun": {"meta": "", "header": ""}}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(head, checkpoint_id=str(path), no_dist=True)
            h = header_from_fields(json.loads(head["phoenixrun"]["header"]))
            meta_bytes = head["phoenixrun"]["meta"].encode()
            meta = json.loads(meta_bytes)
            image = bytearray(h.total_len)
            image[:HEADER_SIZE] = h.pack()
            image[HEADER_SIZE:HEADER_SIZE + len(meta_bytes)] = meta_bytes
            target = _state_dict(image, h, meta)
            target.pop("phoenixrun")
            dcp.load(target, checkpoint_id=str(path), no_dist=True)   # reads straight into the image
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - any unreadable file is a damaged checkpoint
        raise CheckpointError(f"checkpoint of rank {rank} at step {step} is unreadable: {e}") from None
    if h.step != step or len(meta_bytes) != h.meta_len:
        raise CheckpointError(f"checkpoint of rank {rank} at step {step} holds step {h.step}")
    parse_image(image)
    return image


def prune(root: Path, world_size: int, keep: int) -> list[int]:
    """Remove the steps older than the `keep` newest complete ones. Any agent may do it (they are
    garbage for every rank); concurrent removals of the same directory are harmless."""
    targets = prune_targets(ranks_on_disk(root), world_size, keep)
    for step in targets:
        shutil.rmtree(step_dir(root, step), ignore_errors=True)
    return targets
