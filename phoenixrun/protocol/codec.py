"""Decoding what the master sends an agent: JSON object keys are strings, the protocol's maps are keyed by
slot or rank (ints). Normalised here, once, as a directive arrives, so its readers index with ints only.

(What agents send the master is decoded - and validated - by protocol/messages.py: its inventories come
out int-keyed the same way.)
"""
from __future__ import annotations

from typing import Mapping, TypeVar

V = TypeVar("V")

# the int-keyed maps of a directive's `world`: slot -> peer address, rank -> the slots holding its replicas
WORLD_INT_KEYED = ("slots", "placement")


def int_keys(m: Mapping | None, name: str = "map") -> dict[int, V]:
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


def decode_world(world: Mapping) -> dict:
    """A directive's `world` with its slot- and rank-keyed maps int-keyed (other fields as they are)."""
    out = dict(world)
    for name in WORLD_INT_KEYED:
        if name in out:
            out[name] = int_keys(out[name], f"world.{name}")
    return out


# a directive's own int-keyed maps: rank -> where to fetch its state from (a restore)
DIRECTIVE_INT_KEYED = ("fetch",)


def decode_directive(d: dict) -> dict:
    """A directive as the agent's readers want it: its rank-keyed maps and `world`'s int-keyed. A new dict."""
    out = dict(d)
    for name in DIRECTIVE_INT_KEYED:
        if name in out:
            out[name] = int_keys(out[name], name)
    if isinstance(out.get("world"), Mapping):
        out["world"] = decode_world(out["world"])
    return out
