"""Persistent checkpoints: the DCP writer and reader of committed snapshot slots (torch).

Run by the agent's checkpoint I/O process (agents/persist_worker.py), never by the master: the
layout on disk - directory names, complete steps, pruning, checking a slot image - is the torch-free
persist_layout.py, which the master reads and this module builds on. Its names are re-exported here,
so the I/O side has one module to import. `write_rank` turns a sealed slot image into one DCP
checkpoint per rank (keys in persist_layout.py's docstring); `read_rank` rebuilds the exact image
from it and checks both checksums, so a damaged checkpoint is refused, never resumed from.
"""
from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    import torch

from phoenixrun.persist_layout import (CheckpointError, Image, complete_steps, header_fields, header_from_fields,
                                       newest_complete, parse_image, prune, prune_targets, rank_dir, ranks_on_disk,
                                       step_dir)
from phoenixrun.slot_format import HEADER_SIZE, Entry, SlotHeader

__all__ = ["CheckpointError", "complete_steps", "header_fields", "header_from_fields", "newest_complete",
           "parse_image", "prune", "prune_targets", "rank_dir", "ranks_on_disk", "step_dir",
           "write_rank", "read_rank"]


def _tensors(image: Image, h: SlotHeader, meta: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    import torch
    from phoenixrun.runtime.snapshot import entry_view
    buf = torch.frombuffer(image, dtype=torch.uint8) if len(image) else torch.empty(0, dtype=torch.uint8)
    for region, off in (("private", h.private_off), ("shared", h.shared_off)):
        for j in meta[region]:
            e = Entry.from_json(j)
            yield e.name, entry_view(buf, off, e)


def _state_dict(image: Image, h: SlotHeader, meta: dict[str, Any]) -> dict[str, Any]:
    """DCP state dict whose tensors are views of `image` (no copy)."""
    meta_text = bytes(memoryview(image)[HEADER_SIZE:HEADER_SIZE + h.meta_len]).decode()  # verbatim: checksummed
    sd: dict[str, Any] = {"model": {}, "optim": {"state": {}}, "rng": {},
                "phoenixrun": {"meta": meta_text, "header": json.dumps(list(header_fields(h)))}}
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


def write_rank(root: Path, rank: int, image: Image) -> Path:
    """Write one rank's sealed slot image as a DCP checkpoint; returns its directory.

    The image is checked first (a copy that raced with the next snapshot fails its checksum and
    is not written). Written under a temporary name, then renamed: complete or absent."""
    from torch.distributed.checkpoint.state_dict_saver import save
    h, meta = parse_image(image)
    final = rank_dir(root, h.step, rank)
    if final.exists():
        return final
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():   # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        save(_state_dict(image, h, meta), checkpoint_id=str(tmp), no_dist=True)
    for f in tmp.iterdir():          # durable before it becomes visible
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    os.rename(tmp, final)
    return final


def read_rank(root: Path, step: int, rank: int) -> bytearray:
    """Rebuild the exact slot image of (step, rank) from disk; CheckpointError if it is not intact."""
    from torch.distributed.checkpoint.state_dict_loader import load
    path = rank_dir(root, step, rank)
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint of rank {rank} at step {step} in {root}")
    head = {"phoenixrun": {"meta": "", "header": ""}}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            load(head, checkpoint_id=str(path), no_dist=True)
            h = header_from_fields(json.loads(head["phoenixrun"]["header"]))
            meta_bytes = head["phoenixrun"]["meta"].encode()
            meta = json.loads(meta_bytes)
            image = bytearray(h.total_len)
            image[:HEADER_SIZE] = h.pack()
            image[HEADER_SIZE:HEADER_SIZE + len(meta_bytes)] = meta_bytes
            target = _state_dict(image, h, meta)
            target.pop("phoenixrun")
            load(target, checkpoint_id=str(path), no_dist=True)   # reads straight into the image
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - any unreadable file is a damaged checkpoint
        raise CheckpointError(f"checkpoint of rank {rank} at step {step} is unreadable: {e}") from None
    if h.step != step or len(meta_bytes) != h.meta_len:
        raise CheckpointError(f"checkpoint of rank {rank} at step {step} holds step {h.step}")
    parse_image(image)
    return image
