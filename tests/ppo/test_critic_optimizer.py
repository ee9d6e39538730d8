"""OpenRLHF's --critic.adam.betas, --critic.adam.weight_decay, --critic.lr_scheduler, --critic.lr_warmup_ratio and
--critic.max_norm set the critic's own optimizer, as in OpenRLHF at 3c3be6234e0c (openrlhf/trainer/ray/ppo_critic.py
builds the critic's optimizer, schedule and clipping from ``args.critic.*``; openrlhf/cli/train_ppo_ray.py declares
them per role, defaults 0.9 0.95, 0, cosine_with_min_lr, 0.03, 1.0; openrlhf/utils/deepspeed: the schedule's warmup is
``ceil(max_steps * lr_warmup_ratio)`` steps from 0). Checked on real engines (one in-process rank) built from the
configs the trainer builds them from (``PPOJobConfig.optim``: ``PPOOptim.actor_config`` / ``critic_config``, as
``rlhf.ppo.roles`` calls them): megatron's optimizer and schedule of the critic carry the critic's values, the actor's
keep the actor's, and an actor-only flag leaves the critic at OpenRLHF's default. Negative control: our shared flags alone (where OpenRLHF's --critic.* went
before: accepted and dropped) give the critic the actor's betas, and the comparison sees it."""
from __future__ import annotations

import argparse
import math

import pytest

OPENRLHF = ["--critic.adam.betas", "0.8", "0.9", "--critic.adam.weight_decay", "0.05", "--critic.lr_scheduler",
            "constant_with_warmup", "--critic.lr_warmup_ratio", "0.5", "--critic.max_norm", "0.25",
            "--actor.adam.betas", "0.9", "0.99", "--actor.max_norm", "2.0", "--actor.lr_scheduler", "cosine",
            "--actor.lr_warmup_ratio", "0", "--critic.adam.lr", "3e-3"]
STEPS = 10


def parse(extra: list[str]) -> argparse.Namespace:
    from rlhf.config.migration import add_launcher_args
    from rlhf.config.openrlhf import translate
    from rlhf.ppo.args import add_args

    p = argparse.ArgumentParser()
    add_args(p)
    add_launcher_args(p)
    args = p.parse_args(translate(["--pretrain", "m", "--prompt_data", "p", "--save_path", "o", "--reward_fn", "x:y", *extra], "ppo",
                                  set(p._option_string_actions)))
    args.zero_stage = 0  # resolve_zero_stage's choice for one CPU rank
    return args


def optim_part(args: argparse.Namespace, tmp) -> object:
    """The job's optimizer part, as the trainer builds it (``PPOJobConfig.from_args``, which wants the prompts)."""
    from rlhf.ppo.args import PPOJobConfig

    (tmp / "p.jsonl").write_text('{"prompt": "1 + 1 ="}\n')
    args.prompt_data = str(tmp / "p.jsonl")
    return PPOJobConfig.from_args(args).optim


def described(engine) -> dict:
    """What megatron's optimizer and schedule of an engine hold."""
    opt, sched = engine.optimizer, engine.scheduler
    group = opt.param_groups[0]
    return {"betas": tuple(group["betas"]), "weight_decay": opt.config.weight_decay, "clip_grad": opt.config.clip_grad,
            "warmup": sched.lr_warmup_steps, "style": sched.lr_decay_style, "max_lr": sched.max_lr}


@pytest.fixture(scope="module")
def engines(ppo_setup, tmp_path_factory):
    from helpers import free_port
    from rlhf.distributed import DistEnv, initialize_mesh
    from rlhf.distributed.mesh import destroy_mesh
    from rlhf.runtime.role import ModelRole

    mesh = initialize_mesh(1, 1, DistEnv(0, 1, 0, "127.0.0.1", free_port(), "single"))
    args = parse(OPENRLHF)
    optim = optim_part(args, tmp_path_factory.mktemp("prompts"))
    out = {"critic": ModelRole(mesh, ppo_setup["rm"], value_head=True, name="critic",
                                 optim=optim.critic_config(STEPS, False)),
           "actor": ModelRole(mesh, ppo_setup["actor"], value_head=False, name="actor",
                                optim=optim.actor_config(STEPS, False)),
           "optim": optim}
    yield out
    destroy_mesh()


def test_the_critic_has_its_own_optimizer(engines):
    critic, actor = described(engines["critic"]), described(engines["actor"])
    assert critic == {"betas": (0.8, 0.9), "weight_decay": 0.05, "clip_grad": 0.25,
                      "warmup": math.ceil(STEPS * 0.5), "style": "constant", "max_lr": 3e-3}
    assert actor == {"betas": (0.9, 0.99), "weight_decay": 0.0, "clip_grad": 2.0, "warmup": 0, "style": "cosine",
                     "max_lr": 1e-6}
    # OpenRLHF's constant_with_warmup: lr * step / warmup during the warmup, from 0
    sched = engines["critic"].scheduler
    sched.step(increment=2)
    assert engines["critic"].optimizer.param_groups[0]["lr"] == pytest.approx(3e-3 * 2 / 5, rel=1e-12)
    # negative control: the shared flags alone give the critic the actor's betas, clipping and schedule
    shared = engines["optim"].config(3e-3, STEPS, False)
    assert (shared.adam_betas, shared.clip_grad, shared.scheduler) == ((0.9, 0.99), 2.0, "cosine")
    assert (tuple(shared.adam_betas), shared.clip_grad) != (critic["betas"], critic["clip_grad"])


def test_an_actor_only_flag_leaves_the_critic_at_openrlhfs_default(tmp_path):
    """OpenRLHF's --actor.adam.betas sets the actor's only; ours (--adam_betas) still sets both."""
    optim = optim_part(parse(["--actor.adam.betas", "0.5", "0.6", "--actor.adam.weight_decay", "0.1",
                              "--actor.max_norm", "3", "--actor.lr_scheduler", "constant",
                              "--actor.lr_warmup_ratio", "0.2"]), tmp_path)
    c, a = optim.critic_config(STEPS, False), optim.actor_config(STEPS, False)
    assert (a.adam_betas, a.weight_decay, a.clip_grad, a.scheduler, a.warmup_ratio) == ((0.5, 0.6), 0.1, 3.0,
                                                                                         "constant", 0.2)
    assert (c.adam_betas, c.weight_decay, c.clip_grad, c.scheduler, c.warmup_ratio) == ((0.9, 0.95), 0.0, 1.0,
                                                                                         "cosine", 0.03)
    ours = optim_part(parse(["--adam_betas", "0.5", "0.6", "--max_norm", "3"]), tmp_path).critic_config(STEPS, False)
    assert (ours.adam_betas, ours.clip_grad) == ((0.5, 0.6), 3.0)


@pytest.mark.parametrize("flags,needle", [
    (["--critic.lr_scheduler", "step"], "--critic_lr_scheduler must be one of"),
    (["--critic.lr_warmup_ratio", "1.5"], "--critic_lr_warmup_ratio must be in [0, 1), got 1.5"),
    (["--critic.max_norm", "-1"], "--critic_max_norm must be >= 0, got -1.0"),
    (["--critic.adam.betas", "0.9", "1.5"], "--critic_adam_betas 0.9 1.5: each must be in [0, 1)"),
])
def test_bad_critic_values_name_the_flag(flags, needle, tmp_path):
    from rlhf.ppo.algo_args import check_algo
    from rlhf.ppo.args import PPOJobConfig

    (tmp_path / "p.jsonl").write_text('{"prompt": "1 + 1 ="}\n')
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        # the critic's optimizer part checks its own values as the job is built (PPOOptim), then the job's checks
        check_algo(PPOJobConfig.from_args(parse(flags + ["--prompt_data", str(tmp_path / "p.jsonl")])))
