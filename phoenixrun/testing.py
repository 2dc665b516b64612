"""Named pause points for crash-consistency tests (off unless PHOENIXRUN_TEST_PAUSE is set).

PHOENIXRUN_TEST_PAUSE="point:step" makes the first process that reaches `point` at `step` write
PHOENIXRUN_TEST_PAUSE_DIR/paused-<point> (its pid) and stop there until it is killed, so a test
can SIGKILL it at exactly that moment. One-shot per run directory. Several points may be given,
comma-separated; a point written "point+" (or "point:step+") holds only until the test creates
PHOENIXRUN_TEST_PAUSE_DIR/release-<point>, so a test can act while a recovery is held at that point
(a recovery takes ~30 ms on an idle machine: no fixed delay lands inside it reliably). "point#2:step" holds the
same point a second time, at another step (files paused-point#2, release-point#2).

PHOENIXRUN_TEST_CORRUPT="point" makes the first process that serves bytes at `corrupt_point(point, ...)` a bad
source: it writes PHOENIXRUN_TEST_PAUSE_DIR/corrupt-<point> (its pid) and from then on flips one bit of
everything it serves there; "point*" makes every process's bytes bad. Several points may be given,
comma-separated.
"""
from __future__ import annotations

import os
import time

_SPEC = os.environ.get("PHOENIXRUN_TEST_PAUSE", "")


def _points(spec: str) -> dict[str, tuple[int | None, bool]]:
    """point -> (step or None, held until released)."""
    out: dict[str, tuple[int | None, bool]] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        release = item.endswith("+")
        name, _, at = item.rstrip("+").partition(":")
        out[name] = (int(at) if at else None, release)
    return out


_POINTS = _points(_SPEC)
# "point#2:step" is a second hold of the same point (at another step), with files paused-point#2/release-point#2
_BASES = {name.partition("#")[0] for name in _POINTS}
_CORRUPT = {c.rstrip("*"): c.endswith("*") for c in
            filter(None, (s.strip() for s in os.environ.get("PHOENIXRUN_TEST_CORRUPT", "").split(",")))}
_BAD: set[str] = set()       # points where this process is the bad source


def corrupt_point(point: str, data: bytes, at: int = 0) -> bytes:
    """`data`, or (tests) `data` with the low bit of byte `at` flipped where this process is a bad source."""
    if point not in _CORRUPT or at >= len(data):
        return data
    if point not in _BAD:
        if not _CORRUPT[point]:
            path = os.path.join(os.environ.get("PHOENIXRUN_TEST_PAUSE_DIR", "/tmp"), f"corrupt-{point}")
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                return data          # another process is the bad source
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
        _BAD.add(point)
    bad = bytearray(data)
    bad[at] ^= 1
    return bytes(bad)


def pause_point(point: str, step: int | None = None) -> None:
    if point not in _BASES:
        return
    for name, (at, release) in _POINTS.items():
        if name.partition("#")[0] == point and (at is None or step is None or at == step):
            _hold(name, release)
            return


def _hold(point: str, release: bool) -> None:
    d = os.environ.get("PHOENIXRUN_TEST_PAUSE_DIR", "/tmp")
    try:
        fd = os.open(os.path.join(d, f"paused-{point}"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    released = os.path.join(d, f"release-{point}")
    while not (release and os.path.exists(released)):
        time.sleep(0.01 if release else 3600)
