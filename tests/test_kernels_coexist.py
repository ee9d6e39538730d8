"""This project's kernels (``rlhf.kernels``) and Hugging Face's ``kernels`` package (transformers' hub kernels,
GPT-OSS's MXFP4 among them; tools/setup_env.sh installs it) side by side: each import name gives its own package,
transformers finds and imports its integration, and both work. Control: a package named ``kernels`` ahead of HF's
on the path (what this project's top-level ``kernels/`` was, from the repository's root or the editable install)
breaks transformers' integration import."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import torch

from helpers import REPO


def test_hf_kernels_and_rlhf_kernels_both_import_and_work():
    import kernels as hf_kernels
    from transformers.utils import is_kernels_available

    import rlhf.kernels as ours

    assert hasattr(hf_kernels, "get_kernel") and "site-packages" in hf_kernels.__file__, hf_kernels.__file__
    assert ours.__file__.startswith(os.path.join(REPO, "rlhf", "kernels"))
    assert is_kernels_available()
    import transformers.integrations.hub_kernels as hub  # noqa: F401  (imports `from kernels import ...`)

    g = torch.Generator().manual_seed(0)
    logits, ids = torch.randn(4, 32, generator=g), torch.randint(0, 32, (4,), generator=g)
    want = torch.log_softmax(logits.double(), -1).gather(1, ids[:, None]).squeeze(1)  # fp64 by hand
    torch.testing.assert_close(ours.token_logprobs(logits, ids).double(), want, rtol=0, atol=1e-5)


def test_a_package_named_kernels_on_the_path_breaks_transformers(tmp_path):
    shutil.copytree(os.path.join(REPO, "rlhf", "kernels"), tmp_path / "kernels")
    code = "import transformers.integrations.hub_kernels"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    bad = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode != 0 and "ImportError" in bad.stderr, bad.stderr[-500:]
    good = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert good.returncode == 0, good.stderr[-500:]
