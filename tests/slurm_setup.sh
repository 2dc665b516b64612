#!/bin/bash
# tests/slurm_setup.sh - install what the Slurm tests need, when missing (idempotent).
#
#   sudo tests/slurm_setup.sh        # CI calls this from .ci/run; tests/slurm_harness.py calls it too
#
# Installs Debian 12's slurmctld, slurmd, slurm-client and munge (Slurm 22.05, built with
# multiple-slurmd, which the harness needs to run several fake nodes on one machine) and
# and shellcheck (for tests/test_templates_lint.py). Does nothing when every tool is present.
# Exit status: 0 when everything is installed afterwards; 1 otherwise (not root, no apt-get,
# or the install failed), with the reason on stderr.
set -euo pipefail

need=()
for cmd_pkg in slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client munged:munge shellcheck:shellcheck; do
  command -v "${cmd_pkg%%:*}" >/dev/null 2>&1 || need+=("${cmd_pkg#*:}")
done
[ "${#need[@]}" -eq 0 ] && { echo "slurm_setup: all present"; exit 0; }

echo "slurm_setup: installing ${need[*]}"
[ "$(id -u)" = 0 ] || { echo "slurm_setup: need root to install ${need[*]}" >&2; exit 1; }
command -v apt-get >/dev/null 2>&1 || { echo "slurm_setup: no apt-get; install ${need[*]} by hand" >&2; exit 1; }
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends "${need[@]}"
for c in slurmctld slurmd sbatch munged shellcheck; do
  command -v "$c" >/dev/null 2>&1 || { echo "slurm_setup: $c still missing after install" >&2; exit 1; }
done
echo "slurm_setup: done"
