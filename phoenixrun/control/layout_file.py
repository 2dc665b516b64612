"""The job's DTensor peer set (redundancy.PeerSet) kept in the run directory, so that a restarted master plans a
hot swap from it as the first master did. Rank 0 reports the set once, at the job's start (`layout`); a master
started again over the same run directory would otherwise plan shared fetches from the --tp/--pp DP ring, whose
bytes the lost rank's checksum refuses - a fallback to disk instead of a hot swap, never a wrong restore.

The file names the run it belongs to: a set written by another run in the same directory is ignored."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from phoenixrun.redundancy import LayoutError, PeerSet

log = logging.getLogger("phoenixrun.master")
NAME = "layout.json"


def save(run_dir: Path, run_id: str, peers: PeerSet | None) -> None:
    """Write atomically (a master killed mid-write leaves the previous file)."""
    path = Path(run_dir) / NAME
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"run_id": run_id, "peers": peers.to_wire() if peers is not None else None}))
    os.replace(tmp, path)


def load(run_dir: Path, run_id: str, world_size: int) -> PeerSet | None:
    """The set this run's first master was told, or None (no file, another run's, another world size, or
    unreadable: logged)."""
    path = Path(run_dir) / NAME
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("ignoring %s: %s", path, e)
        return None
    if not isinstance(d, dict) or d.get("run_id") != run_id or not d.get("peers"):
        return None
    try:
        peers = PeerSet.from_wire(d["peers"])
    except (LayoutError, ValueError, TypeError, KeyError) as e:
        log.warning("ignoring %s: %s", path, e)
        return None
    if len(peers.mesh.ranks) != world_size:
        log.warning("ignoring %s: its mesh has %d ranks, the job %d", path, len(peers.mesh.ranks), world_size)
        return None
    return peers
