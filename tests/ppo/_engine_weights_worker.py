"""Worker for test_engine_weights.py (2 ranks): after an update and a sync, every weight vLLM computes with equals
the trainer's, bit for bit in the engine's dtype (read back through vLLM's own GEMMs, tied head included).

1. sync, one optimizer step, then a sync that drops --skip (one HF tensor): the engine must differ in exactly the
   vLLM tensors built from it (negative control: a stale tensor is seen)
2. (tied model) a full sync whose tied-head repack is switched off: the head's packed GEMM copy must be stale
   while its parameter (the embedding's) is current (negative control for the head vLLM's reload skips)
3. a full sync: no tensor differs
Each rank compares its own vLLM shard; rank 0 prints one JSON line.
"""
import argparse
import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--actor", required=True)
p.add_argument("--tp", type=int, default=1, help="megatron TP")
p.add_argument("--vllm_tp", type=int, default=1)
p.add_argument("--dtype", default="bfloat16", help="vLLM's dtype (the trainer runs bf16)")
p.add_argument("--skip", required=True, help="HF tensor the negative-control sync leaves out")
a = p.parse_args()

from rlhf.algo.losses import _masked_nll  # noqa: E402
from rlhf.distributed import DistEnv, initialize_mesh  # noqa: E402
from rlhf.runtime.role import ModelRole, OptimConfig  # noqa: E402
from rlhf.models.outputs import next_token_logprobs_from_hidden  # noqa: E402
from rlhf.rollout import RolloutConfig, build_rollout, shutdown  # noqa: E402
from rlhf.rollout import vllm_generator  # noqa: E402
from rlhf.rollout.weight_sync import WeightSync, compare_engine_weights, engine_layout  # noqa: E402

mesh = initialize_mesh(a.tp, 1, DistEnv.from_environ(), seed=5)
actor = ModelRole(mesh, a.actor, optim=OptimConfig(lr=5e-2, warmup_ratio=0.0, scheduler="constant"), name="actor",
                    bf16=True)
cfg = RolloutConfig(tensor_parallel_size=a.vllm_tp, kv_cache_bytes=32 << 20, max_model_len=64, backend="vllm",
                    dtype=a.dtype)
engine = build_rollout(mesh, actor, cfg, a.actor)
sync = WeightSync(actor, mesh, bucket_bytes=1 << 18)


class Skipping:
    """The engine, but its weight loads drop one HF tensor (a sync that forgets it)."""

    def __init__(self, inner, skip: str):
        self.inner, self.skip = inner, skip

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def load_weights(self, weights, version):
        self.inner.load_weights(((n, t) for n, t in weights if n != self.skip), version)


def check() -> dict:
    """This rank's engine shard against the trainer's current weights; every rank's result, on every rank."""
    hf = {n: t.clone() for n, t in sync.iter_hf_tensors()}  # collective
    want = engine_layout(hf, actor.spec, a.vllm_tp, mesh.rank % a.vllm_tp)
    got = engine.read_weights()
    r = compare_engine_weights(got, want)
    r["dtype"] = str(got["model.norm.weight"].dtype)
    out = [None] * mesh.world_size
    dist.all_gather_object(out, r)
    return out


sync.sync(engine)
first = check()
before = {n: t.clone() for n, t in sync.iter_hf_tensors()}
ids = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11]] * 2)
mb = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
# The NLL through the fused head on the final hidden states, as the PPO update reads them (the same loss through
# megatron's bf16 logits, sft_loss, gave an infinite grad norm on this tiny model at DP 2: the update was skipped).
metrics = actor.train_step([mb], lambda b, hidden: _masked_nll(next_token_logprobs_from_hidden(actor, b, hidden),
                                                               b["loss_mask"][:, 1:]), ("loss",), output="hidden")
moved = {n: int((t != before[n]).sum()) for n, t in sync.iter_hf_tensors()}  # the update changed the skipped one
sync.sync(Skipping(engine, a.skip))
skipped = check()
no_repack = None
if actor.spec.tie_word_embeddings:
    keep = vllm_generator.repack_cpu_lm_head
    vllm_generator.repack_cpu_lm_head = lambda model: False
    sync.sync(engine)
    vllm_generator.repack_cpu_lm_head = keep
    no_repack = check()
sync.sync(engine)
final = check()
tied = engine.llm.apply_model(lambda m: m.lm_head.weight is m.model.embed_tokens.weight)[0]
sgl = torch.cpu._is_amx_tile_supported() and a.dtype == "bfloat16"  # vLLM's check_cpu_sgl_kernel
if mesh.is_rank0:
    print("RESULT " + json.dumps({"first": first, "skipped": skipped, "no_repack": no_repack, "final": final,
                                  "moved": moved, "update": metrics, "head_is_embedding": tied,
                                  "head_packs_a_copy": sgl, "quiet": sorted(engine.quiet_reload.classes),
                                  "dropped": engine.quiet_reload.dropped}), flush=True)
shutdown(mesh, engine)
sys.exit(0)
