"""Append-only JSON-lines event log: the contract tools and tests read (docs/design.md, "Event contract", names
every event and its fields).

Event names are protocol/names.py's `Event`: a name outside it is a bug (a typo would silently break the tools
that read the log), refused with a ValueError."""
from __future__ import annotations

import json
import threading
import time
from collections import deque
from pathlib import Path

from phoenixrun.protocol.names import Event


class EventLog:
    def __init__(self, path: Path, keep: int = 50):
        self.path = Path(path)
        self._lock = threading.Lock()
        self.recent: deque[dict] = deque(maxlen=keep)
        self._f = open(self.path, "a", buffering=1)

    def emit(self, event: Event | str, generation: int, **fields) -> dict:
        rec = {"t": round(time.time(), 6), "event": Event(event).value, "generation": generation, **fields}
        line = json.dumps(rec, default=str)
        with self._lock:
            self._f.write(line + "\n")
            self._f.flush()
            self.recent.append(rec)
        return rec

    def close(self) -> None:
        with self._lock:
            self._f.close()


def read_events(path: Path) -> list[dict]:
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
