"""Which backend carries CUDA tensors, said in one line at start (phoenixrun/backend_choice.py): a table of
$PHOENIXRUN_BACKEND x CUDA devices (injected: no GPU here), the device count read from /dev and
CUDA_VISIBLE_DEVICES, and the CLI's refusal of a backend phoenixrun does not rebuild."""
import subprocess

import pytest

from phoenixrun.backend_choice import choose, visible_cuda_devices
from tests.harness import BIN, EXAMPLE, env

VERIFY = 'the NCCL path is unverified until tools/gpu_check.sh has run on a GPU (docs/api.md, "GPU")'


@pytest.mark.parametrize("value, cuda, backend, line", [
    (None, 0, "gloo", None),                       # a CPU machine, the default: nothing to say
    ("", 0, "gloo", None),
    ("gloo", 0, "gloo", None),
    (None, 4, "gloo", "backend: 4 CUDA devices visible, but CUDA tensors go over gloo: PHOENIXRUN_BACKEND is not "
                      f"set and gloo is the default until NCCL is verified here ({VERIFY}); export "
                      "PHOENIXRUN_BACKEND=nccl for NCCL"),
    (None, 1, "gloo", "backend: 1 CUDA device visible, but CUDA tensors go over gloo: PHOENIXRUN_BACKEND is not "
                      f"set and gloo is the default until NCCL is verified here ({VERIFY}); export "
                      "PHOENIXRUN_BACKEND=nccl for NCCL"),
    ("gloo", 8, "gloo", "backend: CUDA tensors go over gloo (PHOENIXRUN_BACKEND=gloo, as set; 8 CUDA devices "
                        f"visible): slower than NCCL; PHOENIXRUN_BACKEND=nccl uses NCCL ({VERIFY})"),
    ("nccl", 4, "nccl", "backend: CUDA tensors go over NCCL (PHOENIXRUN_BACKEND=nccl; 4 CUDA devices visible), "
                        f"CPU tensors over gloo; {VERIFY}"),
    ("nccl", 0, "nccl", "backend: PHOENIXRUN_BACKEND=nccl but no CUDA device is visible here: the workers' NCCL "
                        "groups will fail to start; unset it (gloo) on a machine without a GPU"),
])
def test_the_backend_and_the_line_that_says_why(value, cuda, backend, line):
    c = choose(value, cuda)
    assert (c.backend, c.line, c.error) == (backend, line, None)


@pytest.mark.parametrize("value", ["mpi", "NCCL", "nccl,gloo"])
def test_a_backend_phoenixrun_does_not_rebuild_is_an_error(value):
    c = choose(value, 4)
    assert c.backend is None and c.error == (f"PHOENIXRUN_BACKEND={value!r} is not a backend phoenixrun rebuilds: "
                                             "use one of gloo, nccl (or leave it unset: gloo)")


@pytest.mark.parametrize("visible, count", [(None, 2), ("0", 1), ("0,1", 2), ("0,1,2,3", 2), ("", 0), ("-1", 0)])
def test_visible_cuda_devices_from_dev_and_the_environment(tmp_path, visible, count, monkeypatch):
    import sys
    monkeypatch.delitem(sys.modules, "torch", raising=False)     # the launcher has not imported torch
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-caps"):
        (tmp_path / name).write_text("")
    environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert visible_cuda_devices(environ, dev=tmp_path) == count


def test_the_launcher_refuses_an_unknown_backend_in_one_line():
    r = subprocess.run([str(BIN / "phoenixrun"), "--standalone", str(EXAMPLE)], capture_output=True, text=True,
                       env=env(PHOENIXRUN_BACKEND="mpi"), timeout=60)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "phoenixrun: error: PHOENIXRUN_BACKEND='mpi' is not a backend phoenixrun rebuilds: use one of gloo, nccl "
        "(or leave it unset: gloo)"], r.stderr


def test_the_templates_set_the_backend_explicitly():
    from pathlib import Path
    for t in sorted((Path(__file__).resolve().parents[1] / "launch_templates").glob("*.sbatch")):
        text = t.read_text()
        assert "BACKEND=${BACKEND:-${PHOENIXRUN_BACKEND:-gloo}}" in text and \
            "export PHOENIXRUN_BACKEND=$BACKEND" in text, t.name
