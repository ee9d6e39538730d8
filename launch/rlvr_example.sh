#!/usr/bin/env bash
# RL with a verifiable reward on a real model: SmolLM2-135M-Instruct learns short arithmetic with GRPO and with the
# DAPO set, on 2 CPU ranks, held-out accuracy before and after (examples/rlvr/run.py has the settings).
#   bash launch/rlvr_example.sh                      # after README command (1) or bash tools/setup_env.sh
#   SEEDS=1 CONFIGS=grpo STEPS=30 OUT=outputs/rlvr bash launch/rlvr_example.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHON="${PYTHON:-.venv/bin/python}"
export OUT="${OUT:-outputs/rlvr}"
export SEEDS="${SEEDS:-1,2,3}"
export CONFIGS="${CONFIGS:-grpo,dapo}"
export STEPS="${STEPS:-30}"
export NPROC="${NPROC:-2}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$PYTHON" examples/rlvr/run.py --out "$OUT" --seeds "$SEEDS" --configs "$CONFIGS" --steps "$STEPS" \
  --nproc "$NPROC" "$@"
