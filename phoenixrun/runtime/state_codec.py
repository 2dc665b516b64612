"""The script's `state` dict as snapshot metadata, and a watch on what it costs.

Every snapshot holds the whole `state` (a slot is self-describing: it is restored, replicated and persisted on
its own), so each step encodes all of it: a `state` that grows with the run (a loss per step) makes every step
slower than the last - measured: train_gpt.py's former per-step losses took the median step from 30 ms to
148 ms over 8,000 steps (issue 31). Encoding only what changed would not make that go away: the bytes still land
in both slots, are checksummed, replicated to every holder and persisted at each checkpoint. What keeps the
per-step cost flat is a `state` whose size does not depend on the step (docs/api.md, "`state`"). `SizeWatch`
says so in the log when the encoding outgrows `WARN_BYTES`, and again at each doubling (a logarithmic number
of lines however long the run), with the measured cost. Pure apart from the clock.
"""
from __future__ import annotations

import json
import time
from typing import Any

WARN_BYTES = 64 * 1024    # ~2-3 ms of json.dumps for a dict of floats on this machine's cores


def encode_state(state: dict[str, Any]) -> tuple[str, float]:
    """The JSON of `state` and the seconds it took."""
    t0 = time.perf_counter()
    text = json.dumps(state)
    return text, time.perf_counter() - t0


class SizeWatch:
    """Says when the encoded `state` first passes `warn_bytes`, then at each doubling after that."""

    def __init__(self, warn_bytes: int = WARN_BYTES):
        self.next_warn = warn_bytes

    def check(self, nbytes: int, seconds: float, step: int) -> str | None:
        """The warning to log for a snapshot of `step` whose state encoded to `nbytes` in `seconds`, or None."""
        if nbytes < self.next_warn:
            return None
        while self.next_warn <= nbytes:
            self.next_warn *= 2
        return (f"the state dict given to protect() is {nbytes} bytes of JSON at step {step} and still growing: "
                f"it is encoded whole with every snapshot ({seconds * 1e3:.1f} ms this step, also copied, "
                "checksummed and replicated), so each step gets slower as it grows. Keep per-step histories "
                "(losses, timings) out of it - in a log file or a metrics logger (docs/api.md, `state`)")
