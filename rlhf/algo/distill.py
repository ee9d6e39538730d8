"""On-policy distillation's per-token signal (pure: tensors in, tensors and metrics out).

The student samples a reply ``y`` from its rollout policy; the teacher scores the same tokens. Per response token:

    r_t = log pi_student(y_t | x, y_<t) - log pi_teacher(y_t | x, y_<t)

the sampled (one-token, k1) estimate of the reverse KL ``KL(pi_student || pi_teacher)`` at that prefix. It enters
the policy-gradient loss as a per-token advantage added to the task reward's (the estimator's, any of GRPO, RLOO,
REINFORCE++ or GAE):

    A_t = task_coef * A_task_t - distill_coef * r_t

and the PPO loss applies the usual importance ratio ``pi_theta(y_t) / pi_old(y_t)`` (clipped) to it, ``pi_old``
being the rollout policy. ``log pi_student`` is the rollout policy's log-prob, detached (no gradient flows through
the advantage): the actor's forward in make_experience, on the same kernels as the teacher's forward (so a
teacher equal to the student gives exactly zero), or the generator's with ``--use_rollout_logprobs``. Both are
taken at the sampling temperature, as the reference model's are.

Sources: Thinking Machines, "On-Policy Distillation" (Lu et al., 2025: ``reverse_kl = sampled_logprobs -
teacher_logprobs; advantages = -coef * reverse_kl``, trained with the importance-sampling policy-gradient loss);
slime's ``docs/en/advanced/on-policy-distillation.md`` (``--use-opd``, ``--opd-kl-coef``: the estimator's advantage
minus the coefficient times the token-level reverse KL, for any estimator); verl's and NeMo-RL's on-policy
distillation follow the same sampled-token reverse KL (verl: the teacher as the reference / a teacher worker with
zero task reward)."""
from __future__ import annotations

import torch


def reverse_kl_signal(logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                      action_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) ``log pi_student(y_t) - log pi_teacher(y_t)`` on response tokens, 0 elsewhere. ``logprobs``,
    ``teacher_logprobs``: (B, T) log-probs of the sampled tokens; ``action_mask``: (B, T) bool."""
    return (logprobs.float() - teacher_logprobs.float()) * action_mask


def discounted_future_sum(x: torch.Tensor, gamma: float, action_mask: torch.Tensor) -> torch.Tensor:
    """(B, T): at each response token, ``sum_k gamma^k x_{t+k}`` over it and the later tokens in the mask (tinker's
    ``discounted_future_sum_vectorized``, tinker_cookbook/rl/metrics.py at 9dfcc3a2, on response tokens)."""
    out = torch.zeros_like(x)
    running = torch.zeros(x.shape[0], dtype=x.dtype, device=x.device)
    mask = action_mask.bool()
    for t in range(x.shape[1] - 1, -1, -1):
        running = torch.where(mask[:, t], x[:, t] + gamma * running, running)
        out[:, t] = running
    return torch.where(mask, out, torch.zeros((), dtype=x.dtype, device=x.device))


def distill_advantages(task_advantages: torch.Tensor, logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                       action_mask: torch.Tensor, distill_coef: float, task_coef: float = 1.0,
                       kl_discount: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, signal), both (B, T): ``task_coef * task_advantages - distill_coef * signal`` on response
    tokens (0 elsewhere), and the signal ``reverse_kl_signal``. ``kl_discount`` > 0 (tinker's ``kl_discount_factor``,
    tinker_cookbook/distillation/train_on_policy.py ``incorporate_kl_penalty`` at 9dfcc3a2): the term at a token is
    the discounted sum of the signal there and after, ``-distill_coef * sum_k kl_discount^k signal_{t+k}``."""
    signal = reverse_kl_signal(logprobs, teacher_logprobs, action_mask)
    term = distill_coef * signal
    if kl_discount > 0:
        term = discounted_future_sum(term, kl_discount, action_mask)
    adv = (task_coef * task_advantages - term) * action_mask
    return adv, signal
