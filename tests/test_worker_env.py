"""The worker environment contract: everything torchrun sets, plus phoenixrun's own."""
from phoenixrun.agents.workers import Placement, worker_env


def placement(**kw):
    base = dict(local_rank=1, nproc_per_node=2, nnodes=3, slot=2, rank=5, master_addr="10.0.0.1", master_port=1234,
                run_id="job", restart_count=1, max_restarts=3, generation=4, agent_sock="/tmp/a.sock",
                error_file="/tmp/err.json")
    base.update(kw)
    return Placement(**base)


def test_torchrun_variables():
    e = worker_env({"PATH": "/bin"}, placement())
    assert e["PATH"] == "/bin"
    expect = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "2",
              "GROUP_WORLD_SIZE": "3", "ROLE_RANK": "5", "ROLE_WORLD_SIZE": "6", "ROLE_NAME": "default",
              "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234", "TORCHELASTIC_RUN_ID": "job",
              "TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "3",
              "TORCHELASTIC_ERROR_FILE": "/tmp/err.json", "TORCHELASTIC_USE_AGENT_STORE": "True",
              "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "OMP_NUM_THREADS": "1",
              "PHOENIXRUN_AGENT_SOCK": "/tmp/a.sock", "PHOENIXRUN_SLOT": "2", "PHOENIXRUN_GENERATION": "4"}
    assert {k: e[k] for k in expect} == expect


def test_user_omp_setting_and_single_proc_are_respected():
    assert worker_env({"OMP_NUM_THREADS": "8"}, placement())["OMP_NUM_THREADS"] == "8"
    assert "OMP_NUM_THREADS" not in worker_env({}, placement(nproc_per_node=1, local_rank=0))


def test_warm_spare_has_no_rank_yet():
    e = worker_env({"RANK": "9"}, placement(rank=None, slot=None))
    assert e["PHOENIXRUN_WARM_SPARE"] == "1"
    assert "RANK" not in e and "WORLD_SIZE" not in e and "GROUP_RANK" not in e


def test_gloo_binds_to_the_node_interface_unless_the_user_chose():
    assert worker_env({}, placement(gloo_ifname="eth1"))["GLOO_SOCKET_IFNAME"] == "eth1"
    assert worker_env({"GLOO_SOCKET_IFNAME": "ib0"}, placement(gloo_ifname="eth1"))["GLOO_SOCKET_IFNAME"] == "ib0"
    assert "GLOO_SOCKET_IFNAME" not in worker_env({}, placement())
def test_prefixer_marks_each_line_once_and_passes_partial_lines():
    from phoenixrun.agents.workers import Prefixer
    p = Prefixer(b"[rank3]:")
    assert p.feed(b"a\nb") == b"[rank3]:a\n[rank3]:b"        # a partial line goes out at once
    assert p.feed(b" still b\n") == b" still b\n"             # ... and is not prefixed again when it ends
    assert p.feed(b"10%\r20%\r") == b"[rank3]:10%\r[rank3]:20%\r"
    assert p.feed(b"[rank3]: Traceback\n") == b"[rank3]: Traceback\n"   # torch's excepthook prefixed it
    assert p.feed(b"") == b""


def test_ranks_text_for_status():
    from phoenixrun.status import ranks_text
    assert [ranks_text(r) for r in ([0, 1, 2, 3], [4, 5], [], [0, 2, 3])] == ["0-3", "4,5", "-", "0,2,3"]
