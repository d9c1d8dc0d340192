#!/usr/bin/env bash
# Debian packages the test suite needs beyond Python: sshd + pdsh (multi-node launch over ssh),
# SLURM + munge (sbatch/srun launch), OpenMPI (mpirun launch, mpi4py build), bubblewrap and
# Debian's python3 (the code-reward sandbox runs /usr/bin/python3), Chromium (the run report is
# opened headless in a test). Idempotent; needs root (or
# sudo). Real jobs need only what their launcher uses: see docs/cluster-launching.md.
set -euo pipefail
PACKAGES=(openssh-server openssh-client pdsh slurm-wlm munge openmpi-bin libopenmpi-dev bubblewrap procps python3
          chromium fonts-dejavu-core)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "megagrpo: system packages present"
  exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "megagrpo: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q >/dev/null
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
echo "megagrpo: system packages installed"
