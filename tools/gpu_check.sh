#!/usr/bin/env bash
# The GPU check of issue 18, one command on a machine with one CUDA GPU (the device machine: one H200, < 8 min):
#
#     bash tools/gpu_check.sh
#
# It runs `make test-gpu` (pytest -m gpu) on the test files that hold GPU tests: an NCCL generation's lifecycle on
# one rank (create, abort mid-collective from another thread, recreate, a collective succeeds), a snapshot slot
# registered as pinned memory, the D2H snapshot of a model with 1.6 GB of state overlapped with the next step
# (step time protected vs unprotected), a bit-exact restore, and the NVML reads.
#
# Python: a torch that already sees CUDA is used as it is (a venv with --system-site-packages); only without one
# is torch==2.13.0 installed (which may pull a CUDA wheel). Results go to $OUT (else ./gpu-check-out):
#   gpu_check.json   - exit status, seconds, python/torch/GPU, and the figures of tests/test_gpu.py
#   gpu_results.json - the figures alone; junit.xml; gpu_check.log - this script's whole output
# docs/benchmarks.md, "GPU", is where the figures go.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-$PWD/gpu-check-out}"
mkdir -p "$OUT_DIR"
exec > >(tee -a "$OUT_DIR/gpu_check.log") 2>&1
START=$(date +%s)
VENV="${VENV:-.venv-gpu}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_RETRIES=0 PIP_TIMEOUT=10   # offline: fail fast, never wait on retries

step() { echo "== $(( $(date +%s) - START ))s: $*"; }
# GPU_CHECK_ALLOW_CPU=1: take a torch without CUDA too (a dry run of this script's plumbing; the GPU tests skip)
cuda_torch() { "$1" -c 'import os, sys, torch; sys.exit(0 if torch.cuda.is_available() or os.environ.get("GPU_CHECK_ALLOW_CPU") == "1" else 1)' >/dev/null 2>&1; }

step "GPU"
nvidia-smi -L || echo "nvidia-smi not found"

step "python"
BASE=""
for cand in ${PYTHON:-} python3 python; do
    if command -v "$cand" >/dev/null 2>&1 && cuda_torch "$(command -v "$cand")"; then BASE=$(command -v "$cand"); break; fi
done
if [ -x "$VENV/bin/python" ] && cuda_torch "$VENV/bin/python"; then
    echo "reusing $VENV"
elif [ -n "$BASE" ]; then
    echo "torch with CUDA found at $BASE: using it"
    "$BASE" -m venv --system-site-packages "$VENV"
else
    echo "no torch with CUDA importable: installing torch==2.13.0"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q torch==2.13.0
fi
PY="$VENV/bin/python"
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())'

step "phoenixrun into $VENV"
if ! "$VENV/bin/pip" install -q -e '.[test]'; then
    echo "pip install -e .[test] failed (offline?); trying without build isolation and dependencies"
    if ! "$VENV/bin/pip" install -q --no-build-isolation --no-deps -e .; then
        echo "editable install failed: putting the repository on the path"
        echo "$PWD" > "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/phoenixrun-repo.pth"
    fi
    "$VENV/bin/pip" install -q pytest pytest-timeout crc32c psutil nvidia-ml-py 2>/dev/null || true
fi
"$PY" -c 'import phoenixrun, pytest, crc32c' || { echo "phoenixrun or its test dependencies are not importable"; }
touch "$VENV/bin/phoenixrun"   # the Makefile's install stamp: make test-gpu must not reinstall torch

step "make test-gpu"
GPU_TESTS=$(grep -l "pytest.mark.gpu" tests/test_*.py | tr '\n' ' ')
echo "files with GPU tests: $GPU_TESTS"
PHOENIXRUN_GPU_RESULTS="$OUT_DIR/gpu_results.json" timeout 420 \
    make test-gpu VENV="$VENV" GPU_TESTS="$GPU_TESTS" PYTEST_ARGS="-rs -v --junitxml=$OUT_DIR/junit.xml"
RC=$?

step "summary (make test-gpu exit $RC)"
RC=$RC SECONDS_TOTAL=$(( $(date +%s) - START )) OUT_DIR="$OUT_DIR" "$PY" - <<'PY'
import json, os, pathlib
out = pathlib.Path(os.environ["OUT_DIR"])
summary = {"rc": int(os.environ["RC"]), "seconds": int(os.environ["SECONDS_TOTAL"])}
try:
    import torch
    summary.update(torch=torch.__version__, cuda=torch.version.cuda,
                   gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                   nccl=".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None)
except Exception as e:  # noqa: BLE001
    summary["torch_error"] = repr(e)
results = out / "gpu_results.json"
summary["results"] = json.loads(results.read_text()) if results.exists() else None
(out / "gpu_check.json").write_text(json.dumps(summary, indent=2))
print(json.dumps({k: v for k, v in summary.items() if k != "results"}))
PY
exit $RC
