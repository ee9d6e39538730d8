#!/usr/bin/env bash
# The suite's job tests (every test file that launches a job) with each job started by torchrun itself, as users
# start them: fresh interpreters, every rank its own string hash seed and imports, no zygote or forkrun. Not part of
# .ci/run (it pays each job's imports again: much slower than the suite); run it before a release, or when a job
# test's result might depend on how its ranks were started.
#   bash tools/test_with_torchrun.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
files=$(grep -rlE "run_torchrun|torchrun_cmd|run_tagged" tests --include='test_*.py' | sort)
RLHF_TEST_LAUNCHER=torchrun exec .venv/bin/python -m pytest $files -q "$@"
