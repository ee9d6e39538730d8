#!/usr/bin/env bash
# The single-GPU check (one machine, one GPU, one rank): kernels at real shapes against fp64 references, SFT (padded
# and packed) / RM / PPO in fp32 and bf16 with offload, a resume on CUDA, and a timed SmolLM2-135M-size SFT (MFU).
# One PASS/FAIL line per check, then "N passed, M failed" (tools/gpu_check.py). It fits one call of the lent GPU
# machine: every launch has its own limit (RLHF_GPU_STEP_TIMEOUT_S, 110 s) and the whole check a deadline
# (RLHF_GPU_DEADLINE_S, 560 s) after which launches are skipped, so a partial run still prints its summary and
# leaves its logs. Without a usable GPU it stops at its first GPU-only step with one STOP: line.
#
# On the lent machine (the device tool's `run`): first fetch the wheels here (below), check the carry with
# `python tools/gpu_carry.py` (17.5 MiB measured, of 64), then one call with carry ["tools/gpu_wheels"] and
# timeout_s 590:
#
#   mkdir -p $OUT/gpu && bash tools/gpu_check.sh --out $OUT/gpu > $OUT/gpu/check.log 2>&1; tail -40 $OUT/gpu/check.log
#
# and copy $OUT/gpu (check.log and the per-launch logs) into bench/results/gpu/.
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
