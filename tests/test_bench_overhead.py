"""benchmarks/overhead.py at its smallest, so the fault-free overhead docs/benchmarks.md quotes cannot stop being
produced unnoticed: the three arms (protection off, on, on + a warm spare) of one tiny job each, paced so that it
outlasts the pre-started workers' start. The figures are not asserted (a paced step is mostly a sleep); what is
asserted is what the benchmark must find: every arm's steps, the protected arms' pre-started workers (the nodes'
standbys, the spare's) settling while the job runs, and the protection stats of the protected arm."""
import json
import subprocess
import sys

import pytest

from tests.harness import ROOT, env

pytestmark = pytest.mark.e2e


def test_three_arms_and_the_prestarted_workers_settling(tmp_path):
    out = tmp_path / "overhead.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--pairs", "1", "--steps", "30",
                        "--warmup", "2", "--sizes", "64", "--step-seconds", "0.8", "--json", str(out)],
                       capture_output=True, text=True, env=env(), cwd=tmp_path, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    [row] = json.loads(out.read_text())
    assert row["step_off_s"] >= 0.8 and row["step_on_s"] >= 0.8 and row["step_spare_s"] >= 0.8, row
    # the protected arms run 60 steps: the standbys (and the spare's workers) settle within them
    [on_settled], [spare_settled] = row["settled_step"], row["spare_settled_step"]
    assert on_settled is not None and 0 <= on_settled < 60, row
    assert spare_settled is not None and 0 <= spare_settled < 60, row
    assert row["replicated_bytes_per_rank"] > 0 and row["slot_bytes"] > 0, row
