#!/usr/bin/env bash
# Install Debian's SLURM (slurm-wlm: slurmctld, slurmd, sbatch, srun, scontrol) and munge, for the
# `slurm`-marked tests, which start a 2-node SLURM cluster on this machine (tests/integration/slurm_cluster.py).
# Idempotent: when every binary is there it only says so. Installing needs root (apt-get); as another user
# it says what is missing and exits 0, and the `slurm` tests then skip with that reason.
#
# Usage: bash .ci/install_slurm.sh
set -euo pipefail
BINARIES=(munged slurmctld slurmd sbatch srun scontrol squeue)

missing=()
for b in "${BINARIES[@]}"; do
    command -v "$b" >/dev/null 2>&1 || missing+=("$b")
done
if [ ${#missing[@]} -eq 0 ]; then
    echo "slurm-wlm and munge are already installed"
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "slurm-wlm/munge missing (${missing[*]}); not root, so not installing them: the slurm tests will skip"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "slurm-wlm/munge missing (${missing[*]}) and there is no apt-get here: the slurm tests will skip"
    exit 0
fi
start=$(date +%s)
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# No services are started: there is no systemd here, and the tests start their own daemons.
apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
for b in "${BINARIES[@]}"; do
    command -v "$b" >/dev/null 2>&1 || { echo "slurm-wlm/munge installed but $b is missing" >&2; exit 1; }
done
echo "installed slurm-wlm $(slurmd -V | cut -d' ' -f2) and munge in $(( $(date +%s) - start )) s"
