"""What the agent and its checkpoint I/O process (agents/persist_worker.py) say to each other: one JSON object per
line, each a frozen dataclass here. The agent (agents/persister.py) sends a request and decodes the answer; the
I/O process decodes the request and sends the answer - neither reads the other's line as a dict.

    WriteImage(rank, image)     -> Done(step, pruned)   the image file (in /dev/shm) written as a DCP checkpoint,
                                                        the old checkpoints pruned (their steps)
    ReadImage(rank, step, out)  -> Done(step)           the checkpoint of (step, rank) read back into `out`
    (before the first request)  -> Ready()              the process has paid its imports
    any request that failed     -> Failed(error)        the process goes on serving

A line that is none of these is a ValueError naming what is wrong.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Union


def _int(m: Mapping[str, Any], name: str, where: str) -> int:
    v = m.get(name)
    if type(v) is not int or v < 0:
        raise ValueError(f"{where}: {name} must be an integer >= 0, got {str(v)[:40]!r}")
    return v


def _str(m: Mapping[str, Any], name: str, where: str) -> str:
    v = m.get(name)
    if not isinstance(v, str) or not v:
        raise ValueError(f"{where}: {name} must be a path, got {str(v)[:40]!r}")
    return v


@dataclass(frozen=True)
class WriteImage:
    rank: int
    image: str          # the image's hand-over file; the I/O process removes it

    def to_wire(self) -> dict[str, Any]:
        return {"op": "write", "rank": self.rank, "image": self.image}


@dataclass(frozen=True)
class ReadImage:
    rank: int
    step: int
    out: str            # where the image goes (written whole, then renamed into place)

    def to_wire(self) -> dict[str, Any]:
        return {"op": "read", "rank": self.rank, "step": self.step, "out": self.out}


Request = Union[WriteImage, ReadImage]


def decode_request(m: Any) -> Request:
    if not isinstance(m, Mapping):
        raise ValueError(f"a request must be an object, got {str(m)[:60]!r}")
    op = m.get("op")
    if op == "write":
        return WriteImage(_int(m, "rank", "write"), _str(m, "image", "write"))
    if op == "read":
        return ReadImage(_int(m, "rank", "read"), _int(m, "step", "read"), _str(m, "out", "read"))
    raise ValueError(f"unknown op {str(op)[:40]!r}: write or read")


@dataclass(frozen=True)
class Ready:
    def to_wire(self) -> dict[str, Any]:
        return {"ok": True, "ready": True}


@dataclass(frozen=True)
class Done:
    step: int
    pruned: tuple[int, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        return {"ok": True, "step": self.step, "pruned": list(self.pruned)}


@dataclass(frozen=True)
class Failed:
    error: str

    def to_wire(self) -> dict[str, Any]:
        return {"ok": False, "error": self.error}


Answer = Union[Ready, Done, Failed]


def decode_answer(m: Any) -> Answer:
    if not isinstance(m, Mapping):
        raise ValueError(f"an answer must be an object, got {str(m)[:60]!r}")
    if m.get("ok") is not True:
        return Failed(str(m.get("error") or "unknown error"))
    if m.get("ready") is True:
        return Ready()
    pruned = m.get("pruned") or []
    if not isinstance(pruned, list) or not all(type(s) is int for s in pruned):
        raise ValueError(f"answer: pruned must be a list of steps, got {str(pruned)[:60]!r}")
    return Done(_int(m, "step", "answer"), tuple(pruned))
