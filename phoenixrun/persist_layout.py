"""Persistent checkpoints on disk: where they live, which steps are complete, pruning, checking an image.

Torch-free: the master reads the directory through this module to pick the step a fallback restart
resumes from, and the master must not reach torch code (tests/test_boundaries.py). The DCP writer
and reader the agent's I/O process runs are in persist.py. On disk:

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
import mmap
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterable

from phoenixrun.slot_format import HEADER_SIZE, SlotHeader, crc_private, crc_shared

_STEP_RE = re.compile(r"^step_(\d{8})$")
_RANK_RE = re.compile(r"^rank_(\d{5})$")


class CheckpointError(Exception):
    """A persistent checkpoint is missing, incomplete or fails its checksum."""


# a sealed slot image in memory: read into a buffer, or a file mapped copy-on-write
Image = bytes | bytearray | memoryview | mmap.mmap


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


def prune(root: Path, world_size: int, keep: int) -> list[int]:
    """Remove the steps older than the `keep` newest complete ones. Any agent may do it (they are
    garbage for every rank); concurrent removals of the same directory are harmless."""
    targets = prune_targets(ranks_on_disk(root), world_size, keep)
    for step in targets:
        shutil.rmtree(step_dir(root, step), ignore_errors=True)
    return targets


# ---------------------------------------------------------------------------- the recorded slot header
def header_fields(h: SlotHeader) -> tuple[int | str, ...]:
    """What a checkpoint records of the slot header (`phoenixrun.header`); `header_from_fields` reads it back."""
    return (h.step, h.meta_cap, h.meta_len, h.private_len, h.shared_len, h.crc_private, h.crc_shared, h.checksum)


def header_from_fields(fields: list[Any]) -> SlotHeader:
    """The slot header a checkpoint recorded. Checkpoints written before the header named its checksum
    (7 fields) carry zlib CRC32 and are verified with it. Pure."""
    if len(fields) == 7:
        step, meta_cap, meta_len, private_len, shared_len, crc_p, crc_s = fields
        return SlotHeader(step, meta_cap, meta_len, private_len, shared_len, crc_p, crc_s, checksum="crc32")
    if len(fields) == 8:
        return SlotHeader(*fields)
    raise CheckpointError(f"checkpoint header has {len(fields)} fields (expected 7 or 8): written by another "
                          "phoenixrun version; restore it with that version")


def parse_image(image: Image) -> tuple[SlotHeader, dict[str, Any]]:
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
