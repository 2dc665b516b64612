"""Snapshot slots that grow (issue 20): only the slot handed out for writing is replaced, the committed
snapshot stays restorable throughout, and a slot that cannot grow is a clear error (no processes but one
subprocess with a real file-size limit)."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from phoenixrun.agents.slots import LocalSlots
from phoenixrun.slot_format import ALIGN, SlotHeader, crc_private, crc_shared, grown_capacity, slot_bytes

SMALL = slot_bytes(64, 100, 100)
BIG = slot_bytes(4096, 100, 100)


def write(slots: LocalSlots, rank: int, step: int, fill: int, meta_cap: int = 64) -> int:
    idx = slots.begin_write(rank, slot_bytes(meta_cap, 100, 100))
    mm = slots.view(rank, idx)
    meta = b"{" + b" " * (meta_cap - 2) + b"}"          # the whole metadata capacity in use
    h = SlotHeader(step=step, meta_cap=meta_cap, meta_len=len(meta), private_len=100, shared_len=100)
    mm[64:64 + len(meta)] = meta
    mm[h.private_off:h.private_off + 100] = bytes([fill]) * 100
    mm[h.shared_off:h.shared_off + 100] = bytes([fill + 1]) * 100
    mm[:64] = h.pack()
    slots.finish_write(rank, idx, step)
    return idx


def intact(slots: LocalSlots, rank: int, idx: int, step: int, fill: int) -> bool:
    mm = slots.view(rank, idx)
    h = SlotHeader.unpack(mm)
    return (h.step == step and crc_private(mm, h) == h.crc_private and crc_shared(mm, h) == h.crc_shared
            and mm[h.private_off] == fill)


@pytest.fixture
def slots():
    s = LocalSlots(prefix="phoenixrun-test-growth")
    s.allocate(0, SMALL)
    yield s
    s.clear()


def test_growing_replaces_only_the_slot_being_written(slots):
    a = write(slots, 0, 1, 10)
    slots.commit(0, a, 1)
    path_a = slots.path(0, a)
    b = slots.begin_write(0, BIG)               # the next snapshot needs a larger layout
    assert b != a
    path_b, size_b = slots.path(0, b)
    assert size_b >= BIG and Path(path_b).exists()
    assert slots.path(0, a) == path_a           # the committed slot: same file, same size, still S_1
    assert intact(slots, 0, a, 1, 10) and slots.available() == {0: [1]}
    assert slots.paths(0) == [path_a[0], path_b] if a == 0 else [path_b, path_a[0]]

    b = write(slots, 0, 2, 20, meta_cap=4096)   # S_2 in the new layout, in the grown slot
    slots.commit(0, b, 2)
    a2 = slots.begin_write(0, BIG)              # now the old slot grows, and S_2 is the one kept
    assert a2 == a and slots.path(0, a)[1] >= BIG and slots.path(0, a) != path_a
    assert not Path(path_a[0]).exists()         # the replaced file is gone (a worker may still map it)
    assert intact(slots, 0, b, 2, 20) and slots.available() == {0: [2]}
    assert slots.begin_write(0, SMALL) == a     # never shrinks: a smaller request reuses the slot as is
    assert slots.path(0, a)[1] >= BIG


def test_a_fresh_layout_after_restore_keeps_the_committed_slot(slots):
    """The worker binds again after a restore and asks for its slots: a committed slot is never replaced,
    however small (it grows when it is next written)."""
    a = write(slots, 0, 1, 10)
    slots.commit(0, a, 1)
    before = slots.path(0, a)
    slots.allocate(0, BIG)
    assert slots.path(0, a) == before and intact(slots, 0, a, 1, 10)
    assert slots.path(0, 1 - a)[1] >= BIG       # the other one grew at once


def test_grown_capacity_is_geometric():
    assert grown_capacity(100, 50) == 100
    assert grown_capacity(100, 101) == 200
    assert grown_capacity(100, 1000) == 1600
    assert grown_capacity(0, 1) == ALIGN
    # state growing 4 KiB a step for 100,000 steps from a 64 KiB capacity: 13 re-layouts, not 100,000
    cap, relayouts = 64 * 1024, 0
    for step in range(100_000):
        need = 4096 * step
        if need > cap:
            cap, relayouts = grown_capacity(cap, need), relayouts + 1
    assert relayouts == 13


GROW_PAST_LIMIT = textwrap.dedent("""
    import resource, sys
    from phoenixrun.agents.slots import LocalSlots, SlotSpaceError
    from tests.test_slots_growth import BIG, SMALL, intact, write
    resource.setrlimit(resource.RLIMIT_FSIZE, (BIG // 2, BIG // 2))   # Python ignores SIGXFSZ: EFBIG
    s = LocalSlots(prefix="phoenixrun-test-growth-limit")
    try:
        s.allocate(0, SMALL)
        a = write(s, 0, 1, 10)
        s.commit(0, a, 1)
        try:
            s.begin_write(0, BIG)
        except SlotSpaceError as e:
            print("ERROR", e)
        assert intact(s, 0, a, 1, 10) and s.available() == {0: [1]}, "the committed snapshot was touched"
        b = write(s, 0, 2, 20)                  # the old layout still works
        s.commit(0, b, 2)
        print("OK", s.available())
    finally:
        s.clear()
""")


def test_a_slot_that_cannot_grow_is_a_clear_error_and_keeps_the_committed_snapshot():
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", GROW_PAST_LIMIT], cwd=root, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    err = next(line for line in r.stdout.splitlines() if line.startswith("ERROR"))
    assert f"cannot allocate {BIG} bytes of snapshot memory" in err       # the size
    assert "File too large" in err                                        # the limit that was hit
    assert "phoenixrun.protect()" in err and "more room" in err           # what to do
    assert "OK {0: [1, 2]}" in r.stdout          # S_2 written in the old layout beside S_1


def test_installing_a_larger_layout_over_an_earlier_install(slots):
    """A spare fetching its rank again (a cascaded recovery) may get a snapshot laid out larger than the copy it
    installed the first time: forget + install takes it whole."""
    a = write(slots, 0, 1, 10)
    slots.commit(0, a, 1)
    src = LocalSlots(prefix="phoenixrun-test-growth-src")
    try:
        src.allocate(0, BIG)
        b = write(src, 0, 2, 20, meta_cap=4096)
        h = SlotHeader.unpack(src.view(0, b))
        mm = src.view(0, b)
        slots.forget(0)
        slots.install(0, bytes(mm[:h.replicated_len]), bytes(mm[h.shared_off:h.shared_off + h.shared_len]), 2)
        assert slots.available() == {0: [2]} and intact(slots, 0, 0, 2, 20)
    finally:
        src.clear()
