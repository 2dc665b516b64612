"""The master's lease (control/lease.py, control/standby.py): the pure decision as a table, then the files."""
import threading

import pytest

from phoenixrun.control.lease import Lease, LeaseDir, Verdict, decide, renew_every
from phoenixrun.control.standby import LeaseKeeper, await_lease
from phoenixrun.protocol.client import next_endpoint, split_endpoints

TTL, SKEW = 6.0, 2.0     # stale after 8 s
NOW = 1_000.0


def rec(epoch=1, holder="a", age=0.0, finished=False, exit_code=None):
    return Lease(epoch, holder, "hostA:29500", NOW - age, finished=finished, exit_code=exit_code)


# (case, record, claimed, me, my_epoch, unchanged_for, verdict, wait_s)
TABLE = [
    ("no lease yet: the first master takes it", None, 0, "a", 0, 0.0, Verdict.TAKE_OVER, 0.0),
    ("the holder itself, fresh", rec(), 1, "a", 1, 0.0, Verdict.HOLD, 0.0),
    ("the holder, its own record stale (it was paused): nobody claimed since, it still holds",
     rec(age=60), 1, "a", 1, 60.0, Verdict.HOLD, 0.0),
    ("the holder after a newer epoch was claimed: lost, stop acting", rec(), 2, "a", 1, 0.0, Verdict.LOST, 0.0),
    ("the holder, the newer claimant's record already written: lost", rec(epoch=2, holder="b"), 2, "a", 1, 0.0,
     Verdict.LOST, 0.0),
    ("standby, record fresh: wait until it could be stale", rec(age=1), 1, "b", 0, 0.0, Verdict.WAIT, 7.0),
    ("standby, record renewed 7.9 s ago (inside ttl + skew): wait", rec(age=7.9), 1, "b", 0, 0.0, Verdict.WAIT, 0.1),
    ("standby, record 8.1 s old (beyond ttl + skew): take over", rec(age=8.1), 1, "b", 0, 0.0, Verdict.TAKE_OVER, 0.0),
    ("standby, record 7 s old: past ttl but inside the skew bound: wait", rec(age=7), 1, "b", 0, 0.0, Verdict.WAIT,
     1.0),
    ("holder's clock 1.5 s ahead (record from the future, inside the bound): wait", rec(age=-1.5), 1, "b", 0, 0.0,
     Verdict.WAIT, 8.0),
    ("holder's clock an hour ahead: wait by its own clock, not an hour", rec(age=-3600), 1, "b", 0, 0.0,
     Verdict.WAIT, 8.0),
    ("holder's clock an hour ahead and the record unchanged 8.5 s on this clock: take over", rec(age=-3600), 1, "b",
     0, 8.5, Verdict.TAKE_OVER, 0.0),
    ("standby's clock behind: record looks 1 s old but unchanged 9 s here: take over", rec(age=1), 1, "b", 0, 9.0,
     Verdict.TAKE_OVER, 0.0),
    ("a newer epoch claimed, its record not written yet: wait for it", rec(age=30), 2, "b", 0, 0.0, Verdict.WAIT, 8.0),
    ("a newer epoch claimed and never written for 9 s (its claimant died): take over", rec(age=30), 2, "b", 0, 9.0,
     Verdict.TAKE_OVER, 0.0),
    ("claimed, no record at all yet: wait", None, 1, "b", 0, 3.0, Verdict.WAIT, 5.0),
    ("the job finished: a standby exits", rec(age=100, finished=True, exit_code=0), 1, "b", 0, 0.0, Verdict.DONE, 0.0),
    ("the job finished: even the holder is done", rec(finished=True), 1, "a", 1, 0.0, Verdict.DONE, 0.0),
]


@pytest.mark.parametrize("case,record,claimed,me,my_epoch,unchanged,verdict,wait_s", TABLE, ids=[t[0] for t in TABLE])
def test_decide(case, record, claimed, me, my_epoch, unchanged, verdict, wait_s):
    d = decide(record, claimed, me, my_epoch, NOW, unchanged, TTL, SKEW)
    assert d.verdict == verdict, (case, d)
    assert d.wait_s == pytest.approx(wait_s, abs=1e-9), (case, d)


def test_renewals_fit_three_times_in_a_ttl():
    assert renew_every(6.0) == 2.0


@pytest.mark.parametrize("current,failed,count,want", [(0, 0, 2, 1), (1, 1, 2, 0), (1, 0, 2, 1), (0, 0, 1, 0),
                                                      (2, 2, 3, 0)])
def test_next_endpoint(current, failed, count, want):
    assert next_endpoint(current, failed, count) == want


def test_split_endpoints():
    assert split_endpoints("a:1, b:2,") == ["a:1", "b:2"]
    assert split_endpoints("a:1") == ["a:1"]


# ---------------------------------------------------------------- the files
def test_an_epoch_is_claimed_once_among_racing_masters(tmp_path):
    leases = LeaseDir(tmp_path)
    barrier = threading.Barrier(8)
    won = []

    def race(i):
        barrier.wait()
        if leases.claim(1, f"m{i}", f"h{i}:1"):
            won.append(i)
    threads = [threading.Thread(target=race, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1
    assert leases.read() == (None, 1)


def test_record_is_replaced_atomically_and_a_torn_one_reads_as_none(tmp_path):
    leases = LeaseDir(tmp_path)
    leases.write(rec())
    assert leases.read() == (rec(), 0)
    assert not [p for p in leases.dir.iterdir() if p.name.endswith(".tmp")]
    (leases.dir / "lease.json").write_text('{"epoch": 1, "hol')
    assert leases.read() == (None, 0)


def test_first_master_takes_the_lease_without_waiting(tmp_path):
    got = await_lease(LeaseDir(tmp_path), "a", "hA:1", ttl=30, max_skew=1, stop=threading.Event())
    assert got.epoch == 1 and got.previous is None
    r, claimed = LeaseDir(tmp_path).read()
    assert claimed == 1 and r.holder == "a" and r.epoch == 1


def test_standby_waits_while_renewed_then_takes_over_and_the_old_holder_is_deposed(tmp_path):
    """Two masters on one run directory: the standby waits while the holder renews; once the holder stops
    renewing (it was paused), the standby claims epoch 2; the resumed holder's next renewal sees it lost."""
    ttl = 0.6
    a = await_lease(LeaseDir(tmp_path), "a", "hA:1", ttl, 0.2, threading.Event())
    lost = []
    keeper = LeaseKeeper(LeaseDir(tmp_path), "a", a.epoch, "hA:1", ttl, 0.2, lost.append)
    keeper.start()
    waits = []
    result = {}
    stop = threading.Event()
    standby = threading.Thread(target=lambda: result.setdefault("got", await_lease(
        LeaseDir(tmp_path), "b", "hB:2", ttl, 0.2, stop, lambda r, why: waits.append(why))))
    standby.start()
    standby.join(timeout=2.0)                # renewed meanwhile: still waiting
    assert standby.is_alive() and waits and "held by a" in waits[0]
    assert [sb["endpoint"] for sb in LeaseDir(tmp_path).standbys()] == ["hB:2"]    # listed while it waits
    keeper.stopped.set()                      # the holder stops renewing (paused, or its node died)
    standby.join(timeout=30)
    got = result["got"]
    assert got.epoch == 2 and got.previous.holder == "a"
    assert LeaseDir(tmp_path).standbys() == []
    assert keeper.renew() is False and lost and "epoch 2" in lost[0]     # the old holder, resumed: deposed
    assert LeaseDir(tmp_path).read()[0].holder == "b"                   # and it did not overwrite the record
    new = LeaseKeeper(LeaseDir(tmp_path), "b", 2, "hB:2", ttl, 0.2, lost.append)
    new.release(exit_code=0)
    assert LeaseDir(tmp_path).read()[0].finished


def test_standby_exits_with_the_jobs_code_when_it_finished_under_the_holder(tmp_path):
    leases = LeaseDir(tmp_path)
    a = await_lease(leases, "a", "hA:1", 30, 1, threading.Event())
    LeaseKeeper(leases, "a", a.epoch, "hA:1", 30, 1, lambda why: None).release(exit_code=75)
    got = await_lease(leases, "b", "hB:2", 30, 1, threading.Event())
    assert got.epoch == 0 and got.previous.exit_code == 75


# ------------------------------------------------------------------ the job secret, created once (issue 31 item 8)
def _master_start(run_dir: str, start_at: float, out: str) -> None:
    """One `phoenixrun master --lease-ttl` process up to the point it serves: the real command's secret handling
    (cli.master_cmd), with the Master stubbed to record the secret it would serve and stop there."""
    import os
    import sys
    import time

    import phoenixrun.control.master as master_mod
    from phoenixrun import cli

    class Served(Exception):
        pass

    class Stub:
        def __init__(self, cfg, secret):
            with open(out, "w") as f:
                f.write(secret)
            raise Served()

    master_mod.Master = Stub
    os.environ.pop("PHOENIXRUN_SECRET", None)
    while time.time() < start_at:       # every process leaves this spin together: started together
        pass
    try:
        cli.master_cmd.main(["--run-dir", run_dir, "--nnodes", "1", "--nproc-per-node", "1", "--lease-ttl", "5"],
                            standalone_mode=False)
    except Served:
        sys.exit(0)
    sys.exit(1)


def test_masters_started_together_serve_the_run_directorys_one_secret(tmp_path):
    """Measured: two masters started together with --lease-ttl wrote different secrets (`read_secret() or
    new_secret()`, then a truncating write) and in 1 of 5 trials the lease holder answered 401 to the run
    directory's secret. Now the first creates it (exclusively) and every master serves what the file holds."""
    import multiprocessing
    import time

    import phoenixrun.cli  # noqa: F401  imported once, before the forks
    import phoenixrun.control.master  # noqa: F401
    ctx = multiprocessing.get_context("fork")
    for trial in range(12):
        run_dir = tmp_path / f"run{trial}"
        run_dir.mkdir()
        start_at = time.time() + 0.3
        procs = [ctx.Process(target=_master_start, args=(str(run_dir), start_at, str(tmp_path / f"s{trial}-{i}")))
                 for i in range(4)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(30)
        assert [p.exitcode for p in procs] == [0] * len(procs)
        on_disk = (run_dir / "secret").read_text()
        served = {(tmp_path / f"s{trial}-{i}").read_text() for i in range(len(procs))}
        assert served == {on_disk}, f"trial {trial}: masters serve {len(served)} secrets"
        assert oct((run_dir / "secret").stat().st_mode & 0o777) == "0o600"
        assert not [p.name for p in run_dir.iterdir() if p.name != "secret"]     # no temporary file left
