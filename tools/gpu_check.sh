#!/usr/bin/env bash
# The single-GPU check (one machine, one GPU, one rank): kernels at real shapes against fp64 references, SFT / RM /
# PPO in fp32 and bf16 with offload, and a resume on CUDA. One PASS/FAIL line per check, then "N passed, M failed"
# (tools/gpu_check.py). Under 25 minutes on an H100. Without a usable GPU it stops at its first GPU-only step.
#
#   bash tools/gpu_check.sh [--out DIR] [--only kernels,sft,rm,ppo,resume] 2>&1 | tee bench/results/gpu/check.log
#
# For a machine with Python 3.12 and torch preinstalled but no package registry: what it lacks comes as wheels in
# ${RLHF_WHEELS:-tools/gpu_wheels} (ignored by git; about 20 MB), installed with --no-index --no-deps into a
# target folder put on PYTHONPATH. Fetch them elsewhere, where pip reaches PyPI:
#
#   P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
#      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d tools/gpu_wheels"
#   pip download $P megatron-core==0.16.1 regex==2026.11.15 transformers==5.19.0
#
# (the versions tools/setup_env.sh resolved on a CPU machine; the machine's own torch, triton, safetensors, numpy,
# accelerate, tokenizers and huggingface_hub are used: its huggingface_hub 1.33 satisfies transformers 5.19, while a
# carried huggingface_hub 2.x breaks `import transformers` there, needing httpx2, httpcore2, truststore, click>=8.4.2
# and hf-xet>=1.6). It
# runs on the machine's torch (seen there: 2.11 with CUDA 13), not the torch 2.13.0 that setup.py pins; the
# header prints both. vLLM (and torch 2.13) wheels are larger than one copy to such a machine: without vLLM the
# PPO check runs the megatron generator and says so. Transformer Engine is not installed by this script (it
# builds from source against the installed torch: RLHF_WITH_TE=1 bash tools/setup_env.sh on a machine with a
# registry); without it the local layer spec runs.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
WHEELS="${RLHF_WHEELS:-tools/gpu_wheels}"
SITE="${RLHF_GPU_SITE:-/tmp/rlhf_gpu_site}"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "# no wheels in $WHEELS: using the packages installed here"
fi
exec "$PYTHON" tools/gpu_check.py "$@"
