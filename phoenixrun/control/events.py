"""Append-only JSON-lines event log: the contract tools and tests read (docs/design.md, "Event contract", names
every event and its fields).

Every record is one of protocol/events.py's frozen dataclasses (one per `names.Event`): a field misspelt or
missing is a TypeError where the event is built, not a silent break in the tools that read the log."""
from __future__ import annotations

import json
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from phoenixrun.protocol.events import EventRecord


class EventLog:
    def __init__(self, path: Path, keep: int = 50) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self.recent: deque[dict[str, Any]] = deque(maxlen=keep)
        self._f = open(self.path, "a", buffering=1)

    def emit(self, record: EventRecord, generation: int) -> dict[str, Any]:
        """Append `record` as the master's `generation` writes it; the line written, as a dict."""
        rec = {"t": round(time.time(), 6), "event": record.NAME.value, "generation": generation, **record.fields()}
        line = json.dumps(rec, default=str)
        with self._lock:
            self._f.write(line + "\n")
            self._f.flush()
            self.recent.append(rec)
        return rec

    def close(self) -> None:
        with self._lock:
            self._f.close()


def read_events(path: Path) -> list[dict[str, Any]]:
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
