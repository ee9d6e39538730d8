"""Worker for test_weight_sync.py (2 ranks): megatron actor at --tp/--pp, vLLM at TP 2, in the same processes.

With --lora_rank the actor trains adapters only and the sync sends merged weights (and no adapter tensor); with
--lora_sync adapter too, vLLM gets the base once and then the adapters alone (vLLM's LoRA path), and 5. the same
engine given the merged weights instead, with no adapter, samples the same tokens with the same log-probs.

1. sync -> vLLM log-probs of its own samples == trainer log-probs (fp32, max |diff| <= 1e-4)
2. one optimizer step on the actor, no sync -> the stale engine disagrees (> 1e-2): the check can fail
3. sync again -> agreement restored; the version counter moved 1 -> 2.
4. (CPU) sleep frees vLLM's packed weights, generating then fails, and wake + sync + generate gives 3.'s figure;
   serving adapters, sleep keeps the base (the next sync sends the adapters alone), and a base sent again under
   trained adapters (unmerged) still agrees.
Prints one JSON line on rank 0.
"""
import argparse
import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import torch  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--actor", required=True)
p.add_argument("--tp", type=int, default=1)
p.add_argument("--pp", type=int, default=1)
p.add_argument("--ep", type=int, default=1, help="MoE actor: experts over this many ranks")
p.add_argument("--bucket_mb", type=float, default=0.25)
p.add_argument("--lora_rank", type=int, default=0, help="LoRA actor: vLLM must get the merged weights")
p.add_argument("--lora_sync", default="merged", choices=["merged", "adapter"])
p.add_argument("--prompt_len", type=int, default=4, help="longer prompts reach past a scaled RoPE's original context")
a = p.parse_args()

from rlhf.distributed import DistEnv, initialize_mesh  # noqa: E402
from rlhf.runtime.role import ModelRole, OptimConfig  # noqa: E402
from rlhf.ppo.experience import sampled_logprob_drift  # noqa: E402
from rlhf.rollout import RolloutConfig, build_rollout  # noqa: E402
from rlhf.rollout.weight_sync import WeightSync  # noqa: E402

mesh = initialize_mesh(a.tp, a.pp, DistEnv.from_environ(), seed=5, ep=a.ep)
from rlhf.models.lora import LoraConfig  # noqa: E402

lora = LoraConfig(rank=a.lora_rank, alpha=2.0 * a.lora_rank) if a.lora_rank else None
actor = ModelRole(mesh, a.actor, optim=OptimConfig(lr=5e-2, warmup_ratio=0.0, scheduler="constant"), name="actor",
                    lora=lora)
adapter = a.lora_sync == "adapter"
cfg = RolloutConfig(tensor_parallel_size=2, kv_cache_bytes=32 << 20, max_model_len=64, backend="vllm",
                    lora_adapter_rank=a.lora_rank if adapter else 0)
engine = build_rollout(mesh, actor, cfg, a.actor)
sync = WeightSync(actor, mesh, bucket_bytes=int(a.bucket_mb * 2**20))
T, temp = 8, 0.7
prompts = [[1] + [20 + i + 10 * (j % 3) + j // 3 for j in range(a.prompt_len - 1)] for i in range(4)]


def drift(seed):
    return sampled_logprob_drift(engine, actor, mesh, prompts, n=2, max_tokens=T, temperature=temp, seed=seed)


stats1 = sync.sync(engine)
synced = drift(1)
# One real update of the actor (an SFT-style loss on some sequence).
from rlhf.algo.losses import sft_loss  # noqa: E402

ids = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11]] * 2)
mb = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
tp_group = mesh.tp_group if mesh.tp > 1 else None
actor.train_step([mb], lambda b, logits: sft_loss(logits, b["input_ids"], b["loss_mask"], tp_group=tp_group,
                                                   vocab_size=actor.spec.vocab_size), ("loss",))
stale = drift(2)
stats2 = sync.sync(engine)
resynced = drift(3)


def packed_refs(model):
    """Weak references to what each CPU ``cpu_linear`` closure holds (vLLM's packed weights) and to the layers'
    parameters that hold bytes."""
    import weakref

    refs = []
    for m in model.modules():
        fn = getattr(m, "cpu_linear", None)
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                refs.append(weakref.ref(cell.cell_contents))
            except TypeError:  # ints, None: not weights
                pass
    return refs


# 4. CPU: sleep frees vLLM's weights (the packed copies die), a generation before the next sync fails loudly, and
#    wake + sync + generate reproduces the resynced engine exactly.
released = {}
if adapter:  # 4'. the base stays through the sleep: the next sync sends the adapters alone
    engine.sleep()
    released["needs_base"] = engine.needs_base
    engine.wake_up(["weights"])
    stats3 = sync.sync(engine)
    released["bytes_after_sleep"] = stats3["weight_sync/bytes"]
    released["after_release"] = drift(3)
    engine.needs_base = True  # as after a level-2 sleep: the base again, now under trained adapters (B != 0)
    stats4 = sync.sync(engine)
    released["bytes_rebased"] = stats4["weight_sync/bytes"]
    released["rebased"] = drift(3)
    released["folders"] = sorted(os.listdir(sync.adapter_folders.root))
elif not engine.on_cuda:
    import gc

    refs = engine.llm.apply_model(packed_refs)[0]
    engine.sleep()
    gc.collect()
    released["packed_before"] = len(refs)
    released["packed_alive_after_sleep"] = sum(r() is not None for r in refs)
    released["needs_sync"] = engine.needs_sync
    try:
        drift(3)
        released["generate_while_released"] = "ran"
    except RuntimeError as e:
        released["generate_while_released"] = "raised" if "freed after the last rollout" in str(e) else str(e)
    engine.wake_up(["weights"])
    sync.sync(engine)
    released["needs_sync_after"] = engine.needs_sync
    released["after_release"] = drift(3)
merged, engine_version = {}, engine.version
if adapter:  # 5. the same engine with the merged weights and no adapter: the same samples, the same log-probs
    def sample(seed):
        return [(s.response_ids, s.logprobs) for s in engine.generate(prompts, n=2, temperature=temp, top_p=1.0,
                                                                      max_tokens=T, seed=seed)]

    served = sample(4)
    merged["bytes_synced"] = [stats1["weight_sync/bytes"], stats2["weight_sync/bytes"]]
    merged["adapter_bytes"] = stats2["weight_sync/adapter_bytes"]
    merged["lora_id"] = engine.lora_request.lora_int_id
    engine.load_weights(sync.iter_hf_tensors(), sync.version + 1)  # merged weights (sync.merge is True)
    merged["lora_after_merged_load"] = engine.lora_request is None
    plain = sample(4)
    same = [x[0] == y[0] for x, y in zip(served, plain)]
    merged["same_tokens"] = sum(same) / len(same)
    merged["max_logprob_diff"] = max((abs(p - q) for (ta, la), (tb, lb), ok in zip(served, plain, same) if ok
                                      for p, q in zip(la, lb)), default=float("inf"))
if mesh.is_rank0:
    print("RESULT " + json.dumps({"synced": synced, "stale": stale, "resynced": resynced, "released": released,
                                  "version": [stats1["weight_sync/version"], stats2["weight_sync/version"]],
                                  "buckets": stats2["weight_sync/buckets"], "seconds": stats2["weight_sync/seconds"],
                                  "engine_version": engine_version, "merged": merged,
                                  "trainable": sorted({n.rsplit(".", 1)[-1] for n, p in actor.model.named_parameters()
                                                       if p.requires_grad})}), flush=True)

from rlhf.rollout import shutdown  # noqa: E402

shutdown(mesh, engine)
sys.exit(0)
