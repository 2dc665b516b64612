"""Worker output on the console: `[rankN]:` once per line, and a carriage-return progress bar (tqdm) prefixed once
per redraw, never as `[rank0]:\r[rank0]:` (agents/prefixer.py). The real path: a worker process running tqdm,
its output pumped by agents/workers.py's Worker."""
import os
import time

import pytest

from phoenixrun.agents.prefixer import Prefixer
from phoenixrun.agents.workers import Placement, Worker, WorkerSpec


@pytest.mark.parametrize("chunks, out", [
    ([b"\r 10%\r 20%\r100%\n"], b"\r[r0]: 10%\r[r0]: 20%\r[r0]:100%\n"),                # tqdm: \r before each redraw
    ([b"\r", b" 10%", b"\r", b" 20%", b"\n"], b"\r[r0]: 10%\r[r0]: 20%\n"),              # the same, split anyhow
    ([b"loss 1\r\n", b"\r\n"], b"[r0]:loss 1\r\n[r0]:\r\n"),                             # CRLF lines
    ([b"a\r", b"b\n"], b"[r0]:a\r[r0]:b\n"),                                             # \r after text
    ([b"x\n\r", b"\ry\n"], b"[r0]:x\n\r\r[r0]:y\n"),
])
def test_a_carriage_return_is_a_line_start_for_the_prefix(chunks, out):
    p = Prefixer(b"[r0]:")
    assert b"".join(p.feed(c) for c in chunks) == out


TQDM_SCRIPT = """
import sys, time
from tqdm import tqdm
for _ in tqdm(range(5), file=sys.stdout, mininterval=0, miniters=1, ncols=60):
    time.sleep(0.01)
print("done")
"""


def test_a_real_tqdm_bar_from_a_worker_is_prefixed_once_per_redraw(tmp_path):
    script = tmp_path / "bar.py"
    script.write_text(TQDM_SCRIPT)
    place = Placement(local_rank=0, nproc_per_node=1, nnodes=1, slot=0, rank=0, master_addr="127.0.0.1",
                      master_port=1, run_id="t", restart_count=0, max_restarts=0, generation=0,
                      agent_sock=str(tmp_path / "a.sock"), error_file=str(tmp_path / "err.json"))
    console = tmp_path / "console"
    with open(console, "w") as out, open(tmp_path / "err", "w") as err:
        w = Worker(WorkerSpec(str(script)), place, dict(os.environ), out, None, tee=False, err=err)
        deadline = time.time() + 120       # until it exited and its last line is on the console (the pump's pace)
        while (w.poll() is None or not console.read_bytes().endswith(b"done\n")) and time.time() < deadline:
            time.sleep(0.05)
    data = console.read_bytes()
    assert w.poll() == 0 and b"100%" in data, (data, (tmp_path / "err").read_text())
    assert b"[rank0]:\r" not in data, data                      # the issue's `[rank0]:^M[rank0]:`
    redraws = [s for s in data.replace(b"\n", b"\r").split(b"\r") if s]
    assert len(redraws) >= 6 and all(s.startswith(b"[rank0]:") for s in redraws), data
    assert all(s.count(b"[rank0]:") == 1 for s in redraws), data
    assert data.endswith(b"[rank0]:done\n"), data


def test_the_worker_module_uses_this_prefixer():
    from phoenixrun.agents import workers
    assert workers.Prefixer is Prefixer
