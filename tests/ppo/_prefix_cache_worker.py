"""Worker for test_prefix_caching.py (one rank): vLLM in-process with prefix caching on (--vllm_enable_prefix_caching,
OpenRLHF's --vllm.enable_prefix_caching), prompts of 140 tokens (vLLM's CPU KV block is 128 tokens: the first block of
each prompt is cached).

1. sync, generate: vLLM's log-probs == the trainer's (the cache is filled with these weights)
2. one actor update, sync (which resets the cache), generate the same prompts: still == the trainer's
3. negative control: another update, a sync with the cache reset disabled: the cached prompt blocks of the old
   weights are reused, and vLLM's log-probs leave the trainer's.
Prints one JSON line.
"""
import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import torch  # noqa: E402

from rlhf.algo.losses import sft_loss  # noqa: E402
from rlhf.distributed import DistEnv, initialize_mesh  # noqa: E402
from rlhf.runtime.role import ModelRole, OptimConfig  # noqa: E402
from rlhf.ppo.experience import sampled_logprob_drift  # noqa: E402
from rlhf.rollout import RolloutConfig, build_rollout, shutdown  # noqa: E402
from rlhf.rollout.weight_sync import WeightSync  # noqa: E402

from rlhf.observability.metrics import setup_logging  # noqa: E402

setup_logging(0)
actor_dir = sys.argv[1]
mesh = initialize_mesh(1, 1, DistEnv.from_environ(), seed=5)
actor = ModelRole(mesh, actor_dir, optim=OptimConfig(lr=5e-2, warmup_ratio=0.0, scheduler="constant"), name="actor")
cfg = RolloutConfig(tensor_parallel_size=1, kv_cache_bytes=32 << 20, max_model_len=160, backend="vllm",
                    enable_prefix_caching=True)
engine = build_rollout(mesh, actor, cfg, actor_dir)
sync = WeightSync(actor, mesh)
prompts = [[1] + [20 + i + 10 * (j % 3) + j // 3 for j in range(139)] for i in range(2)]


def drift(seed):
    return sampled_logprob_drift(engine, actor, mesh, prompts, n=2, max_tokens=6, temperature=0.7, seed=seed)


def update():
    ids = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11]] * 2)
    mb = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    actor.train_step([mb], lambda b, logits: sft_loss(logits, b["input_ids"], b["loss_mask"], tp_group=None,
                                                       vocab_size=actor.spec.vocab_size), ("loss",))


out = {"enabled": bool(engine.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching)}
sync.sync(engine)
out["first"] = drift(1)
update()
sync.sync(engine)
out["after_sync"] = drift(2)
update()
real_reset = engine.llm.reset_prefix_cache
engine.llm.reset_prefix_cache = lambda *a, **k: True  # the control: a sync that keeps the old weights' KV blocks
sync.sync(engine)
out["without_reset"] = drift(3)
engine.llm.reset_prefix_cache = real_reset
print("RESULT " + json.dumps(out), flush=True)
shutdown(mesh, engine)
sys.exit(0)
