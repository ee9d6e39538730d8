"""Suite-wide settings: 1 thread per process, CUDA-only tests skipped cleanly on CPU machines."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# PPO offloads for real on CPU too, so the tests exercise the CUDA path's copies (rlhf.offload.cpu_offload_moves)
os.environ.setdefault("RLHF_OFFLOAD_ON_CPU", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
