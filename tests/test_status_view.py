"""`phoenixrun status` and `/metrics` as an operator reads them: the final state once the master is gone (from the
run directory's event log), tables that stay readable at 80 columns, a "spares left" figure; gauges that read 0
instead of disappearing, no `slot="None"`."""
import io
import subprocess

import pytest
from rich.console import Console

from phoenixrun import auth
from phoenixrun.control import metrics
from phoenixrun.control.master import Master, MasterConfig
from phoenixrun.final_state import from_events
from phoenixrun.status import render, spares_left
from phoenixrun.status_columns import Column, fit
from tests.harness import BIN, env


def shown(state: dict, width: int) -> str:
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(render(state, width))
    return console.export_text()


# ------------------------------------------------------------------ which columns fit
COLS = [Column("slot", 0), Column("role", 0), Column("note", 2, wrap=True), Column("pid", 5), Column("lag", 3)]
ROW = [["0", "active", "x" * 40, "12345", "7"]]


@pytest.mark.parametrize("width, kept", [
    (200, [0, 1, 2, 3, 4]),      # everything fits
    (50, [0, 1, 2, 3, 4]),       # exactly: 4+6+16+5+3 characters, 3 more a column, 1 border
    (49, [0, 1, 2, 4]),          # the lowest priority (pid) goes first
    (41, [0, 1, 2]),             # then the next (lag); the wrapped note needs only a few words (16)
    (35, [0, 1]),                # priority 0 stays even when nothing else fits
    (5, [0, 1]),
])
def test_the_least_important_columns_are_left_out_whole(width, kept):
    assert fit(COLS, ROW, width) == kept


def test_of_equal_priority_the_later_column_goes_first():
    cols = [Column("a", 0), Column("bbbbbbbb", 1), Column("cccccccc", 1)]
    assert fit(cols, [["1", "2", "3"]], 20) == [0, 1]


# ------------------------------------------------------------------ the final state from the event log
def ev(name, gen=0, **f):
    return {"t": 1_700_000_000.0, "event": name, "generation": gen, **f}


HOT_SWAP = [
    ev("master_started", endpoint="127.0.0.1:1", pid=9, nnodes=2, nproc_per_node=2, epoch=0),
    ev("node_joined", node="a", host="h", role="active", slot=0, agent_pid=11),
    ev("node_joined", node="b", host="h", role="active", slot=1, agent_pid=12),
    ev("job_started", world_size=4, slots={"0": "a", "1": "b"}),
    ev("node_joined", node="s1", host="h", role="spare", slot=None, agent_pid=13),
    ev("node_joined", node="s2", host="h", role="spare", slot=None, agent_pid=14),
    ev("fault_detected", node="b", slot=1, **{"class": "node_lost"}, detail="agent heartbeat lost"),
    ev("spare_promoted", 1, slot=1, node="s1", replaces="b"),
    ev("recovery_done", 1, restored_step=20, replayed_steps=1),
    ev("job_finished", 1, exit_code=0, reason="all workers finished", restarts=0, recoveries=1,
       committed_step=50, newest_snapshot=50),
]


def test_a_hot_swap_as_the_log_records_it():
    s = from_events(HOT_SWAP, "r1")
    assert (s["phase"], s["exit_code"], s["step"], s["recoveries"], s["generation"]) == ("finished", 0, 50, 1, 1)
    roles = {n["node_id"]: (n["role"], n["slot"], n["ranks"]) for n in s["nodes"]}
    assert roles == {"a": ("active", 0, [0, 1]), "s1": ("active", 1, [2, 3]), "b": ("failed", None, []),
                     "s2": ("spare", None, [])}
    assert next(n for n in s["nodes"] if n["node_id"] == "b")["last_fault"] == "node_lost: agent heartbeat lost"
    assert spares_left(s) == 1


@pytest.mark.parametrize("events, phase, code", [
    (HOT_SWAP[:4] + [ev("job_finished", exit_code=75, reason="no spare", restarts=0, recoveries=0)], "failed", 75),
    (HOT_SWAP[:4], "ended?", None),        # no job_finished: the master was killed
    ([], "ended?", None),
])
def test_how_the_log_says_the_job_ended(events, phase, code):
    s = from_events(events, "r1")
    assert (s["phase"], s["exit_code"]) == (phase, code)
    shown(s, 80)          # renders whatever the log holds


def test_a_shrink_renumbers_and_drops_the_lost_node():
    events = HOT_SWAP[:4] + [ev("job_shrunk", 1, nnodes=1, world_size=2, slot_map={"1": 0}, restored_step=5)]
    s = from_events(events, "r1")
    assert {n["node_id"]: (n["role"], n["slot"]) for n in s["nodes"]} == {"a": ("failed", None), "b": ("active", 0)}
    assert (s["active_nnodes"], s["world_size"]) == (1, 2)


def test_at_80_columns_no_column_is_cut_to_dots():
    s = from_events(HOT_SWAP, "r1")
    text = shown(s, 80)
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "…" not in text.split("recent events")[0], text
    for header in ("phase", "step", "spares left", "slot", "role", "last fault", "node_lost:"):   # the fault wraps in its column
        assert header in text, (header, text)
    assert "not shown at 80 columns: " in text          # what was left out is named
    wide = shown(s, 300)
    assert "not shown" not in wide and "worker pids" in wide and "127.0.0.1:1 pid 9" in wide


# ------------------------------------------------------------------ `phoenixrun status` once the master is gone
def test_status_after_the_job_ended_shows_the_final_state(tmp_path):
    secret = auth.new_secret()
    auth.write_secret(tmp_path, secret)
    m = Master(MasterConfig.build(run_dir=tmp_path, nnodes=1, nproc_per_node=1, run_id="done-run"), secret)
    m.start()
    m.register({"node_id": "n1", "host": "127.0.0.1", "agent_pid": 1, "peer_addr": "127.0.0.1:9"})
    m._finish(3, "worker exited with code 3")
    assert m.wait() == 3                                           # the master is gone: nothing listens
    r = subprocess.run([str(BIN / "phoenixrun"), "status", "--run-dir", str(tmp_path)], capture_output=True,
                       text=True, env=env(COLUMNS="80"), timeout=60)
    assert r.returncode == 0, r.stderr
    assert "phoenixrun job done-run" in r.stdout and "failed (exit 3)" in r.stdout
    assert "the job has ended (failed, exit code 3: worker exited with code 3); final state from" in \
        " ".join(r.stdout.split()), r.stdout
    assert "n1" in r.stdout and "Connection refused" not in r.stdout + r.stderr
    j = subprocess.run([str(BIN / "phoenixrun"), "status", "--run-dir", str(tmp_path), "--json"],
                       capture_output=True, text=True, env=env(), timeout=60)
    assert j.returncode == 0 and '"phase": "failed"' in j.stdout and '"from_log": true' in j.stdout


def test_status_by_endpoint_of_an_ended_job_says_where_to_look(tmp_path):
    r = subprocess.run([str(BIN / "phoenixrun"), "status", "--endpoint", "127.0.0.1:1"], capture_output=True,
                       text=True, env=env(PHOENIXRUN_SECRET="x"), timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().endswith("if the job has ended, --run-dir RUN_DIR shows its final state"), r.stderr


# ------------------------------------------------------------------ /metrics
def test_a_gauge_reads_0_and_no_label_reads_none():
    s = from_events(HOT_SWAP[:4], "r1")                      # no spare has joined
    for n in s["nodes"]:
        n["heartbeat_age_s"] = 0.5
    s["nodes"].append({"node_id": "s9", "slot": None, "role": "spare", "heartbeat_age_s": 1.0})
    text = metrics.render(s)
    assert 'phoenixrun_nodes{role="failed"} 0' in text and 'phoenixrun_nodes{role="drained"} 0' in text
    assert 'phoenixrun_nodes{role="spare"} 1' in text and 'phoenixrun_nodes{role="active"} 2' in text
    assert "None" not in text
    assert 'phoenixrun_node_heartbeat_age_seconds{node="s9",role="spare"} 1.0' in text
    s["nodes"].pop()
    assert 'phoenixrun_nodes{role="spare"} 0' in metrics.render(s)      # the last spare taken: 0, not gone
