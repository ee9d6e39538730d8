#!/usr/bin/env bash
# The single-GPU check (one machine, one GPU, one rank) in parts, each within one call of the lent GPU machine
# (tests/gpu/gpu_check.py's docstring lists what each part checks):
#   fp32        kernels at real shapes against fp64 references; SFT (padded, with its checkpoint and HF export; packed),
#               PPO with offload and RM, in fp32                                      deadline 170 s
#   bf16        SFT packed, PPO with offload, an MoE SFT, RM, SFT padded, MoE GRPO with routing replay, in bf16
#                                                                                      deadline 170 s
#   resume      a resume on CUDA (bit for bit)                                      deadline 100 s
#   speed       the SFT step side by side with transformers and transformers + Liger at Llama-3.2-1B's and
#               SmolLM2-135M's shapes: tokens/s, MFU, peak memory, ratios (tests/gpu/gpu_speed.py)   deadline 420 s
#   speed_variants  which fused kernel pays at which shape (RLHF_FUSED_PARTS; first wgrad) deadline 420 s
#   rl_update   the actor's RL update against transformers + Liger's fused GRPO loss  deadline 300 s
#   decode      the megatron generator's decode against transformers' generate     deadline 300 s
#   grpo        the whole GRPO step against TRL's GRPOTrainer (+ use_liger_kernel)  deadline 480 s
# One PASS/FAIL/NOT RUN line per check (a FAIL line carries the failing log's traceback and last lines), then
# "N passed, M failed, K not run". A check that would start with under 30 s of its part's deadline left, or whose
# launch the deadline cuts, is NOT RUN, so each part ends inside its call; rerun what a part did not reach by name
# (--only sft_bf16,rm_bf16). Bulky outputs stay in outputs/gpu_check (ignored by git; a warm machine keeps them,
# and the assets, between calls); $OUT gets 4 small files, rewritten after every check: check.log (the tee below),
# summary.txt, tails.txt (the last 60 lines of every launch's log) and figures.json (every figure, with each check's
# and launch's seconds).
# Without a usable GPU it stops at its first GPU-only step with one STOP: line; --rehearse_on_cpu runs the launches
# on the CPU at small shapes instead (to catch a wrong flag before machine time is spent).
#
# On the lent machine (the device tool's `run`): first fetch the wheels here (below) and check the carry with
# `python tests/gpu/gpu_carry.py` (18.5 MiB measured, of 64). A machine stays warm only 30 s after a call and its start
# takes 41-49 s, so the three parts go in ONE call (measured on an H200, 2026-11-27: 452 s, 501 s held with the
# start), each part's 3 result files packed into <part>.tgz as it ends (at most 8 files come back from $OUT):
#
#   run(timeout_s=600, carry=["tests/gpu/wheels"], command=
#       "set -o pipefail; for p in resume fp32 bf16; do bash tests/gpu/gpu_check.sh --only $p --results $OUT/cur
#        2>&1 | tee -a $OUT/check.log; tar czf $OUT/$p.tgz -C $OUT cur; rm -rf $OUT/cur; done")
#
# (the tee keeps the lines coming if the call's limit kills the check; the reply's output_tail has them too). The
# about 6 minutes left then rerun, in a second call, by name what failed or was not reached, with --deadline_s.
# Copy each part's files to bench/results/gpu_<part>_<file> (files directly under bench/results are tracked, its
# folders are ignored) and give the machine back after the last call. The speed part (2026-11-28: 328 s) goes in a
# call of its own with the wheels of tests/gpu/wheels (liger-kernel among them); it profiles our fused steps 9-10
# into the results folder (rlhf/observability/profiling.py).
#
# For a machine with Python 3.12 and torch preinstalled but no package registry: what it lacks comes as wheels in
# ${RLHF_WHEELS:-tests/gpu/wheels} (ignored by git; about 20 MB), installed with --no-index --no-deps into a
# target folder put on PYTHONPATH. Fetch them elsewhere, where pip reaches PyPI:
#
#   P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
#      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d tests/gpu/wheels"
#   pip download $P megatron-core==0.16.1 regex==2026.11.15 transformers==5.19.0 liger-kernel==0.8.5 \
#     trl==1.12.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
#
# (the last four for the grpo part: TRL 1.12.0 and what its datasets needs beyond the machine's pyarrow, pandas and
# xxhash; about 1.8 MB)
#
# (the versions tools/setup_env.sh resolved on a CPU machine; the machine's own torch, triton, safetensors, numpy,
# accelerate, tokenizers and huggingface_hub are used: its huggingface_hub 1.33 satisfies transformers 5.19, while a
# carried huggingface_hub 2.x breaks `import transformers` there, needing httpx2, httpcore2, truststore, click>=8.4.2
# and hf-xet>=1.6). It runs on the machine's torch (seen there: 2.11 with CUDA 13), not the torch 2.13.0 that
# setup.py pins; the header prints both. vLLM (and torch 2.13) wheels are larger than one copy to such a machine:
# without vLLM the PPO checks run the megatron generator and say so. Transformer Engine is not installed by this
# script (it builds from source against the installed torch: RLHF_WITH_TE=1 bash tools/setup_env.sh on a machine
# with a registry); without it the local layer spec runs.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-python3}"
WHEELS="${RLHF_WHEELS:-tests/gpu/wheels}"
SITE="${RLHF_GPU_SITE:-/tmp/rlhf_gpu_site}"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  # A warm machine's next call finds the same wheels installed and skips the install.
  stamp="$SITE/.rlhf-wheels-$(stat -c '%n %s' "$WHEELS"/*.whl | sha1sum | cut -c1-12)"
  if [ ! -f "$stamp" ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$WHEELS"/*.whl
    touch "$stamp"
  fi
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "# no wheels in $WHEELS: using the packages installed here"
fi
export PYTHONUNBUFFERED=1
exec "$PYTHON" tests/gpu/gpu_check.py "$@"
