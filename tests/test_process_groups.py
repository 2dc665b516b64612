"""Real process groups under phoenixrun.init(): subgroups and DeviceMesh dimensions give the results of their own
members, before a fault and after a hot swap (the groups the script holds are rebuilt in place)."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from phoenixrun.runtime.process_group import FORWARDED, ReconfigurableProcessGroup
from tests.harness import BIN, ROOT, Job, by_event, env, kill_node

PROBE = ROOT / "tests" / "scripts" / "probe_groups.py"


def launch_script(tmp: Path, name: str, script: Path, args: list[str], nnodes: int = 2, nproc: int = 2,
                  spares: int = 0, extra_flags: list[str] | None = None) -> Job:
    run_dir, out = tmp / f"{name}-run", tmp / f"{name}-out"
    log = open(tmp / f"{name}-run.log", "w")
    cmd = [str(BIN / "phoenixrun"), "--standalone", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
           "--spares", str(spares), "--run-dir", str(run_dir), "--heartbeat-interval", "0.1", *(extra_flags or []),
           str(script), "--out", str(out), *args]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env(), cwd=tmp)
    return Job(run_dir, out, proc)


def probe_results(out: Path) -> dict[int, dict]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))}


@pytest.mark.e2e
def test_subgroups_and_mesh_are_real_before_and_after_hot_swap(tmp_path):
    steps = 14
    job = launch_script(tmp_path, "probe", PROBE, ["--steps", str(steps), "--step-seconds", "0.2"], spares=1)
    kill_node(job.wait_step(5), slot=1)
    assert job.finish() == 0, job.log()[-3000:]
    done = by_event(job.events(), "recovery_done")
    assert len(done) == 1, job.log()[-3000:]
    restored = done[0]["restored_step"]
    res = probe_results(job.out)
    assert sorted(res) == [0, 1, 2, 3]
    for rank, r in res.items():
        assert r["failures"] == [], f"rank {rank}: {r['failures']}"
        # every step ran its checks in the final timeline, including the steps after the hot swap
        assert sorted(set(r["steps"])) == list(range(steps)), r["steps"]
        assert restored < steps - 3
        assert r["checks"] >= steps * 18     # 18 or 19 checks per step, by rank
    # the mesh's dimension groups are distinct named groups, the same on the ranks that share them
    assert res[0]["mesh_names"][0] == res[2]["mesh_names"][0] != res[1]["mesh_names"][0]
    assert res[0]["mesh_names"][1] == res[1]["mesh_names"][1] != res[2]["mesh_names"][1]


def test_every_forwarded_name_is_a_group_method_torch_knows():
    """A misspelt name would be a method torch never calls (the call would then bypass the forwarding)."""
    known = set(dir(torch._C._distributed_c10d.ProcessGroup))
    assert set(FORWARDED) - {"_allgather_base", "_reduce_scatter_base"} <= known | {"alltoall_base"}
    for name in ("all_gather_single", "reduce_scatter_single", "all_to_all_single", "alltoall", "gather",
                 "scatter", "send", "recv", "barrier", "allgather_into_tensor_coalesced",
                 "all_gather_single_coalesced", "reduce_scatter_single_coalesced"):
        assert callable(getattr(ReconfigurableProcessGroup, name))
        assert getattr(ReconfigurableProcessGroup, name) is not getattr(torch._C._distributed_c10d.ProcessGroup,
                                                                        name)


def test_calls_that_cannot_be_rebuilt_are_clear_errors():
    pg = ReconfigurableProcessGroup(0, 2, (0, 1))
    with pytest.raises(RuntimeError, match="split_group.*not supported under phoenixrun.*new_group"):
        pg.split_group([0])
    with pytest.raises(RuntimeError, match="_get_backend.*changes at every recovery"):
        pg._get_backend(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="still restoring"):
        pg.alltoall([torch.zeros(1)] * 2, [torch.zeros(1)] * 2)
    pg.setGroupName("7")
    assert pg.group_name == "7" and "ranks [0, 1]" in repr(pg)


def test_a_replacement_before_protect_completes_a_tp_scatter_locally():
    """distribute_tensor (TP's parallelize_module) scatters the root's shards while a replacement is still
    restoring: the root keeps its own chunk, the others zeros (either is overwritten by the restore)."""
    root = ReconfigurableProcessGroup(1, 2, (4, 5))
    out = [torch.full((2,), -1.0)]
    root.scatter(out, [[torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])]]).wait()
    assert out[0].tolist() == [3.0, 4.0]
    other = ReconfigurableProcessGroup(0, 2, (4, 5))
    other.scatter(out, []).wait()
    assert out[0].tolist() == [0.0, 0.0]


def test_a_group_created_after_protect_is_refused():
    """A replacement runs the script up to protect() only: a later group would exist on the survivors alone."""
    from torch._C._distributed_c10d import _DistributedBackendOptions

    from phoenixrun.runtime.process_group import GroupRegistry
    reg = GroupRegistry()
    opts = _DistributedBackendOptions()
    opts.group_rank, opts.group_size, opts.global_ranks_in_group, opts.group_id = 0, 2, [0, 1], "3"
    pg = reg.create(opts)
    assert pg.global_ranks == (0, 1) and pg.group_name == "3" and pg.inner is None   # no generation yet
    assert reg.subgroups == [pg]
    reg.sealed = True
    opts.group_id = "4"
    with pytest.raises(RuntimeError, match=r"ranks \[0, 1\] created after phoenixrun.protect\(\).*before protect"):
        reg.create(opts)
    pg.shutdown()                                      # dist.destroy_process_group(pg): no longer rebuilt
    assert reg.subgroups == []


def test_a_group_with_an_explicit_builtin_backend_is_a_clear_error():
    """new_group(backend="gloo") rendezvouses on the default group's store: it refuses instead of waiting 30 min."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch._C._distributed_c10d import ProcessGroupGloo

    from phoenixrun.runtime.process_group import DEFAULT_STORE
    with pytest.raises(RuntimeError, match=r"explicit backend.*without backend="):
        ProcessGroupGloo(dist.PrefixStore("1/cpu/", DEFAULT_STORE), 0, 2, timedelta(seconds=5))
