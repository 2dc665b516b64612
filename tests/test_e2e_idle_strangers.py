"""End to end (issue 31 item 3): idle unauthenticated connections held open to the surviving agent's peer port
while a node is killed. Measured on main at a4bd7af: the full room closed the spare's restore connection at
accept, six restore_refused, and the job stopped 0.75 s after the fault. Now the spare restores, and the job
finishes bit-identical to a fault-free torchrun run."""
import select
import socket
import threading
import time

import pytest

from tests.harness import assert_identical, by_event, kill_node, launch, torchrun

STEPS = 40
pytestmark = pytest.mark.e2e


class Strangers:
    """Keeps `n` idle connections open to addr (replacing those the server closes) until stopped."""

    def __init__(self, addr: str, n: int):
        host, port = addr.rsplit(":", 1)
        self.target, self.n = (host, int(port)), n
        self.socks: list[socket.socket] = []
        self.opened = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=10)
        for s in self.socks:
            s.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.socks:   # the server closed some (to make room, or at their deadline)
                gone = set(select.select(self.socks, [], [], 0)[0])
                for s in gone:
                    s.close()
                self.socks = [s for s in self.socks if s not in gone]
            while len(self.socks) < self.n:
                try:
                    self.socks.append(socket.create_connection(self.target, timeout=2))
                    self.opened += 1
                except OSError:
                    break
            time.sleep(0.05)


def test_idle_strangers_on_the_survivors_peer_port_do_not_stop_a_node_replacement(tmp_path):
    ref = torchrun(tmp_path, "ref", nproc=2, steps=STEPS)
    job = launch(tmp_path, "strangers", nnodes=2, nproc=1, spares=1, steps=STEPS)
    state = job.wait_step(3)
    survivor = next(n for n in state["nodes"] if n["slot"] == 1 and n["role"] == "active")
    with Strangers(survivor["peer_addr"], 100) as strangers:
        time.sleep(1.5)                      # the room is full of idle strangers, older than the grace
        kill_node(state, 0)
        job.wait_for(lambda s: s.get("generation", 0) > state["generation"]
                     and (s.get("step") or 0) >= state["step"] + 3, what="the job going on after the node replacement")
    assert strangers.opened >= 100
    assert job.finish() == 0, job.log()[-3000:]
    ev = job.events()
    done = by_event(ev, "recovery_done")
    assert done and all(d["replayed_steps"] <= 1 for d in done), sorted({e["event"] for e in ev})
    assert_identical(job.out, ref)
