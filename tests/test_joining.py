"""While nodes join: progress lines and the join timeout (control/joining.py), then a real master that gives up
(issue 29 item 2)."""
import subprocess
import time

import pytest

from phoenixrun.control.joining import Joining, gave_up, progress_line, waiting_for


@pytest.mark.parametrize("j, says", [
    (Joining(64, tuple(range(12)), 0, 2, 30, 600), "12/64 nodes joined (+0/2 spares); waiting for 52 more: slots 12-63"),
    (Joining(4, (0, 2), 1, None, 5, 600), "2/4 nodes joined (+1 spares); waiting for 2 more: slots 1, 3"),
    (Joining(2, (1,), 0, None, 5, 0), "1/2 nodes joined; waiting for 1 more: slot 0"),
    (Joining(2, (0, 1), 0, None, 5, 0), "2/2 nodes joined"),
    (Joining(40, tuple(range(0, 40, 2)), 0, None, 1, 0), "slots 1, 3, 5, 7, 9, 11, 13, 15, ..."),
])
def test_waiting_for(j, says):
    assert says in waiting_for(j)


def test_progress_line_counts_down():
    assert progress_line(Joining(2, (), 0, None, 30, 600)).endswith("after 30s, giving up in 570s (--join-timeout)")
    assert "giving up" not in progress_line(Joining(2, (), 0, None, 30, 0))


@pytest.mark.parametrize("j, ends", [
    (Joining(2, (0,), 0, None, 599, 600), False),
    (Joining(2, (0,), 0, None, 600, 600), True),
    (Joining(2, (0, 1), 0, 2, 900, 600), False),      # spares never hold the start
    (Joining(2, (), 0, None, 1e6, 0), False),         # 0: wait forever
])
def test_gave_up(j, ends):
    reason = gave_up(j)
    assert (reason is not None) == ends
    if ends:
        assert "--join-timeout" in reason and "slot 1" in reason


def test_master_gives_up_naming_the_missing_nodes(tmp_path):
    from tests.harness import BIN, env
    t0 = time.monotonic()
    p = subprocess.run([str(BIN / "phoenixrun"), "master", "--nnodes", "3", "--nproc-per-node", "1", "--run-dir",
                        str(tmp_path / "run"), "--port", "0", "--host", "127.0.0.1", "--join-timeout", "3"],
                       env=env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr[-2000:]
    line = [ln for ln in p.stderr.splitlines() if "job failed" in ln]
    assert len(line) == 1 and "0/3 nodes joined; waiting for 3 more: slots 0-2" in line[0], p.stderr[-2000:]
    assert time.monotonic() - t0 < 90
