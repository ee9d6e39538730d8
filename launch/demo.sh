#!/usr/bin/env bash
# The embedded default job (README command 1): SFT -> reward model -> PPO with colocated vLLM on the bundled
# task, on 2 ranks, then before/after figures on held-out prompts, a PNG plot and TensorBoard logs.
#   bash launch/demo.sh            (after: bash tools/setup_env.sh)
#   OUT=outputs/demo SEED=1 NPROC=2 bash launch/demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
exec "${PY:-.venv/bin/python}" examples/demo/run.py --out "${OUT:-outputs/demo}" --seed "${SEED:-1}" \
  --nproc "${NPROC:-2}" ${QUICK:+--quick}
