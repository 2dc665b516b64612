"""benchmarks/abortable_overhead.py at its smallest, so the per-op cost docs/benchmarks.md quotes ("The comm-timeout
stall, fixed") cannot stop being produced unnoticed. The figures are not asserted (timing belongs to the benchmark);
what is: both arms timed every round, and the wrapped arm's sums bit-identical to the raw arm's."""
import json
import subprocess
import sys

from tests.harness import ROOT, env


def test_both_arms_timed_and_the_wrapped_sums_identical(tmp_path):
    out = tmp_path / "abortable.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "abortable_overhead.py"), "--rounds", "2",
                        "--small", "20", "--large", "4", "--json", str(out)],
                       capture_output=True, text=True, env=env(), cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["bit_identical"] is True
    assert {k: len(v) for k, v in got["per_round_s"].items()} == {
        "small_raw": 2, "small_wrapped": 2, "large_raw": 2, "large_wrapped": 2}
    assert all(v > 0 for v in got["median_us"].values()) and got["ratio_small"] > 0 and got["ratio_large"] > 0
