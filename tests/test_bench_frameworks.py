"""benchmarks/frameworks.py at its smallest (the DataLoader loop, one trial): both arms run to the end with a node
killed, the hot swap keeps the survivor's process and the restart does not, and the figures docs/benchmarks.md
quotes are produced (the ratio itself is a measurement, not asserted here)."""
import json
import subprocess
import sys

import pytest

from tests.harness import ROOT, env

pytestmark = pytest.mark.e2e


def test_framework_benchmark_runs_both_arms(tmp_path):
    out = tmp_path / "frameworks.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "frameworks.py"), "--frameworks", "dataloader",
                        "--steps", "300", "--kill", "20", "--json", str(out)],
                       capture_output=True, text=True, env=env(), cwd=tmp_path, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads(out.read_text())["frameworks"]["dataloader"]
    trial = s["trials"][0]
    assert trial["hot_swap"]["survivors_kept"] is True and trial["hot_swap"]["replayed_steps"] <= 1
    assert trial["restart"]["survivors_kept"] is False          # torchrun's semantics: every worker restarted
    assert s["hot_swap_lost_s"] > 0 and s["restart_lost_s"] > 0
