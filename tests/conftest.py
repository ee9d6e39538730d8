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


# The heaviest test files, in falling order of their seconds on 2 CPU cores (CI, one process: sft_rm 243, demo
# 187, ppo_e2e 158, convert_cli 136, smollm2 133, lora_sft 120, ppo_bf16 ~115, dpo_kto 111, weight_sync 86,
# partial_ppo ~160 (5 short jobs, AMD EPYC with AVX2 only), launchers 72,
# parallel_equivalence 70, rejection_sampling 54, train/bf16 ~42, rollout_logprobs 40). pytest.ini
# runs the suite on 2 xdist workers a file at a time (--dist loadfile --no-loadscope-reorder), in collection order:
# the heaviest go first, so that the two workers end together instead of one running the demo alone at the end.
HEAVY_FIRST = ["train/test_sft_rm.py", "test_demo_pipeline.py", "ppo/test_ppo_e2e.py", "models/test_convert_cli.py",
               "models/test_smollm2.py", "train/test_lora_sft.py", "ppo/test_ppo_bf16.py", "dpo/test_dpo_kto.py",
               "ppo/test_weight_sync.py", "ppo/test_partial_ppo.py", "launch/test_launchers.py",
               "models/test_parallel_equivalence.py", "ppo/test_rejection_sampling.py", "train/test_bf16.py",
               "ppo/test_rollout_logprobs.py"]


def pytest_collection_modifyitems(config, items):
    rank = {"tests/" + f: i for i, f in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
