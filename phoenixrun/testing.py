"""Named pause points for crash-consistency tests (off unless PHOENIXRUN_TEST_PAUSE is set).

PHOENIXRUN_TEST_PAUSE="point:step" makes the first process that reaches `point` at `step` write
PHOENIXRUN_TEST_PAUSE_DIR/paused-<point> (its pid) and stop there until it is killed, so a test
can SIGKILL it at exactly that moment. One-shot per run directory.
"""
from __future__ import annotations

import os
import time

_SPEC = os.environ.get("PHOENIXRUN_TEST_PAUSE", "")


def pause_point(point: str, step: int | None = None) -> None:
    if not _SPEC:
        return
    name, _, at = _SPEC.partition(":")
    if name != point or (at and step is not None and int(at) != step):
        return
    d = os.environ.get("PHOENIXRUN_TEST_PAUSE_DIR", "/tmp")
    try:
        fd = os.open(os.path.join(d, f"paused-{point}"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    while True:
        time.sleep(3600)
