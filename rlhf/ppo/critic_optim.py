"""The critic's own optimizer flags (OpenRLHF's ``--critic.adam.*``, ``--critic.lr_scheduler``, ...): each replaces,
for the critic alone, the shared flag it names (``rlhf.ppo.parts.PPOOptim.critic_config`` applies them); the flags'
check."""
from __future__ import annotations

import argparse


CRITIC_OPTIM_FLAGS = {"critic_adam_betas": "adam_betas", "critic_l2": "l2", "critic_lr_scheduler": "lr_scheduler",
                      "critic_lr_warmup_ratio": "lr_warmup_ratio", "critic_max_norm": "max_norm"}
"""The critic's own optimizer flag -> the shared flag it replaces for the critic (OpenRLHF's ``--critic.*``)."""


def check_critic_optim(args: argparse.Namespace) -> None:
    """The critic's own optimizer flags, checked as the shared ones are (``OptimConfig``), naming the flag."""
    from rlhf.runtime.role import OptimConfig

    if args.critic_max_norm is not None and args.critic_max_norm < 0:
        raise ValueError(f"--critic_max_norm must be >= 0, got {args.critic_max_norm}")
    if args.critic_l2 is not None and args.critic_l2 < 0:
        raise ValueError(f"--critic_l2 must be >= 0, got {args.critic_l2}")
    if args.critic_adam_betas is not None and not all(0 <= b < 1 for b in args.critic_adam_betas):
        raise ValueError(f"--critic_adam_betas {' '.join(f'{b:g}' for b in args.critic_adam_betas)}: each must be in "
                         "[0, 1)")
    for flag, kw in (("lr_scheduler", "scheduler"), ("lr_warmup_ratio", "warmup_ratio")):
        value = getattr(args, f"critic_{flag}")
        if value is not None:
            try:
                OptimConfig(**{kw: value})
            except ValueError as e:
                raise ValueError(str(e).replace(f"--{flag}", f"--critic_{flag}")) from None
