"""OpenRLHF's remote rewards (``--remote_rm_url``): a Python file's ``reward_func`` or an HTTP reward server, and
the answer forms they give (``rlhf.rewards.sources`` combines them with the other sources)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch


@dataclass
class RemoteRewards:
    """What OpenRLHF's reward functions and servers answer (``{"rewards", "scores", "extra_logs"}``)."""

    rewards: torch.Tensor
    """(N,) fp32: what the advantages are computed from"""
    scores: torch.Tensor | None = None
    """(N,) fp32 or None: what dynamic filtering looks at (OpenRLHF: "0-1 reward"); None: the rewards"""
    extra_logs: dict = field(default_factory=dict)
    """name -> a number or one number per query, logged as ``reward_extra/<name>`` (their mean)"""


def is_reward_file(url: str | None) -> bool:
    """``--remote_rm_url`` names a Python file with OpenRLHF's ``reward_func`` rather than an HTTP server."""
    return bool(url) and url.endswith(".py") and "://" not in url


def load_reward_file(path: str, flag: str = "--remote_rm_url"):
    """``reward_func`` of an OpenRLHF reward file, loaded as OpenRLHF loads it (a module from the file's path).
    ValueError naming ``flag`` when the file is missing, does not import, or has no callable ``reward_func``."""
    import importlib.util

    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path}: no such file")
    spec = importlib.util.spec_from_file_location("reward_func", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise ValueError(f"{flag} {path}: importing it failed: {type(e).__name__}: {e}") from None
    fn = getattr(module, "reward_func", None)
    if not callable(fn):
        raise ValueError(f"{flag} {path}: defines no function reward_func(queries, prompts, labels, **kwargs)")
    return fn


_reward_files: dict[str, Callable] = {}


def _remote_answer(answer, n: int, flag: str) -> RemoteRewards:
    """OpenRLHF's answer forms: a dict with "rewards" (or "reward"), optional "scores" and "extra_logs"; or the
    rewards alone. Each checked: one float per query."""
    if isinstance(answer, Mapping):
        if "rewards" not in answer and "reward" not in answer:
            raise ValueError(f"{flag}: the answer has no 'rewards' (keys: {sorted(answer)})")
        rewards = answer.get("rewards", answer.get("reward"))
        scores, extra = answer.get("scores"), dict(answer.get("extra_logs") or {})
    else:
        rewards, scores, extra = answer, None, {}

    def vec(v, what):
        v = torch.as_tensor(v.tolist() if isinstance(v, torch.Tensor) else v, dtype=torch.float32).flatten()
        if v.numel() != n:
            raise ValueError(f"{flag}: {what} has {v.numel()} values for {n} queries")
        return v
    return RemoteRewards(rewards=vec(rewards, "rewards"), scores=None if scores is None else vec(scores, "scores"),
                         extra_logs=extra)


def call_remote_rm_full(url: str, queries: Sequence[str], prompts: Sequence[str], labels: Sequence | None = None,
                        *, timeout: float = 120.0, retries: int = 5, backoff: float = 1.0) -> RemoteRewards:
    """OpenRLHF's remote reward: a Python file's ``reward_func(queries, prompts, labels)`` (``is_reward_file``),
    called in this process, or a server: POST ``{"query": [prompt + response], "prompts": [...], "labels": [...]}``
    as JSON, read ``{"rewards": [...], "scores": [...], "extra_logs": {...}}`` (or ``"reward"``). A server is
    retried on connection errors and 5xx answers with exponential backoff; then ValueError naming --remote_rm_url."""
    labels = list(labels) if labels is not None else [None] * len(queries)
    if is_reward_file(url):
        if url not in _reward_files:
            _reward_files[url] = load_reward_file(url)
        return _remote_answer(_reward_files[url](list(queries), list(prompts), labels), len(queries),
                              f"--remote_rm_url {url}")
    import json
    import time
    import urllib.error
    import urllib.request

    body = json.dumps({"query": list(queries), "prompts": list(prompts), "labels": labels}).encode()
    last = ""
    for attempt in range(retries):
        try:
            req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                answer = json.loads(resp.read())
            break
        except urllib.error.HTTPError as e:
            last = f"HTTP {e.code} {e.reason}"
            if e.code < 500:
                raise ValueError(f"--remote_rm_url {url}: {last}") from None
        except (urllib.error.URLError, OSError, json.JSONDecodeError) as e:
            last = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
        time.sleep(backoff * 2 ** attempt)
    else:
        raise ValueError(f"--remote_rm_url {url}: no answer after {retries} attempts ({last}); is the reward server "
                         f"running?")
    return _remote_answer(answer, len(queries), f"--remote_rm_url {url}")


def call_remote_rm(url: str, queries: Sequence[str], prompts: Sequence[str], labels: Sequence | None = None, *,
                   timeout: float = 120.0, retries: int = 5, backoff: float = 1.0) -> torch.Tensor:
    """The rewards of ``call_remote_rm_full``. (N,) fp32."""
    return call_remote_rm_full(url, queries, prompts, labels, timeout=timeout, retries=retries,
                               backoff=backoff).rewards


def check_remote_rm(url: str, flag: str = "--remote_rm_url", what: str = "the reward server") -> None:
    """Before any model loads: a reward file that loads and defines ``reward_func``, or an http(s) URL where
    something listens at its host and port. ``flag`` and ``what`` name the URL in the errors (``--judge_url`` checks
    its server here too)."""
    import socket
    import urllib.parse

    if is_reward_file(url):
        load_reward_file(url)
        return
    u = urllib.parse.urlparse(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"{flag} must be an http(s) URL, got {url!r}")
    port = u.port or (443 if u.scheme == "https" else 80)
    try:
        socket.create_connection((u.hostname, port), timeout=10).close()
    except OSError as e:
        raise ValueError(f"{flag} {url}: cannot connect to {u.hostname}:{port} ({e}); start {what} "
                         f"first") from None
