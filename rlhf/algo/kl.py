"""KL-coefficient controllers for the reward KL penalty (Ziegler et al. 2019, as in OpenRLHF / TRL), and where the KL
penalty goes (``kl_in_loss``)."""
from __future__ import annotations

import torch


def _as_float(x: float | torch.Tensor) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


class FixedKLController:
    """A constant coefficient; ``update`` is a no-op."""

    def __init__(self, init_kl_coef: float):
        if init_kl_coef < 0:
            raise ValueError(f"--init_kl_coef {init_kl_coef}: must be >= 0")
        self.value = float(init_kl_coef)

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    """Moves the coefficient so the measured KL tracks ``target``.

    ``e = clip(current / target - 1, -0.2, 0.2)``; ``value *= 1 + e * n_steps / horizon``.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        super().__init__(init_kl_coef)
        if not target > 0:
            raise ValueError(f"--kl_target {target}: must be > 0")
        if not horizon > 0:
            raise ValueError(f"--kl_horizon {horizon}: must be > 0")
        self.target, self.horizon = float(target), float(horizon)

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        current = _as_float(current_kl)
        error = min(max(current / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def make_kl_controller(init_kl_coef: float, kl_target: float | None = None,
                       kl_horizon: float = 10000) -> FixedKLController:
    """Adaptive when ``kl_target`` is set, else fixed."""
    if kl_target is None:
        return FixedKLController(init_kl_coef)
    return AdaptiveKLController(init_kl_coef, kl_target, kl_horizon)


def kl_in_loss(estimator, use_kl_loss: bool | None) -> bool:
    """Whether ``kl_coef * KL`` joins the actor's loss (True) or the token rewards (False).

    ``use_kl_loss`` is ``--use_kl_loss`` / ``--no-use_kl_loss`` (OpenRLHF's ``--algo.kl.use_loss``): True puts the
    KL in the loss for any estimator, False in the reward for any estimator (OpenRLHF without the flag, the group
    estimators included); None (the flag not given) keeps the estimator's own place, ``estimator.kl_in_loss``
    (in the loss for grpo, dr_grpo and group_norm, in the reward otherwise)."""
    return bool(estimator.kl_in_loss) if use_kl_loss is None else bool(use_kl_loss)
