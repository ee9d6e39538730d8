#!/usr/bin/env bash
# Reward-model training under OpenMPI's mpirun: launch/mpirun.sh rm (its header has the variables and an example).
set -euo pipefail
exec bash "$(dirname "$0")/mpirun.sh" rm "$@"
