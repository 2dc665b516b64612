"""CLI parsing: torchrun spellings, PET_* env, one-line errors with exit 2."""
import subprocess

import pytest

from tests.harness import BIN, EXAMPLE, env


def run(*args, **extra_env):
    return subprocess.run([str(BIN / "phoenixrun"), *args], capture_output=True, text=True, env=env(**extra_env),
                          timeout=60)


@pytest.mark.parametrize("args,needle", [
    (["--nnodes", "4:1", str(EXAMPLE)], "MAX is below MIN"),
    (["--nnodes", "0", str(EXAMPLE)], "--nnodes"),
    (["--nnodes", "2:4", str(EXAMPLE)], "Invalid value for --nnodes: 2:4 is torchrun's elastic world, which "
     "phoenixrun does not run: it keeps a fixed world and fills a lost node's slot from warm spares; type "
     "--nnodes 2 --spares 2 (2 nodes train, 2 wait as spares), or --nnodes 4 --on-no-spare shrink (4 nodes, "
     "going on with fewer when one is lost and no spare is left)"),
    (["--nproc-per-node", "x", str(EXAMPLE)], "not a number"),
    (["--rdzv-backend", "etcd", str(EXAMPLE)], "not supported"),
    (["--standalone", "no_such_script.py"], "not found"),
    (["--standalone", "--nnodes", "3", "--tp", "2", str(EXAMPLE)], "not divisible"),
    (["--standalone", "--nnodes", "2", "--replicas", "2", str(EXAMPLE)], "need at least 3 nodes"),
    (["--rdzv-endpoint", "head", str(EXAMPLE)], "is not host:port"),
    (["--bogus-flag", str(EXAMPLE)], "No such option"),
    (["--on-no-spare", "grow", str(EXAMPLE)], "is not one of"),
    (["-m", "--no-python", "x"], "cannot be combined"),
])
def test_bad_input_is_one_line_exit_2(args, needle):
    r = run(*args)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_help_lists_both_spellings_and_env():
    r = run("--help")
    assert r.returncode == 0
    for flag in ("--nproc-per-node", "--nproc_per_node", "--rdzv-endpoint", "--max-restarts", "--spares",
                 "--replicas", "--fault-domain", "--run-dir", "--node-timeout", "PET_NPROC_PER_NODE"):
        assert flag in r.stdout, flag


def test_pet_env_is_read():
    r = run(str(EXAMPLE), PET_NNODES="two")          # the env var reaches the same validation
    assert r.returncode == 2 and "not a node count" in r.stderr


@pytest.mark.parametrize("lo, hi, refused", [(2, 2, False), (1, 2, True), (64, 66, True)])
def test_only_a_fixed_world_is_accepted(lo, hi, refused):
    from phoenixrun.cli import nnodes_refusal
    why = nnodes_refusal(lo, hi)
    assert (why is not None) == refused
    if refused:
        assert f"--nnodes {lo} --spares {hi - lo}" in why and f"--nnodes {hi} --on-no-spare shrink" in why


@pytest.mark.parametrize("sub", ["master", "agent", "status", "simulate", "inject", "drain"])
def test_subcommands_have_help(sub):
    assert run(sub, "--help").returncode == 0


def test_status_without_job_is_clear(tmp_path):
    r = run("status", "--run-dir", str(tmp_path))
    assert r.returncode == 1 and "master.json" in r.stderr and "Traceback" not in r.stderr


def test_drain_without_job_is_clear(tmp_path):
    r = run("drain", "--run-dir", str(tmp_path), "--node", "1")
    assert r.returncode == 1 and "master.json" in r.stderr and "Traceback" not in r.stderr


def test_agent_without_secret_is_clear():
    r = run("agent", "--rdzv-endpoint", "127.0.0.1:1", "--nproc-per-node", "1", str(EXAMPLE))
    assert r.returncode == 2 and "secret" in r.stderr


# ------------------------------------------------------------------ directories the job cannot write
@pytest.fixture
def unwritable(tmp_path):
    """A directory path the job cannot create or write: under a read-only directory (chmod 500) for a normal user;
    for root, whom permission bits do not stop, under a regular file (Not a directory)."""
    import os
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        yield ro / "sub", "Permission denied"
        ro.chmod(0o700)
    else:
        (tmp_path / "file").write_text("")
        yield tmp_path / "file" / "sub", "Not a directory"


@pytest.mark.parametrize("flag, fix", [
    ("--run-dir", "give --run-dir a directory you can write"),
    ("--log-dir", "give --log-dir a directory you can write, or leave it out (worker output then goes to the "
                  "console)"),
    ("--persist-dir", "give --persist-dir a directory every node can write"),
])
def test_an_unwritable_directory_is_one_line_exit_2(unwritable, flag, fix):
    path, reason = unwritable
    extra = ["--persist-every", "2"] if flag == "--persist-dir" else []
    r = run("--standalone", flag, str(path), *extra, str(EXAMPLE))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [f"phoenixrun: error: {flag} {path} cannot be written ({reason}): {fix}"]


def test_the_default_run_directory_unwritable_names_the_fix(tmp_path):
    (tmp_path / ".phoenixrun").write_text("")          # .phoenixrun/RUN_ID cannot be made: for root too
    r = subprocess.run([str(BIN / "phoenixrun"), "--standalone", str(EXAMPLE)], capture_output=True, text=True,
                       env=env(), timeout=60, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    line, = r.stderr.strip().splitlines()
    assert line.startswith("phoenixrun: error: the run directory .phoenixrun/standalone-")
    assert line.endswith("cannot be written (Not a directory): run from a directory you can write, or give "
                         "--run-dir DIR")


@pytest.mark.parametrize("argv, flag", [
    (["master", "--nnodes", "1", "--nproc-per-node", "1", "--run-dir"], "--run-dir"),
    (["agent", "--rdzv-endpoint", "127.0.0.1:1", "--nproc-per-node", "1", "--log-dir"], "--log-dir"),
])
def test_master_and_agent_check_their_directory(unwritable, argv, flag):
    path, reason = unwritable
    r = run(*argv, str(path), *([str(EXAMPLE)] if argv[0] == "agent" else []), PHOENIXRUN_SECRET="x")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"phoenixrun: error: {flag} {path} cannot be written ({reason}): ")


def test_dir_problem_is_none_for_a_writable_directory(tmp_path):
    from phoenixrun import preflight
    assert preflight.try_dir(tmp_path / "a" / "b") is None
    assert not (tmp_path / "a").exists()          # the write test leaves nothing behind, the directories it made too
    (tmp_path / "c").mkdir()
    assert preflight.try_dir(tmp_path / "c") is None and list((tmp_path / "c").iterdir()) == []
    assert preflight.dir_problem("--log-dir", tmp_path, None, "fix") is None
    assert preflight.dir_problem("--log-dir", tmp_path, PermissionError(13, "Permission denied"), "fix") == \
        f"--log-dir {tmp_path} cannot be written (Permission denied): fix"


@pytest.mark.parametrize("args,needle", [
    (["--standalone", "--recovery-timeout", "30", str(EXAMPLE)], "--recovery-timeout 30: an agent's quiesce grace "
     "may reach 45 s"),
    (["--standalone", "--hang-timeout", "90", str(EXAMPLE)], "--collective-timeout 60 is not above --hang-timeout 90"),
    (["--standalone", "--node-timeout", "0.5", str(EXAMPLE)], "--heartbeat-interval 0.5 is not below --node-timeout"),
    (["--standalone", "--nnodes", "1", "--replicas", "3", str(EXAMPLE)], "3 replicas need at least 4 nodes"),
    (["master", "--nnodes", "2", "--nproc-per-node", "1", "--run-dir", "r", "--recovery-timeout", "30"],
     "--recovery-timeout 30: "),
    (["master", "--nnodes", "2", "--nproc-per-node", "1", "--run-dir", "r", "--replicas", "2"],
     "2 replicas need at least 3 nodes"),
    (["master", "--nnodes", "3", "--nproc-per-node", "1", "--run-dir", "r", "--tp", "2"], "not divisible"),
    (["agent", "--rdzv-endpoint", "127.0.0.1:1", "--nproc-per-node", "1", "--hang-timeout", "60", str(EXAMPLE)],
     "--collective-timeout 60 is not above --hang-timeout 60"),
    (["agent", "--rdzv-endpoint", "127.0.0.1:1", "--nproc-per-node", "1", "-m", "--no-python", "x"],
     "cannot be combined"),
])
def test_rules_between_flags_are_one_line_exit_2(args, needle, tmp_path):
    """config.validate() runs at every entry point: the launcher, `phoenixrun master` (before it writes its run
    directory) and `phoenixrun agent` (the Slurm templates start these two)."""
    r = subprocess.run([str(BIN / "phoenixrun"), *args], capture_output=True, text=True, cwd=tmp_path, timeout=60,
                       env=env(PHOENIXRUN_SECRET="x"))
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr
    assert lines[0].startswith("phoenixrun: error: ") and "Traceback" not in r.stderr
    assert not (tmp_path / "r").exists()     # refused before anything was written
