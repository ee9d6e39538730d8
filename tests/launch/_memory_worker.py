"""Measured device memory of the PPO phases on CPU, for comparison with rlhf.planner (test_plan_memory.py):

    torchrun --nproc_per_node 2 tests/launch/_memory_worker.py ACTOR_HF RM_HF OUT.json CONFIG_JSON

The four real engines (actor and critic with megatron DDP + optimizer, ref and reward frozen) at TP2 (or a
config's ``tp`` and ``cp``: context parallelism), under the
trainer's MemoryScheduler with --colocate_all, run the trainer's own experience forwards (rlhf.ppo.experience.
forward_role) and PPO losses (rlhf.algo.ppo_losses.make_actor_loss / make_critic_loss) on full-length synthetic samples.

What is measured, per phase, on rank 0 (the CPU analogue of CUDA's peak allocated bytes):

* resident: ``OffloadManager.storages()`` per role and part (params, grads, optimizer) after the scheduler has
  entered the phase: the live storage bytes the phase keeps.
* activations: the peak, over the phase, of torch's live CPU allocations minus those at its start, from the
  profiler's allocation events (``profile_memory=True``; every allocation and free with its size). This is
  what a phase adds on top of its resident state: saved activations, working buffers, logits chunks.
  megatron's process-wide attention-score buffer is cleared before each phase, so each phase pays for it, as
  it would on a device that had freed it.

A warm-up step first creates Adam's lazily built state, so the measured step is a steady-state one.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from rlhf.distributed import initialize_mesh  # noqa: E402
from rlhf.distributed.mesh import destroy_mesh, set_single_thread  # noqa: E402
from rlhf.planner.measure import allocation_peak  # noqa: E402


def synthetic_experience(vocab: int, n: int, prompt_len: int, resp_len: int, seed: int):
    from rlhf.ppo.experience import Experience, collate_sequences
    from rlhf.rollout.types import Sample

    g = torch.Generator().manual_seed(seed)
    samples = [Sample(i, torch.randint(3, vocab, (prompt_len,), generator=g).tolist(),
                      torch.randint(3, vocab, (resp_len,), generator=g).tolist(), [-1.0] * resp_len, True)
               for i in range(n)]
    batch = collate_sequences(samples, pad_id=0, T=resp_len)
    shape = (n, resp_len)
    exp = Experience(samples=samples, batch=batch, old_logprobs=-torch.rand(shape, generator=g) - 1,
                     vllm_logprobs=-torch.rand(shape, generator=g) - 1, rewards=torch.randn(n, generator=g),
                     ref_logprobs=-torch.rand(shape, generator=g) - 1, values=torch.randn(shape, generator=g))
    exp.advantages, exp.returns = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    return exp


def measure(actor_dir: str, rm_dir: str, cfg: dict, mesh) -> dict:
    from megatron.core import parallel_state as ps

    from rlhf.runtime.role import ModelRole, OptimConfig
    from rlhf.algo.ppo_losses import ActorLossConfig, make_actor_loss, make_critic_loss
    from rlhf.models.context_parallel import reads_local_tokens
    from rlhf.models.outputs import response_logprobs, response_values
    from rlhf.runtime.offload import MemoryScheduler, OffloadManager
    from rlhf.ppo.experience import forward_role, select_rows

    optim = OptimConfig(lr=1e-4, warmup_ratio=0.0, total_steps=10, use_distributed_optimizer=cfg["zero_stage"] >= 1)
    common = dict(bf16=cfg["bf16"], recompute=cfg["gradient_checkpointing"])
    roles = {"actor": ModelRole(mesh, actor_dir, optim=optim, value_head=False, name="actor", **common),
             "critic": ModelRole(mesh, rm_dir, optim=optim, value_head=True, name="critic", **common),
             "ref": ModelRole(mesh, actor_dir, value_head=False, name="ref", bf16=cfg["bf16"]),
             "reward": ModelRole(mesh, rm_dir, value_head=True, name="reward", bf16=cfg["bf16"])}
    managers = {k: OffloadManager(v, name=k) for k, v in roles.items()}
    # The planner models the CUDA schedule, where every role's grads have their own size; on CPU the scheduler
    # would by default hand the critic the actor's parked (up to 9/8 larger) gradient memory.
    sched = MemoryScheduler(managers, colocate_all=True, keep_parked=False)
    P, T = cfg["prompt_max_len"], cfg["generate_max_len"]
    n = cfg["rollout_samples"]
    exp = synthetic_experience(roles["actor"].spec.vocab_size, n, P, T, seed=1)
    # marked as rlhf.ppo.stages marks them: under CP they read each rank's own tokens
    actor_loss = reads_local_tokens(make_actor_loss(
        lambda b, h: response_logprobs(roles["actor"], b, h, 1.0, entropy=True), ActorLossConfig(kl_estimator="k1")))
    critic_loss = reads_local_tokens(make_critic_loss(response_values, value_clip=0.2))
    mrb, mtb = cfg["micro_rollout_batch_size"], cfg["micro_train_batch_size"]
    fwd_mbs = [select_rows(exp.batch, range(i, i + mrb), True) for i in range(0, n, mrb)]
    per_step = cfg["train_batch_size"] // mesh.dp // mtb
    train_mbs = [exp.select(range(i, i + mtb), True) for i in range(0, per_step * mtb, mtb)]

    def actor_step():
        roles["actor"].train_step(train_mbs, actor_loss,
                                  ("policy_loss",), output="hidden")

    def critic_step():
        roles["critic"].train_step(train_mbs, critic_loss,
                                   ("value_loss",), output="head")

    def forward(role):
        return lambda: forward_role(roles[role], role, fwd_mbs, 1.0)

    skip = set(cfg.get("skip", ()))  # "phase/role" pairs not measured
    schedule = [(phase, {r: fn for r, fn in fns.items() if f"{phase}/{r}" not in skip})
                for phase, fns in (("make_experience", {r: forward(r) for r in roles}),
                                   ("critic_update", {"critic": critic_step}), ("actor_update", {"actor": actor_step}))]
    for phase, fns in schedule:  # warm-up: Adam state, lazy buffers, first-call caches
        sched.enter(phase)
        for fn in fns.values():
            fn()
    out: dict = {}
    for phase, fns in schedule:
        sched.enter(phase)
        resident = {r: {part: sum(s.nbytes() for s in group) for part, group in m.storages().items()}
                    for r, m in managers.items()}
        acts = {}
        for role, fn in fns.items():
            ps._GLOBAL_MEMORY_BUFFER.buffer.clear()
            dist.barrier()
            acts[role] = allocation_peak(fn)
        out[phase] = {"resident": resident, "activations": acts}
    return out


def main() -> None:
    actor_dir, rm_dir, out_path, cfg_json = sys.argv[1:5]
    set_single_thread()
    configs = json.loads(cfg_json)
    results = {}
    for name, cfg in configs.items():  # a config's layout: TP2 unless it says (CP configs: TP1 x CP)
        mesh = initialize_mesh(tp=cfg.get("tp", 2), pp=1, cp=cfg.get("cp", 1))
        results[name] = measure(actor_dir, rm_dir, cfg, mesh)
    if mesh.is_rank0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    destroy_mesh()


if __name__ == "__main__":
    main()
