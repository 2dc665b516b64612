"""Decoding what the master sends an agent: JSON object keys are strings, the protocol's maps are keyed by
slot or rank (ints). Normalised once, as a directive arrives (protocol/directives.py's `decode`), so its readers
index with ints only.

(What agents send the master is decoded - and validated - by protocol/messages.py: its inventories come
out int-keyed the same way.)
"""
from __future__ import annotations

from typing import Any, Mapping, TypeVar

V = TypeVar("V")


def int_keys(m: Mapping[Any, V] | None, name: str = "map") -> dict[int, V]:
    """{"3": v} (as JSON carries it) or {3: v} -> {3: v}. A key that is not a non-negative integer is an error
    that names the map: a master and agent that disagree on the protocol must not guess."""
    out: dict[int, V] = {}
    for k, v in (m or {}).items():
        if type(k) is int and k >= 0:
            out[k] = v
        elif type(k) is str and k.isdigit() and len(k) < 12:
            out[int(k)] = v
        else:
            raise ValueError(f"{name}: key {k!r} is not a slot or rank number")
    return out
