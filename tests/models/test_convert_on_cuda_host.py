"""A CPU dry run of the HF export's converter subprocess on a GPU host: the subprocess that ``rlhf.runtime.export`` starts
(``tools/convert_megatron_to_hf.py``, the environment it gets from a CUDA training job: no ``RLHF_DEVICE``) runs with
``torch.cuda.is_available()`` answering True on a "CUDA build", so the CPU shim takes the branch it takes beside a
training job on a GPU. On this CPU-only build any real CUDA call still raises, so a converter that touched the GPU
fails here."""
import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import REPO, run_python, tail
from safetensors.torch import load_file

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a real GPU host: nothing to pretend")

# Loaded first by the converter process (PYTHONPATH); it writes what it saw to $DRY_RUN_REPORT at exit.
SITECUSTOMIZE = '''
import atexit, json, os, sys
import torch

torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
torch.version.cuda = "13.0"  # a CUDA build


def _report():
    shim = sys.modules.get("rlhf.compat.cuda")
    real = [n for n, m in list(sys.modules.items())
            if n.startswith("megatron.") and m is not None and getattr(m, "torch", None) is torch]
    t = torch.ones(1)
    try:
        t.cuda()  # from outside megatron: the real method, which raises on this CPU build
        ours = "identity"
    except (AssertionError, RuntimeError):
        ours = "real"
    scope = {"__name__": "megatron.core.fake", "t": t}
    exec("out = t.cuda()", scope)  # from a megatron module: the identity
    report = {"installed": bool(shim and shim.is_installed()), "megatron_on_real_torch": real, "our_tensor_cuda": ours,
              "megatron_tensor_cuda_device": str(scope["out"].device)}
    with open(os.environ["DRY_RUN_REPORT"], "w") as f:
        json.dump(report, f)


atexit.register(_report)
'''


def test_converter_subprocess_on_a_gpu_host(tmp_path):
    """The converter installs the shim (its engine is the CPU), converts bit for bit, and leaves the GPU to others:
    no megatron module left on the real torch (modules that building the model imports are rebound too), and the
    real ``Tensor.cuda`` for code outside megatron. Before the fix: 5 megatron modules (attention among them) kept
    the real torch, and ``.cuda()`` returned host tensors for every caller in the process."""
    from rlhf.distributed.env import env_without_launcher
    from rlhf.distributed.parent_death import DIE_WITH_PARENT_ENV
    from rlhf.models.tiny import make_tiny_hf

    hf, mg, back = str(tmp_path / "hf"), str(tmp_path / "mg"), str(tmp_path / "back")
    make_tiny_hf(hf, "llama", seed=3, num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    p = run_python([os.path.join(REPO, "tools", "convert_hf_to_megatron.py"), "--hf", hf, "--out", mg])
    assert p.returncode == 0, tail(p)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**env_without_launcher(), DIE_WITH_PARENT_ENV: "1", "DRY_RUN_REPORT": str(tmp_path / "report.json"),
           "PYTHONPATH": os.pathsep.join([str(site), REPO, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    env.pop("RLHF_DEVICE", None)  # a CUDA training job's export sets none
    p = subprocess.run([sys.executable, os.path.join(REPO, "tools", "convert_megatron_to_hf.py"), "--ckpt", mg,
                        "--out", back, "--overwrite"], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, tail(p)
    report = json.load(open(tmp_path / "report.json"))
    assert report["installed"], report
    assert report["megatron_on_real_torch"] == [], report
    assert report["our_tensor_cuda"] == "real", report
    assert report["megatron_tensor_cuda_device"] == "cpu", report
    a, b = load_file(os.path.join(hf, "model.safetensors")), load_file(os.path.join(back, "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
