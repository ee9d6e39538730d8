"""Advantage estimators (GAE, REINFORCE++, GRPO) as small pure functions behind one registry.

All tensors are right-padded response-token tensors (B, T) with ``action_mask`` 1 on real response tokens;
``rewards`` is the scalar reward per sequence (B,). Outputs are at least fp32 (fp64 inputs stay fp64) and zero
on padding.

The PPO loop calls any estimator the same way::

    est = get_estimator(args.advantage_estimator)
    out = est(rewards=r, kl=kl, values=v if est.needs_critic else None, action_mask=m, kl_coef=kl_ctl.value,
              gamma=args.gamma, lambd=args.lambd, n_samples_per_prompt=args.n_samples_per_prompt)
    out["advantages"], out["returns"], out["token_rewards"]  # each (B, T)

GAE and REINFORCE++ put the KL penalty into the per-token reward (OpenRLHF). GRPO leaves it out: the usual
recipe adds ``kl_coef * kl`` to the loss instead (``rlhf.algo.ppo_losses.kl_loss``). Where the KL goes is the
caller's choice (``rlhf.algo.kl.kl_in_loss``, ``--use_kl_loss``): the KL-in-reward estimators get ``kl_coef = 0`` to
leave it out, and the group estimators' outputs go through ``add_reward_kl`` to take it in (OpenRLHF without
``--algo.kl.use_loss``).

``reward_clip=(lo, hi)`` (``--reward_clip_range``, OpenRLHF's ``--reward.clip_range``) clamps each sequence's reward
after its group baseline and before the KL term, where OpenRLHF's ``compute_reward`` clamps it.

Batch-level statistics (REINFORCE++ whitening, ``whiten_advantages``) are over the tensors passed in; pass the
whole rollout batch to get global statistics. GRPO groups must not be split across calls.

``reward_mask`` (every estimator): where ``compute_token_rewards`` places the rewards and the KL penalty when it is
not ``action_mask`` (verl's rollout rejection removes tokens from ``action_mask`` after both are placed); the
recursions, the whitening statistics and the group advantages' broadcast use ``action_mask``.
"""
from __future__ import annotations

from typing import Callable

import torch

from rlhf.algo.ppo_losses import upcast, masked_whiten

ADVANTAGE_ESTIMATORS: dict[str, Callable[..., dict[str, torch.Tensor]]] = {}


def _register(name: str, *, needs_critic: bool, kl_in_loss: bool, whiten: bool, needs_groups: bool):
    """Registers an estimator with what the trainer must know of it:

    * ``needs_critic``: it reads ``values`` (a critic is trained);
    * ``kl_in_loss``: the KL penalty goes into the actor's loss (``kl_coef * kl``), not into the token rewards;
    * ``whiten``: the trainer whitens its advantages over the global batch afterwards;
    * ``needs_groups``: it compares the ``n_samples_per_prompt`` samples of each prompt (needs >= 2)."""
    def wrap(fn):
        fn.needs_critic, fn.kl_in_loss, fn.whiten, fn.needs_groups = needs_critic, kl_in_loss, whiten, needs_groups
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn
    return wrap


def get_estimator(name: str) -> Callable[..., dict[str, torch.Tensor]]:
    """The registered estimator ``name`` with its properties (``_register``)."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"--advantage_estimator {name!r}: expected one of {', '.join(sorted(ADVANTAGE_ESTIMATORS))}")
    return ADVANTAGE_ESTIMATORS[name]


def last_action_index(action_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last response token of each right-padded row. (B, T) -> (B,) long (T - 1 for an empty row;
    ``rlhf.algo.losses.last_token_index`` is the attention-mask twin, 0 for an empty row)."""
    t = action_mask.shape[1]
    return t - 1 - (action_mask != 0).long().fliplr().argmax(dim=1)


@torch.no_grad()
def compute_token_rewards(rewards: torch.Tensor, kl: torch.Tensor | None, action_mask: torch.Tensor,
                          kl_coef: float | torch.Tensor) -> torch.Tensor:
    """``-kl_coef * kl`` per token plus the sequence reward on the last real token (OpenRLHF ``compute_reward``).

    rewards (B,); kl (B, T) or None (no penalty); action_mask (B, T) -> (B, T), zero on padding.
    """
    mask = action_mask != 0
    b, t = mask.shape
    token_rewards = torch.zeros(b, t, dtype=upcast(rewards).dtype, device=mask.device)
    if kl is not None:
        token_rewards = token_rewards - kl_coef * upcast(kl)
    token_rewards.scatter_add_(1, last_action_index(mask).unsqueeze(1), upcast(rewards).view(b, 1))
    return torch.where(mask, token_rewards, torch.zeros_like(token_rewards))


def clip_rewards(rewards: torch.Tensor, reward_clip: tuple[float, float] | None) -> torch.Tensor:
    """(B,) sequence rewards clamped to ``reward_clip = (lo, hi)`` (None: unchanged); OpenRLHF's
    ``compute_reward(reward_clip_range=...)``."""
    return rewards if reward_clip is None else rewards.clamp(min=reward_clip[0], max=reward_clip[1])


def whiten_advantages(advantages: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """Masked whitening over the whole batch (the caller's ``whiten_advantages`` flag). (B, T) -> (B, T)."""
    return masked_whiten(advantages, action_mask, shift_mean=True)


@torch.no_grad()
def gae(token_rewards: torch.Tensor, values: torch.Tensor, action_mask: torch.Tensor, gamma: float,
        lambd: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation, backward over T and vectorized over B. Not whitened.

    token_rewards, values, action_mask (B, T) -> (advantages, returns), each (B, T), zero outside the mask.
    ``delta_t = r_t + gamma * V_{t+1} - V_t``, ``A_t = delta_t + gamma * lambd * A_{t+1}``, ``returns = A + V``,
    where t + 1 is the next token *in the mask*: a token outside it (padding after EOS; an environment's tokens
    between an agent's turns; a token verl's rollout rejection dropped) is skipped, its reward and value unused, as
    verl's ``compute_gae_advantage_return`` (verl/trainer/ppo/core_algos.py at 1dda039b) carries ``nextvalues`` and
    ``lastgaelam`` through ``response_mask == 0``. On right-padded rows this is plain GAE with V = 0 after the last
    token.
    """
    r = upcast(token_rewards)
    mask = (action_mask != 0).to(r.dtype)
    v = upcast(values).to(r.dtype)
    b, t = r.shape
    advantages = torch.zeros_like(r)
    last = torch.zeros(b, dtype=r.dtype, device=r.device)
    next_v = torch.zeros(b, dtype=r.dtype, device=r.device)
    zero = torch.zeros((), dtype=r.dtype, device=r.device)
    for i in reversed(range(t)):
        m = mask[:, i]
        delta = torch.where(m.bool(), r[:, i], zero) + gamma * next_v - torch.where(m.bool(), v[:, i], zero)
        last = torch.where(m.bool(), delta + gamma * lambd * last, last)  # carried through tokens outside the mask
        next_v = torch.where(m.bool(), v[:, i], next_v)
        advantages[:, i] = last
    returns = torch.where(mask.bool(), advantages + torch.where(mask.bool(), v, zero), zero)
    return torch.where(mask.bool(), advantages, zero), returns


def _discounted_return_to_go(token_rewards: torch.Tensor, action_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """The discounted sum of the rewards of this token and the later ones in the mask (tokens outside it skipped,
    the running return carried through them, as verl's ``compute_reinforce_plus_plus_outcome_advantage``). (B, T)."""
    r = upcast(token_rewards)
    mask = (action_mask != 0)
    zero = torch.zeros((), dtype=r.dtype, device=r.device)
    returns = torch.zeros_like(r)
    running = torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)
    for i in reversed(range(r.shape[1])):
        running = torch.where(mask[:, i], r[:, i] + gamma * running, running)
        returns[:, i] = running
    return torch.where(mask, returns, zero)


@torch.no_grad()
def reinforce_plus_plus(token_rewards: torch.Tensor, action_mask: torch.Tensor,
                        gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted return-to-go, whitened over all masked tokens of the batch.

    token_rewards, action_mask (B, T) -> (advantages, returns), each (B, T), zero on padding.
    """
    returns = _discounted_return_to_go(token_rewards, action_mask, gamma)
    return masked_whiten(returns, action_mask), returns


def _groups(rewards: torch.Tensor, n: int) -> torch.Tensor:
    """(B,) prompt-major rewards as (G, n) groups; ValueError naming the flag when they do not form groups."""
    b = rewards.shape[0]
    if n < 2:
        raise ValueError(f"--n_samples_per_prompt {n}: a group estimator needs at least 2 samples per prompt")
    if b % n:
        raise ValueError(f"--n_samples_per_prompt {n}: the batch of {b} rows is not a whole number of groups")
    return upcast(rewards).view(b // n, n)


@torch.no_grad()
def group_baseline(rewards: torch.Tensor, n_samples_per_prompt: int, kind: str) -> torch.Tensor:
    """Each reward against its group (OpenRLHF's reward shaping before the return-to-go): ``rloo`` subtracts the
    mean of the other n - 1 samples, ``mean`` (REINFORCE++-baseline, Dr. GRPO) the group mean. (B,) -> (B,)."""
    g = _groups(rewards, n_samples_per_prompt)  # (G, n)
    n = g.shape[1]
    base = (g.sum(dim=1, keepdim=True) - g) / (n - 1) if kind == "rloo" else g.mean(dim=1, keepdim=True)
    return (g - base).reshape(-1)


def whiten_openrlhf(x: torch.Tensor, action_mask: torch.Tensor, std_norm: bool = True) -> torch.Tensor:
    """OpenRLHF's batch normalisation of advantages: minus the masked mean, times ``rsqrt(max(var, 1e-8))`` with
    the biased variance (only the mean with ``std_norm=False``, ``--no_std_norm``); zero on padding."""
    mask = action_mask != 0
    m = mask.to(x.dtype)
    n = m.sum()
    mean = (x * m).sum() / n
    out = x - mean
    if std_norm:
        out = out * (((x - mean) ** 2 * m).sum() / n).clamp(min=1e-8).rsqrt()
    return torch.where(mask, out, torch.zeros((), dtype=x.dtype, device=x.device))


@torch.no_grad()
def grpo(rewards: torch.Tensor, action_mask: torch.Tensor, n_samples_per_prompt: int, eps: float = 1e-6,
         std_normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO group-relative advantage ``(r - mean_g) / (std_g + eps)`` broadcast over each row's response tokens.

    rewards (B,), rows prompt-major: rows [k*n, (k+1)*n) are the n samples of prompt k. action_mask (B, T).
    std is the unbiased group std; ``std_normalize=False`` subtracts the mean only (Dr. GRPO).
    Returns (advantages, returns), each (B, T) and zero on padding; returns == advantages (no critic).
    No KL here: GRPO adds it to the loss.
    """
    b = rewards.shape[0]
    grouped = _groups(rewards, n_samples_per_prompt)  # (G, n)
    scores = grouped - grouped.mean(dim=1, keepdim=True)
    if std_normalize:
        scores = scores / (grouped.std(dim=1, keepdim=True) + eps)
    advantages = scores.view(b, 1) * (action_mask != 0).to(scores.dtype)  # (B, T)
    return advantages, advantages.clone()


# ---- uniform entry points (registry) ----

def _rm(reward_mask: torch.Tensor | None, action_mask: torch.Tensor) -> torch.Tensor:
    """The tokens the rewards and the KL penalty are placed on (``reward_mask``): the response as generated, where a
    rollout rejection has since taken tokens out of ``action_mask`` (verl applies its KL penalty and places the
    outcome reward before ``rollout_rs`` edits the mask; the recursions then skip the rejected tokens)."""
    return action_mask if reward_mask is None else reward_mask


@torch.no_grad()
def _group_outputs(advantages: torch.Tensor, rewards: torch.Tensor, action_mask: torch.Tensor,
                   reward_clip: tuple[float, float] | None) -> dict[str, torch.Tensor]:
    """The group estimators' outputs from :func:`grpo`'s (B, T) advantages (each row's score on its tokens), the
    score clamped to ``reward_clip``. They take no KL: ``kl``/``kl_coef`` are ignored (``add_reward_kl`` moves it
    into their rewards)."""
    if reward_clip is not None:
        mask = (action_mask != 0).to(advantages.dtype)
        advantages = advantages.clamp(min=reward_clip[0], max=reward_clip[1]) * mask
    return {"advantages": advantages, "returns": advantages.clone(),
            "token_rewards": compute_token_rewards(rewards, None, action_mask, 0.0)}


@torch.no_grad()
def add_reward_kl(out: dict[str, torch.Tensor], kl: torch.Tensor, action_mask: torch.Tensor,
                  kl_coef: float) -> dict[str, torch.Tensor]:
    """A group estimator's outputs with ``-kl_coef * kl`` in its token rewards (``--no-use_kl_loss``; OpenRLHF
    without ``--algo.kl.use_loss``): OpenRLHF's ``compute_reward`` then ``get_cumulative_returns`` (gamma 1), written
    as the sum of the score's return and the KL's undiscounted return-to-go. (B, T) each."""
    kl_return = _discounted_return_to_go(-kl_coef * upcast(kl), action_mask, 1.0)
    advantages = out["advantages"] + kl_return.to(out["advantages"].dtype)
    mask = action_mask != 0
    token_rewards = out["token_rewards"] + torch.where(mask, -kl_coef * upcast(kl), torch.zeros_like(kl_return))
    return {"advantages": advantages, "returns": advantages.clone(), "token_rewards": token_rewards}


@_register("gae", needs_critic=True, kl_in_loss=False, whiten=True, needs_groups=False)
def gae_estimator(*, rewards: torch.Tensor, kl: torch.Tensor | None = None, values: torch.Tensor | None = None,
                  action_mask: torch.Tensor, kl_coef: float = 0.0, gamma: float = 1.0, lambd: float = 1.0,
                  n_samples_per_prompt: int = 1, std_norm: bool = True,
                  reward_clip: tuple[float, float] | None = None,
                  reward_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """PPO with a critic: KL-penalised token rewards, then :func:`gae`."""
    if values is None:
        raise ValueError("--advantage_estimator 'gae' needs critic values (a critic model)")
    token_rewards = compute_token_rewards(clip_rewards(rewards, reward_clip), kl, _rm(reward_mask, action_mask),
                                          kl_coef)
    advantages, returns = gae(token_rewards, values, action_mask, gamma, lambd)
    return {"advantages": advantages, "returns": returns, "token_rewards": token_rewards}


@_register("reinforce_plus_plus", needs_critic=False, kl_in_loss=False, whiten=False, needs_groups=False)
def reinforce_plus_plus_estimator(*, rewards: torch.Tensor, kl: torch.Tensor | None = None,
                                  values: torch.Tensor | None = None, action_mask: torch.Tensor,
                                  kl_coef: float = 0.0, gamma: float = 1.0, lambd: float = 1.0,
                                  n_samples_per_prompt: int = 1, std_norm: bool = True,
                                  reward_clip: tuple[float, float] | None = None,
                                  reward_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """KL-penalised token rewards, then :func:`reinforce_plus_plus` (``std_norm=False``: the return-to-go minus
    its batch mean, not divided by the std)."""
    token_rewards = compute_token_rewards(clip_rewards(rewards, reward_clip), kl, _rm(reward_mask, action_mask),
                                          kl_coef)
    advantages, returns = reinforce_plus_plus(token_rewards, action_mask, gamma)
    if not std_norm:
        advantages = whiten_openrlhf(returns, action_mask, std_norm=False)
    return {"advantages": advantages, "returns": returns, "token_rewards": token_rewards}


@_register("grpo", needs_critic=False, kl_in_loss=True, whiten=False, needs_groups=True)
def grpo_estimator(*, rewards: torch.Tensor, kl: torch.Tensor | None = None, values: torch.Tensor | None = None,
                   action_mask: torch.Tensor, kl_coef: float = 0.0, gamma: float = 1.0, lambd: float = 1.0,
                   n_samples_per_prompt: int = 1, std_norm: bool = True,
                   reward_clip: tuple[float, float] | None = None,
                   reward_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """:func:`grpo`; ``kl``/``kl_coef`` are ignored (KL goes in the loss, or ``add_reward_kl`` adds it).
    token_rewards has no KL term."""
    advantages, _ = grpo(rewards, action_mask, n_samples_per_prompt)
    return _group_outputs(advantages, rewards, action_mask, reward_clip)


@_register("dr_grpo", needs_critic=False, kl_in_loss=True, whiten=False, needs_groups=True)
def dr_grpo_estimator(*, rewards: torch.Tensor, kl: torch.Tensor | None = None, values: torch.Tensor | None = None,
                      action_mask: torch.Tensor, kl_coef: float = 0.0, gamma: float = 1.0, lambd: float = 1.0,
                      n_samples_per_prompt: int = 1, std_norm: bool = True,
                      reward_clip: tuple[float, float] | None = None,
                      reward_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """:func:`grpo` without the std division (Dr. GRPO); KL handled as for ``grpo``."""
    advantages, _ = grpo(rewards, action_mask, n_samples_per_prompt, std_normalize=False)
    return _group_outputs(advantages, rewards, action_mask, reward_clip)


@_register("group_norm", needs_critic=False, kl_in_loss=True, whiten=False, needs_groups=True)
def group_norm_estimator(*, rewards: torch.Tensor, kl: torch.Tensor | None = None,
                         values: torch.Tensor | None = None, action_mask: torch.Tensor, kl_coef: float = 0.0,
                         gamma: float = 1.0, lambd: float = 1.0, n_samples_per_prompt: int = 1,
                         std_norm: bool = True,
                         reward_clip: tuple[float, float] | None = None,
                         reward_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """OpenRLHF's name for GRPO: :func:`grpo` with its std epsilon, 1e-9 (``grpo`` keeps 1e-6); KL handled as for
    ``grpo``."""
    advantages, _ = grpo(rewards, action_mask, n_samples_per_prompt, eps=1e-9)
    return _group_outputs(advantages, rewards, action_mask, reward_clip)


def _baseline_estimator(kind: str, whiten: bool):
    def est(*, rewards: torch.Tensor, kl: torch.Tensor | None = None, values: torch.Tensor | None = None,
            action_mask: torch.Tensor, kl_coef: float = 0.0, gamma: float = 1.0, lambd: float = 1.0,
            n_samples_per_prompt: int = 1, std_norm: bool = True,
            reward_clip: tuple[float, float] | None = None,
            reward_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        shaped = clip_rewards(group_baseline(rewards, n_samples_per_prompt, kind), reward_clip)  # (B,)
        token_rewards = compute_token_rewards(shaped, kl, _rm(reward_mask, action_mask), kl_coef)
        returns = _discounted_return_to_go(token_rewards, action_mask, 1.0)  # OpenRLHF: gamma 1 for these
        advantages = whiten_openrlhf(returns, action_mask, std_norm) if whiten else returns.clone()
        return {"advantages": advantages, "returns": returns, "token_rewards": token_rewards}
    return est


rloo_estimator = _register("rloo", needs_critic=False, kl_in_loss=False, whiten=False, needs_groups=True)(
    _baseline_estimator("rloo", whiten=False))
rloo_estimator.__doc__ = """RLOO (OpenRLHF ``rloo``): each reward minus the mean of the other n - 1 samples of its
prompt, the per-token KL penalty added (``compute_token_rewards``), then the undiscounted return-to-go."""
reinforce_baseline_estimator = _register("reinforce_baseline", needs_critic=False, kl_in_loss=False, whiten=False,
                                         needs_groups=True)(_baseline_estimator("mean", whiten=True))
reinforce_baseline_estimator.__doc__ = """REINFORCE++-baseline (OpenRLHF ``reinforce_baseline``): each reward minus its
group mean, the per-token KL penalty, the undiscounted return-to-go, then OpenRLHF's batch normalisation
(``whiten_openrlhf``: mean, and std unless --no_std_norm)."""

