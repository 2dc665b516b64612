"""A worker about to be killed for not acknowledging a quiesce is first asked for its threads' stacks
(runtime/stacks.py, agents/supervisor.py::kill_unanswering): real processes, the real signal."""
import os
import select
import signal
import subprocess
import sys
import time

from phoenixrun.protocol.constants import stack_signal

BLOCKED = """
import signal, sys, threading
from phoenixrun.runtime import stacks
{own}
installed = stacks.install()
def stand_in_for_a_collective():
    print(installed, flush=True)          # from inside: a dump from now on shows this frame
    threading.Event().wait()
stand_in_for_a_collective()
"""


def _start(own: str = "") -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", BLOCKED.format(own=own)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    return p


def test_a_blocked_worker_prints_where_it_is_and_lives_on():
    p = _start()
    try:
        assert p.stdout.readline().strip() == "True"
        os.kill(p.pid, stack_signal())
        deadline = time.monotonic() + 30
        err = ""
        while "stand_in_for_a_collective" not in err and time.monotonic() < deadline:
            if select.select([p.stderr], [], [], max(0.0, deadline - time.monotonic()))[0]:
                err += os.read(p.stderr.fileno(), 65536).decode()
        assert "stand_in_for_a_collective" in err and "most recent call first" in err
        assert p.poll() is None                      # the dump does not end it: the agent's kill does
    finally:
        p.kill()
        p.wait()


def test_a_scripts_own_handler_of_that_signal_is_left_alone():
    own = f"signal.signal({stack_signal()}, lambda *a: print('mine', flush=True))"
    p = _start(own)
    try:
        assert p.stdout.readline().strip() == "False"
        os.kill(p.pid, stack_signal())
        assert p.stdout.readline().strip() == "mine"
    finally:
        p.kill()
        p.wait()
    assert stack_signal() not in (signal.SIGUSR1, signal.SIGUSR2)   # frameworks' own (Lightning's Slurm requeue)


def test_the_agent_asks_a_real_worker_and_its_stacks_reach_the_workers_output(tmp_path):
    """Through agents/workers.py: the worker's stderr pump carries the dump, prefixed, to where its output goes."""
    import io
    import threading

    from phoenixrun.agents.workers import Placement, Worker, WorkerSpec
    script = tmp_path / "blocked.py"
    script.write_text(BLOCKED.format(own=""))
    out, err = io.StringIO(), io.StringIO()
    placement = Placement(local_rank=0, nproc_per_node=1, nnodes=1, slot=0, rank=3, master_addr="127.0.0.1",
                          master_port=1, run_id="t", restart_count=0, max_restarts=0, generation=0,
                          agent_sock=str(tmp_path / "sock"), error_file=str(tmp_path / "err.json"))
    exited = threading.Event()
    w = Worker(WorkerSpec(str(script)), placement, dict(os.environ), out, None, tee=True, err=err,
               name="rank3", on_exit=lambda _: exited.set())
    try:
        deadline = time.monotonic() + 30
        while "True" not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert w.ask_stacks()
        while "stand_in_for_a_collective" not in err.getvalue() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "stand_in_for_a_collective" in err.getvalue()
    finally:
        w.kill_now()
    assert exited.wait(30) and not w.ask_stacks()               # gone: nothing to ask
