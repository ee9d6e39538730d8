"""Worker for test_ppo_packing.py (2 ranks, megatron TP 2): PPO's experience forwards and one actor and one critic
update give the same numbers on packed (--packing_samples) and padded micro-batches. Prints RESULT json."""
import argparse
import json
import random

import torch

p = argparse.ArgumentParser()
p.add_argument("--actor", required=True)
p.add_argument("--rm", required=True)
p.add_argument("--tp", type=int, default=2)
p.add_argument("--pp", type=int, default=1)
a = p.parse_args()

from rlhf.algo.ppo_losses import policy_loss, value_loss  # noqa: E402
from rlhf.distributed import DistEnv, initialize_mesh  # noqa: E402
from rlhf.runtime.role import ModelRole, OptimConfig  # noqa: E402
from rlhf.models.outputs import response_logprobs, response_values  # noqa: E402
from rlhf.ppo.experience import collate_sequences, forward_role, prepare_microbatches, select_rows  # noqa: E402
from rlhf.rollout.types import Sample  # noqa: E402

mesh = initialize_mesh(a.tp, a.pp, DistEnv.from_environ(), seed=3)
rng = random.Random(0)
T = 7
samples = [Sample(i, [1] + [rng.randrange(3, 250) for _ in range(rng.randint(2, 9))],
                  [rng.randrange(3, 250) for _ in range(rng.randint(1, T))], [], False) for i in range(8)]
batch = collate_sequences(samples, 0, T, seq_len=None)
trim = mesh.pp == 1
padded = [select_rows(batch, range(i, i + 4), trim) for i in range(0, 8, 4)]
packed = prepare_microbatches(padded, packing=True, pp=mesh.pp, pad_id=0)
res = {}
roles = {}
opt = OptimConfig(lr=1e-2, warmup_ratio=0.0, scheduler="constant")
for name in ("actor", "critic", "reward"):
    path = a.actor if name == "actor" else a.rm
    eng_pair = [ModelRole(mesh, path, optim=opt if name != "reward" else None, value_head=name != "actor",
                            name=name) for _ in range(2)]
    roles[name] = eng_pair
    outs = [forward_role(e, name, mbs, 0.9) for e, mbs in zip(eng_pair, (padded, packed))]
    mask = batch["action_mask"] if name != "reward" else torch.ones(8, dtype=torch.bool)
    if name != "reward":
        outs = [o * mask for o in outs]
    res[f"{name}_fwd"] = (outs[0] - outs[1]).abs().max().item()
    res[f"{name}_fwd_scale"] = outs[0].abs().max().item()

adv = torch.randn(8, T, generator=torch.Generator().manual_seed(1))
old = forward_role(roles["actor"][0], "actor", padded, 0.9)
vals = forward_role(roles["critic"][0], "critic", padded, 1.0)
extra = {"old_logprobs": old, "advantages": adv, "values": vals, "returns": vals + adv}
padded_x = [select_rows(batch, range(i, i + 4), trim, {k: v for k, v in extra.items()}) for i in range(0, 8, 4)]
packed_x = prepare_microbatches(padded_x, packing=True, pp=mesh.pp, pad_id=0)


def actor_loss(engine):
    def fn(b, hidden):
        lp = response_logprobs(engine, b, hidden, 0.9)
        return policy_loss(lp, b["old_logprobs"] - 0.05, b["advantages"], b["action_mask"])
    return fn


def critic_loss(b, v):
    return value_loss(response_values(v, b), b["values"] + 0.1, b["returns"], b["action_mask"], value_clip=0.2)


for name, fn_of, output in (("actor", actor_loss, "hidden"), ("critic", lambda e: critic_loss, "head")):
    ms = [e.train_step(mbs, fn_of(e), ("policy_loss",) if name == "actor" else ("value_loss",), output=output)
          for e, mbs in zip(roles[name], (padded_x, packed_x))]
    key = "policy_loss" if name == "actor" else "value_loss"
    res[f"{name}_loss"] = abs(ms[0][key] - ms[1][key])
    res[f"{name}_gradnorm"] = abs(ms[0]["grad_norm"] - ms[1]["grad_norm"])
    # Gradients, not weights: Adam's first step is ~lr * sign(g), so weights would magnify rounding on tiny g.
    pairs = list(zip(roles[name][0].model.parameters(), roles[name][1].model.parameters()))
    res[f"{name}_grads_rel"] = max((p0.main_grad - p1.main_grad).abs().max().item() for p0, p1 in pairs) / max(
        p0.main_grad.abs().max().item() for p0, _ in pairs)
t = torch.tensor([max(v for k, v in res.items() if not k.endswith("scale"))])
if mesh.is_rank0:
    print("RESULT " + json.dumps(res), flush=True)
