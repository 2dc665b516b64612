"""Agent-owned snapshot memory: commit protocol and replica store invariants (no processes)."""
import os
import time

import pytest

from phoenixrun.agents.slots import LocalSlots, ReplicaStore, SlotError
from phoenixrun.slot_format import SlotHeader, crc_private


def write(slots: LocalSlots, rank: int, step: int, fill: int) -> int:
    idx = slots.begin_write(rank)
    mm = slots.view(rank, idx)
    h = SlotHeader(step=step, meta_cap=64, meta_len=2, private_len=100, shared_len=100)
    mm[64:66] = b"{}"
    mm[h.private_off:h.private_off + 100] = bytes([fill]) * 100
    mm[h.shared_off:h.shared_off + 100] = bytes([fill + 1]) * 100
    mm[:64] = h.pack()
    slots.finish_write(rank, idx, step)
    return idx


@pytest.fixture
def slots():
    s = LocalSlots(prefix="phoenixrun-test-slots")
    s.allocate(0, SlotHeader(0, 64, 0, 100, 100).total_len)
    yield s
    s.clear()


def test_ping_pong_keeps_committed_slot_while_writing(slots):
    a = write(slots, 0, 1, 10)
    slots.commit(0, a, 1)
    b = slots.begin_write(0)                 # a writer now owns the other slot
    assert b != a
    assert slots.available() == {0: [1]}     # the half-written slot is never offered for restore
    assert slots.begin_write(0) == b         # a crashed writer's slot is reused, the committed one never
    assert slots.committed_step(0) == 1


def test_restore_point_discards_newer_timeline(slots):
    a = write(slots, 0, 1, 10)
    slots.commit(0, a, 1)
    b = write(slots, 0, 2, 20)
    slots.commit(0, b, 2)
    assert slots.available() == {0: [1, 2]}
    assert slots.restore_point(0, 1) == a
    assert slots.available() == {0: [1]}
    with pytest.raises(SlotError):
        slots.restore_point(0, 2)


def test_frozen_slots_refuse_writes(slots):
    slots.frozen = True
    with pytest.raises(SlotError, match="frozen"):
        slots.begin_write(0)


def test_replica_store_verifies_checksum_and_keeps_previous(slots):
    a = write(slots, 0, 1, 10)
    slots.commit(0, a, 1)
    h = SlotHeader.unpack(slots.view(0, a))
    data = bytes(slots.view(0, a)[:h.replicated_len])
    store = ReplicaStore()
    store.put(0, 1, data)
    corrupt = bytearray(data)
    corrupt[h.private_off] ^= 0xFF
    h2 = SlotHeader(2, h.meta_cap, h.meta_len, h.private_len, h.shared_len, h.crc_private, 0)
    corrupt[:64] = h2.pack()
    with pytest.raises(SlotError, match="checksum"):
        store.put(0, 2, bytes(corrupt))
    assert store.available() == {0: [1]}     # the failed write left the good copy alone
    assert crc_private(store.get(0, 1), h) == h.crc_private
    store.clear()                            # a shrink or grow renumbered the ranks: nothing is kept
    assert store.available() == {} and store.nbytes() == 0


def test_replica_receive_buffers_are_reused_and_lent_once(slots):
    """The next replica of a rank is received into its older buffer (same size only), which is invalid and out of
    the store until `put` hands it back: a second receive of the same rank meanwhile gets none (a new buffer), so
    two senders never write into one buffer. The newer replica is never handed out."""
    store = ReplicaStore()
    replicas = {}
    for step in (1, 2):
        a = write(slots, 0, step, step)
        slots.commit(0, a, step)
        h = SlotHeader.unpack(slots.view(0, a))
        replicas[step] = bytes(slots.view(0, a)[:h.replicated_len])
        assert store.receive_buffer(0, len(replicas[step])) is None     # no buffer of that rank to reuse yet
        store.put(0, step, bytearray(replicas[step]))
    n = len(replicas[1])
    assert store.receive_buffer(0, n + 64) is None                       # another size: a new buffer
    assert store.available() == {0: [1, 2]}
    buf = store.receive_buffer(0, n)
    assert buf is not None and bytes(buf) == replicas[1]                 # the older one, step 1's
    assert store.available() == {0: [2]}                                 # invalid from now on
    assert store.receive_buffer(0, n) is None                            # lent: nobody else gets it
    buf[:] = replicas[1]                                                 # "received" (bytes of step 1 again)
    store.put(0, 1, buf)
    assert store.available() == {0: [1, 2]} and store.get(0, 1) == replicas[1] and store.get(0, 2) == replicas[2]
    store.frozen = True
    with pytest.raises(SlotError, match="frozen"):
        store.receive_buffer(0, n)


def test_orphaned_files_of_dead_agents_are_removed():
    import subprocess
    import socket

    from phoenixrun.agents.slots import SHM_DIR, remove_orphans
    host = socket.gethostname()
    dead = subprocess.Popen(["true"])
    dead.wait()                                      # a pid that no longer runs
    orphan = SHM_DIR / f"phoenixrun-{host}-{dead.pid}-beef-r0-s0"
    alive = SHM_DIR / f"phoenixrun-{host}-{os.getpid()}-beef-r0-s0"
    for p in (orphan, alive):
        p.write_bytes(b"x")
    try:
        assert orphan in remove_orphans(host)
        assert not orphan.exists() and alive.exists()   # a live agent's slots are never touched
    finally:
        orphan.unlink(missing_ok=True)
        alive.unlink(missing_ok=True)


def test_files_of_a_zombie_agent_are_orphans():
    """An agent SIGKILLed under a parent that has not reaped it yet is a zombie: its files go too."""
    import signal
    import socket
    import subprocess

    import psutil

    from phoenixrun.agents.slots import SHM_DIR, remove_orphans
    host = socket.gethostname()
    child = subprocess.Popen(["sleep", "60"])
    os.kill(child.pid, signal.SIGKILL)
    deadline = time.time() + 30
    while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:   # dead, not reaped: we do not wait()
        assert time.time() < deadline
        time.sleep(0.01)
    orphan = SHM_DIR / f"phoenixrun-{host}-{child.pid}-beef-r0-s0"
    orphan.write_bytes(b"x")
    try:
        assert psutil.pid_exists(child.pid)              # what the old check asked: "alive"
        assert orphan in remove_orphans(host) and not orphan.exists()
    finally:
        orphan.unlink(missing_ok=True)
        child.wait()
