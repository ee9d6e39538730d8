"""vLLM with images against the trainer, run by test_vlm.py (2 ranks: megatron TP 2, vLLM TP 2, in the same
processes, vLLM started from dummy weights as the PPO job starts it):

    torchrun --nproc_per_node 2 tests/models/_vlm_vllm_worker.py WORKDIR

1. weight sync, then vLLM samples replies to 4 image prompts (2 each): its log-probs of them equal the trainer's
   forward with the same images (``synced``); the trainer with the pixels zeroed does not (``pixels_zeroed``);
2. one optimizer step on an image batch (the vision tower moves), then a sync of every tensor but the vision
   tower's: the engine disagrees (``tower_not_synced``); a full sync restores agreement (``resynced``).
Rank 0 writes WORKDIR/vllm_result.json.
"""
import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from rlhf.distributed import DistEnv, initialize_mesh  # noqa: E402
from rlhf.runtime.role import ModelRole, OptimConfig  # noqa: E402
from rlhf.ppo.experience import collate_sequences, forward_role, generator_logprobs, select_rows  # noqa: E402
from rlhf.rollout import RolloutConfig, build_rollout  # noqa: E402
from rlhf.rollout.weight_sync import WeightSync  # noqa: E402

work = sys.argv[1]
hf = os.path.join(work, "hf")
torch.set_num_threads(1)
mesh = initialize_mesh(2, 1, DistEnv.from_environ(), seed=5)
actor = ModelRole(mesh, hf, optim=OptimConfig(lr=5e-2, warmup_ratio=0.0, scheduler="constant"), name="actor")
from PIL import Image  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from rlhf.data.vision import VisionPart, expand_placeholders, process, vision_data  # noqa: E402
from rlhf.rollout.types import ImagePrompt  # noqa: E402

vd = vision_data(actor.spec, hf, VisionPart())
lo, hi = vd.pixels
proc = vd.processor
cfg = RolloutConfig(tensor_parallel_size=2, kv_cache_bytes=32 << 20, max_model_len=128, backend="vllm",
                    vision={"image_token_id": vd.image_token_id, "max_images": 1, "min_pixels": lo, "max_pixels": hi,
                            "image_mean": list(proc.image_mean), "image_std": list(proc.image_std),
                            "rescale_factor": float(proc.rescale_factor)})
engine = build_rollout(mesh, actor, cfg, hf)
sync = WeightSync(actor, mesh)
tok = AutoTokenizer.from_pretrained(hf)
vs, ve, pad = tok.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"])
prompts = []
for i, name in enumerate(("a.png", "b.png", "a.png", "b.png")):
    img = Image.open(os.path.join(work, "images", name)).convert("RGB")
    mm = process([img], vd)
    ids = [vs, pad, ve] + tok(["the quick", "lazy dog", "one two", "apple"][i])["input_ids"]
    prompts.append(ImagePrompt(expand_placeholders(ids, mm, vd, "worker"), mm, [img]))
T, temp = 8, 0.7


def drift(seed, zero_pixels=False):
    samples = engine.generate(prompts, n=2, temperature=temp, top_p=1.0, max_tokens=T, seed=seed)
    local = samples[mesh.dp_rank * len(samples):(mesh.dp_rank + 1) * len(samples)]  # dp 1: all
    batch = collate_sequences(local, 0, T)
    if zero_pixels:
        batch["pixel_values"] = torch.zeros_like(batch["pixel_values"])
    lp = forward_role(actor, "actor", [select_rows(batch, range(len(local)), trim=True)], temp)
    d = ((lp - generator_logprobs(local, T)).abs() * batch["action_mask"]).max()
    dist.all_reduce(d, op=dist.ReduceOp.MAX)
    return d.item()


sync.sync(engine)
result = {"synced": drift(1), "pixels_zeroed": drift(1, zero_pixels=True)}
# one update on an image batch: the loss on the prompts' own tokens moves the tower and the language model
from rlhf.algo.losses import sft_loss  # noqa: E402
from rlhf.data.collate import vision_entries  # noqa: E402

S = max(len(p) for p in prompts)
ids = torch.zeros(len(prompts), S, dtype=torch.long)
for b, p in enumerate(prompts):
    ids[b, :len(p)] = torch.tensor(list(p))
mb = {"input_ids": ids, "attention_mask": (ids != 0).long(), "loss_mask": (ids != 0).float(),
      **vision_entries([p.mm for p in prompts], ids)}
actor.train_step([mb], lambda b, logits: sft_loss(logits, b["input_ids"], b["loss_mask"], tp_group=mesh.tp_group,
                                                   vocab_size=actor.spec.vocab_size), ("loss",))
engine.load_weights(((n, t) for n, t in sync.iter_hf_tensors() if not n.startswith("visual.")), 2)
result["tower_not_synced"] = drift(2)
sync.sync(engine)
result["resynced"] = drift(3)
if mesh.is_rank0:
    with open(os.path.join(work, "vllm_result.json"), "w") as f:
        json.dump(result, f)
engine.close()
