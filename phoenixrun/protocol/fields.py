"""What the protocol's frozen dataclasses (protocol/events.py, protocol/directives.py) share to put themselves on
the wire: a field left off when not given (`optional()`), a field written under another name (`renamed()`)."""
from __future__ import annotations

import dataclasses
from typing import Any


def optional() -> Any:
    """A field left off the wire when not given (None)."""
    return dataclasses.field(default=None, metadata={"optional": True})


def renamed(key: str) -> Any:
    """A required field written under `key` (a Python keyword such as `class`)."""
    return dataclasses.field(metadata={"key": key})


def wire_fields(obj: Any) -> dict[str, Any]:
    """A dataclass's fields as the wire carries them: optional ones only when given, renamed ones by their key."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if value is None and f.metadata.get("optional"):
            continue
        out[f.metadata.get("key", f.name)] = value
    return out
