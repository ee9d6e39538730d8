#!/usr/bin/env bash
# SFT under OpenMPI's mpirun: launch/mpirun.sh sft (its header has the variables and an example).
set -euo pipefail
exec bash "$(dirname "$0")/mpirun.sh" sft "$@"
