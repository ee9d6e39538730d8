#!/usr/bin/env bash
# Create (or reuse) bench/.venv-trl: TRL 1.12.0 (its last release with PPO, trl.experimental.ppo) for
# bench/ppo_vs_trl.py and bench/rlvr_vs_trl.py (GRPOTrainer). It is the comparisons' own environment, never the
# project's .venv.
#   bash bench/setup_trl.sh
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"
VENV="${TRL_VENV:-.venv-trl}"
stamp="$VENV/.trl-setup-$(sha1sum setup_trl.sh | cut -c1-12)"
[ -f "$stamp" ] && exit 0
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first and pinned: an unpinned resolve would fetch a multi-GB CUDA build.
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q "trl==1.12.0" "transformers>=4.56.2,<6" "accelerate>=1.4.0" "datasets>=4.7.0" \
  psutil requests "math-verify==0.9.0"  # requests: TRL 1.12.0 GRPOTrainer imports it; math-verify: the verifier bench/rlvr_vs_trl.py's reward shares with ours
"$VENV/bin/python" -c "import torch, transformers, trl; from trl.experimental.ppo import PPOTrainer; \
print('trl env ok: trl', trl.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
rm -f "$VENV"/.trl-setup-*
touch "$stamp"
