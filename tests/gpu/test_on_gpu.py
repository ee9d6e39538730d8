"""The GPU check's correctness parts as tests, one per check: each runs through the check's runner
(tests/gpu/gpu_check.py, with its part's deadline) on the machine's GPU and must PASS. Without CUDA every test here
is skipped (the ``gpu`` marker, tests/conftest.py). The speed parts (``speed``, ``speed_variants``, ``rl_update``)
are measurements against goals, not pass/fail properties of the trainer: they stay the runner's, as does the device
call of the lent machine (tests/gpu/gpu_check.sh's header).

    .venv/bin/python -m pytest tests/gpu/test_on_gpu.py -n 0      # on a CUDA machine
"""
import importlib.util
import os

import pytest
from helpers import REPO

pytestmark = pytest.mark.gpu
PARTS = ("fp32", "bf16", "resume")


def _runner():
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(REPO, "tests", "gpu", "gpu_check.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gc = _runner()


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """One work folder for every check: the models and data (the runner's assets) are made once."""
    return tmp_path_factory.mktemp("gpu_check")


@pytest.mark.parametrize("check", [name for part in PARTS for name in gc.PARTS[part]])
def test_check_passes_on_the_gpu(check, work):
    results = work / "results" / check
    rc = gc.main(["--only", check, "--out", str(work / "out"), "--results", str(results)])
    assert rc == 0, (results / "summary.txt").read_text()
