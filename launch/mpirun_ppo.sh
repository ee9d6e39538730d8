#!/usr/bin/env bash
# PPO (four colocated models + vLLM) under OpenMPI's mpirun: launch/mpirun.sh ppo (its header has the variables and an example).
set -euo pipefail
exec bash "$(dirname "$0")/mpirun.sh" ppo "$@"
