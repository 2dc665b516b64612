"""A restarted master plans from the DTensor peer set the first master was told (control/layout_file.py): the set
rank 0 reports once per job outlives the master that received it, and a file of another run or shape is ignored."""
from phoenixrun import auth
from phoenixrun.config import MasterConfig
from phoenixrun.control import layout_file
from phoenixrun.control.master import Master
from phoenixrun.protocol import reports
from phoenixrun.redundancy import Mesh, PeerSet

HSDP = PeerSet(Mesh(("replicate", "shard"), (2, 2), (0, 1, 2, 3)), frozenset({"shard"}))


def _master(run_dir, run_id="job-a", nnodes=2):
    return Master(MasterConfig.build(run_dir=run_dir, nnodes=nnodes, nproc_per_node=2, run_id=run_id, node_timeout=1e6),
                  auth.new_secret())


def test_a_restarted_master_has_the_peer_set_its_predecessor_was_told(tmp_path):
    first = _master(tmp_path)
    assert first.job.course.peer_set is None
    first.recovery.absorb(reports.Layout(peers=HSDP, node_id="n0"))
    assert first.job.course.peer_set == HSDP
    again = _master(tmp_path)
    assert again.job.course.peer_set == HSDP
    assert list(again.job.course.peer_set.peers(2)) == [0]          # the replica across nodes, as before the restart


def test_a_job_without_dtensor_peers_overwrites_the_set(tmp_path):
    first = _master(tmp_path)
    first.recovery.absorb(reports.Layout(peers=HSDP, node_id="n0"))
    first.recovery.absorb(reports.Layout(peers=None, node_id="n0"))   # a new start of the job
    assert _master(tmp_path).job.course.peer_set is None


def test_another_runs_or_shapes_or_a_damaged_file_is_ignored(tmp_path):
    layout_file.save(tmp_path, "job-a", HSDP)
    assert layout_file.load(tmp_path, "job-a", 4) == HSDP
    assert layout_file.load(tmp_path, "job-b", 4) is None          # another run in the same directory
    assert layout_file.load(tmp_path, "job-a", 8) is None          # a mesh that is not this job's world
    assert _master(tmp_path, nnodes=4).job.course.peer_set is None
    (tmp_path / layout_file.NAME).write_text('{"run_id": "job-a", "peers": {"names": ["x"]}}')
    assert layout_file.load(tmp_path, "job-a", 4) is None
    (tmp_path / layout_file.NAME).write_text("{not json")
    assert layout_file.load(tmp_path, "job-a", 4) is None
    assert layout_file.load(tmp_path / "absent", "job-a", 4) is None
