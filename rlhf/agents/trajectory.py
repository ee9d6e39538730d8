"""The trajectory an executor runs (a context variable per asyncio task): its number, its seed and the timeout
around each environment call (``Trajectory``, ``CURRENT``, ``seed_environment``, ``env_call``)."""
from __future__ import annotations

import asyncio
import contextvars
import random
import time
from dataclasses import dataclass


@dataclass
class Trajectory:
    """What the rollout tells an executor about the trajectory it runs (a context variable per asyncio task):
    its seed (the global ``random`` and torch generators are seeded from it before each environment call, so
    environments that draw from them repeat on a resumed run), the per-call timeout, and the environment
    seconds spent."""

    seed: int
    timeout_s: float | None = None
    index: int = 0
    """the trajectory's number in the step (prompt-major)"""
    env_seconds: float = 0.0
    calls: int = 0


CURRENT: contextvars.ContextVar[Trajectory | None] = contextvars.ContextVar("rlhf_agent_trajectory", default=None)


def seed_environment() -> None:
    """Seed ``random`` and torch's global generator from the trajectory and its environment calls so far (before
    an environment is made and before each of its calls)."""
    traj = CURRENT.get()
    if traj is not None:
        import torch

        random.seed(traj.seed * 1_000 + traj.calls)
        torch.manual_seed((traj.seed * 1_000 + traj.calls) % (1 << 63))


async def env_call(fn, states: dict):
    """``await fn(states)`` (an environment's ``reset`` or ``step``) under the trajectory's seed and timeout."""
    traj = CURRENT.get()
    if traj is None:
        return await fn(states)
    traj.calls += 1
    seed_environment()
    t0 = time.perf_counter()
    try:
        return await asyncio.wait_for(fn(states), traj.timeout_s)
    except asyncio.TimeoutError:
        raise TimeoutError(f"no answer within --agent_timeout_s {traj.timeout_s:g}") from None
    finally:
        traj.env_seconds += time.perf_counter() - t0
