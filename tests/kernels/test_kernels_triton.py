"""Triton kernels, each check in a child pytest process so TRITON_INTERPRET never leaks into this session.

- interpreter: triton_cases.py under TRITON_INTERPRET=1 + RLHF_KERNELS_FORCE_TRITON=1 on CPU.
- AOT: triton_aot_cases.py compiles every kernel for sm_90 (PTX + cubin, no GPU needed).
- GPU: triton_cases.py natively on CUDA, when there is one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


HERE = Path(__file__).resolve().parent
# Missing triton skips on a developer's machine and fails under CI=true (helpers.require).
needs_triton = pytest.mark.usefixtures("triton_installed")


@pytest.fixture
def triton_installed() -> None:
    from helpers import require

    require("triton", "the Triton kernels")


@needs_triton
def test_triton_kernels_in_interpreter(child_env, run_child_pytest):
    env = child_env(TRITON_INTERPRET="1", RLHF_KERNELS_FORCE_TRITON="1", KERNELS_TEST_DEVICE="cpu")
    run_child_pytest(HERE / "triton_cases.py", env)


@needs_triton
def test_triton_kernels_compile_for_sm90(child_env, run_child_pytest):
    run_child_pytest(HERE / "triton_aot_cases.py", child_env(TRITON_DEFAULT_FP_FUSION="1"))


@pytest.mark.gpu
@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_kernels_on_gpu(child_env, run_child_pytest):
    run_child_pytest(HERE / "triton_cases.py", child_env(KERNELS_TEST_DEVICE="cuda"))
