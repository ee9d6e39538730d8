"""The multi-turn rollout (``--agent_func_path``): every trajectory's ``AgentExecutor.execute`` runs as an asyncio
task on the rank that owns it (contiguous shares of the step's trajectories), the environments' ``reset`` and
``step`` concurrently; the tasks' ``llm_engine.generate`` calls wait until every live task of every rank waits
on one, and each turn is then one batched call of the colocated generator (``generate_requests``, a collective).

Determinism: trajectory j (prompt i, sample k: j = i * n + k) samples turn 0 with the plain path's seed of that
sample and later turns with seeds derived from it; ``random``, numpy's and torch's global generators are seeded
from the step and the trajectory before each environment call, so a resumed run sees the same environments.

Routing (an MoE actor, ``routing``): each turn's generator call returns the experts of every token it fed forward;
a trajectory gets those of its longest call that is a prefix of it (the last turn's prompt holds the earlier turns,
fed again at the same weights, as vLLM's prefill of a cached prefix), so ``--moe_router_replay rollout`` replays
the generator's experts on the whole trajectory; one whose actions that call does not cover gets none.

Failures: an environment that raises, returns a malformed dict or does not answer within ``--agent_timeout_s``
ends its trajectory there with reward 0 and a counted reason; more than ``--max_agent_failures`` in a step stop
the job with one error (on every rank alike: the counts are global).
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch.distributed as dist

from rlhf.agents.environment import Completion, RequestOutput, SamplingParams, _Logprob
from rlhf.agents.executor import (CURRENT, MultiTurnAgentExecutor, TooManyAgentFailures, Trajectory, execute_kwargs,
                                  load_agent_executor)
from rlhf.agents.program import RunAgentExecutor
from rlhf.agents.verifiers_v1 import close_worker
from rlhf.rollout.types import AgentOutcome, Sample  # noqa: F401 (AgentOutcome re-exported)

if TYPE_CHECKING:
    from rlhf.agents.flags import AgentPart

log = logging.getLogger(__name__)

_MIX = 6364136223846793005
_INC = 1442695040888963407


def turn_seed(base: int, j: int, turn: int) -> int:
    """Turn 0 of trajectory j: the plain path's seed of that sample (``base + j``); later turns mixed from it."""
    return trajectory_seed(base + j, turn)


def trajectory_seed(s: int, turn: int) -> int:
    """Turn ``turn`` of the trajectory whose seed is ``s``: ``s`` itself for turn 0, later turns mixed from it."""
    return s if turn == 0 else (s * _MIX + turn * _INC) % (1 << 63)


@dataclass
class Pool:
    """The trajectories a rollout drives on this rank: a synchronous step's (a pool per run) or the live sessions
    partial rollouts carry across weight updates (one pool for the job, ``rlhf.agents.carry``). A trajectory is
    keyed by its number: the step's (prompt-major) or, carried, ``group * n + k``."""

    pending: list = field(default_factory=list)
    """requests waiting for a round: queued, or parked by a round that stopped before answering them"""
    turns: Counter = field(default_factory=Counter)
    foreign: int = 0
    running: int = 0
    """trajectories holding a slot of ``bound`` (the rest wait for one)"""
    left: int = 0
    """this rank's trajectories not finished"""
    tasks: dict = field(default_factory=dict)
    """key -> the trajectory's task (its result dict once done), until the rollout collects it"""
    seeds: dict = field(default_factory=dict)
    """key -> the seed of a running trajectory (``trajectory_seed`` of its turns)"""
    finished: list = field(default_factory=list)
    """keys finished since the last round (every rank learns of them with the round's requests)"""
    versions: defaultdict = field(default_factory=lambda: defaultdict(list))
    """key -> the policy version of each of its answered calls, in order"""
    calls: defaultdict = field(default_factory=lambda: defaultdict(list))
    """key -> [(ids fed + sampled, routing)] (an MoE actor's routing)"""
    bound: asyncio.Semaphore | None = None
    generated: int = 0
    """tokens sampled for this rank's requests"""
    poke: object = lambda: None


class _BatchedLLM:
    """The turns' queue: ``generate`` (the ``llm_engine`` of OpenRLHF's executors) and ``submit`` (the endpoint's
    calls) queue a request and wait for the rollout's next batched round. One object for the whole job (an agent
    file may keep the first it is given); ``generate`` called from another thread (an agent file's own server) is
    handed to the rollout's loop; such calls have no trajectory and are seeded in the order they arrive."""

    def __init__(self, tokenizer, max_len: int):
        self.tokenizer, self.max_len = tokenizer, max_len
        self.pool = Pool()
        self.loop: asyncio.AbstractEventLoop | None = None

    def attach(self, loop, pool: Pool) -> None:
        """A round: its loop and the pool whose requests it queues."""
        self.loop, self.pool = loop, pool

    async def submit(self, j: int, turn: int, ids: list[int], params: tuple
                     ) -> tuple[list[int], list[float], bool, int]:
        """One request ``(temperature, top_p, max_tokens)`` of trajectory ``j``'s turn ``turn`` (its seed):
        (sampled ids, their log-probs, ended by EOS, the policy version that sampled them)."""
        pool = self.pool
        fut = self.loop.create_future()
        pool.pending.append((j, turn, list(ids), params, fut))
        pool.poke()
        return await fut

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        if asyncio.get_running_loop() is not self.loop:
            inner = asyncio.run_coroutine_threadsafe(self.generate(prompt_token_ids, sampling_params), self.loop)
            return await asyncio.wrap_future(inner)
        traj, pool = CURRENT.get(), self.pool
        if traj is None:
            j, turn = -1, pool.foreign
            pool.foreign += 1
        else:
            j = traj.index
            turn, pool.turns[j] = pool.turns[j], pool.turns[j] + 1
        ids, lps, finished, _ = await self.submit(j, turn, prompt_token_ids, _params_tuple(
            sampling_params, prompt_token_ids, self.max_len))
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        return RequestOutput([Completion(ids, text, [{t: _Logprob(lp)} for t, lp in zip(ids, lps)],
                                         "stop" if finished else "length")])


class AgentRollout:
    def __init__(self, cfg: AgentPart, tokenizer, mesh, routing: bool = False):
        self.cfg, self.tokenizer, self.mesh, self.routing = cfg, tokenizer, mesh, routing
        self.executor = load_agent_executor(cfg.agent_func_path)
        self.accepts = execute_kwargs(self.executor)
        self.llm = _BatchedLLM(tokenizer, cfg.max_len)
        self.loop = asyncio.new_event_loop()  # one for the job: an agent file's clients may outlive a step
        self.carry: Pool | None = None
        """partial rollouts: the rank's parked sessions, for the job (``rlhf.agents.carry``)"""
        self.next_group = 0
        """partial rollouts: the first group id no round has started yet"""
        self._kept_endpoint = None
        """partial rollouts: the endpoint of the carried sessions, for the job"""
        multi = isinstance(self.executor, MultiTurnAgentExecutor)
        program = isinstance(self.executor, RunAgentExecutor)
        if multi:
            self.executor.max_turns = cfg.max_turns
        if mesh.is_rank0:
            kind = ("MultiTurnAgentExecutor" if multi and type(self.executor).__mro__[1] is MultiTurnAgentExecutor
                    else type(self.executor).__mro__[1].__name__ if multi else
                    "run_agent, through the rank's OpenAI-compatible endpoint" if program else
                    "a custom AgentExecutor: --max_turns and --agent_timeout_s apply to MultiTurnAgentExecutor's "
                    "environments and run_agent files only")
            log.info("agent: %s (%s); trajectories of at most %d tokens%s, environment calls within %gs, %d failed "
                     "trajectories per step tolerated; the environments' rewards are the reward%s",
                     cfg.agent_func_path, kind, cfg.max_len, f", {cfg.max_turns} turns" if cfg.max_turns else "",
                     cfg.agent_timeout_s, cfg.max_agent_failures,
                     f"; at most {cfg.agent_max_sessions} at once per rank" if cfg.agent_max_sessions else "")

    def run(self, engine, prompts: list, prompt_idx: list[int], *, n: int, temperature: float, top_p: float,
            max_tokens: int, seed: int, version: int = 0) -> tuple[list[Sample], dict[str, float]]:
        """Every trajectory of the step (prompt-major, ``n`` per prompt) on every rank, and the step's agent
        metrics. ``prompts``: the dataset's PromptSamples; ``seed``: the plain path's seed of this rollout;
        ``version``: the policy version sampling (the endpoint's calls record it)."""
        mesh = self.mesh
        total = len(prompt_idx) * n
        mine = range(mesh.rank * total // mesh.world_size, (mesh.rank + 1) * total // mesh.world_size)
        params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens)
        starts = [(j, seed * 1_000_003 + j, prompts[prompt_idx[j // n]]) for j in mine]
        results = self.loop.run_until_complete(self._round(engine, Pool(), starts, params, seed, version))
        parts: list = [None] * mesh.world_size
        dist.all_gather_object(parts, results)
        samples = [self._sample(j // n, r) for j, r in enumerate(r for p in parts for r in p)]
        return samples, self._metrics(samples)

    async def _round(self, engine, pool: Pool, starts: list, params: SamplingParams, seed: int, version: int
                     ) -> list[dict]:
        """A synchronous step's trajectories ``starts`` run to their ends: their result dicts, in order."""
        endpoint = await self._endpoint(params)
        try:
            await self._drive(engine, pool, starts, params, seed, version)
        finally:
            if endpoint is not None:
                await endpoint.stop()
        return [pool.tasks.pop(key).result() for key, _, _ in starts]

    def close(self) -> None:
        """The job's end: sessions still parked (a job stopped between checkpoints) are cancelled, the endpoint
        partial rollouts kept is stopped, the loop closed and the verifiers 0.4.0 worker ended."""
        if self.loop.is_closed():
            return
        parked = list(self.carry.tasks.values()) if self.carry is not None else []
        for t in parked:
            t.cancel()
        if parked:
            self.loop.run_until_complete(asyncio.wait(parked, timeout=5))
        if self._kept_endpoint is not None:
            self.loop.run_until_complete(self._kept_endpoint.stop())
        self.loop.close()
        close_worker()

    async def _endpoint(self, params: SamplingParams, keep: bool = False):
        """A run_agent file's endpoint for this step (None for other executors); ``keep``: the one partial
        rollouts keep for the job (its sessions outlive a step)."""
        if not isinstance(self.executor, RunAgentExecutor):
            return None
        from rlhf.agents.endpoint import Endpoint, EndpointConfig

        ep = self._kept_endpoint if keep else None
        if ep is None:
            ep = Endpoint(self.llm, self.tokenizer, EndpointConfig(
                temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_tokens,
                max_len=self.cfg.max_len, max_turns=self.cfg.max_turns))
            await ep.start()
            if keep:
                self._kept_endpoint = ep
        self.executor.endpoint, self.executor.timeout_s = ep, self.cfg.agent_timeout_s
        self.executor.sampling = {"max_tokens": params.max_tokens, "temperature": params.temperature,
                                  "top_p": params.top_p}
        return ep

    async def _drive(self, engine, pool: Pool, starts: list, params: SamplingParams, seed: int, version: int,
                     stop=None) -> None:
        """The pool's trajectories, ``starts`` ((key, seed, prompt) each) begun now, turn by turn: one collective
        round per turn (every rank joins every round, with its queued requests or none) until no rank has any and
        every rank's trajectories are done, or until ``stop(keys every rank finished since the last round)`` says
        so: that round's requests are then parked in the pool, unanswered, and its trajectories wait there for a
        later call. A round starts once every running trajectory waits on a request (at most --agent_max_sessions
        run at once)."""
        ready = asyncio.Event()

        def poke(*_):
            if (pool.pending and len(pool.pending) >= pool.running) or not pool.left:
                ready.set()

        loop = asyncio.get_running_loop()
        pool.poke = poke
        self.llm.attach(loop, pool)
        if pool.bound is None:
            pool.bound = asyncio.Semaphore(self.cfg.agent_max_sessions or max(len(starts), 1))
        for key, s0, prompt in starts:
            ctx = contextvars.copy_context()
            ctx.run(CURRENT.set, Trajectory(seed=s0, timeout_s=self.cfg.agent_timeout_s, index=key))
            pool.seeds[key] = s0
            pool.left += 1
            pool.tasks[key] = loop.create_task(self._session(pool, key, prompt, params), context=ctx)
        base = seed * 1_000_003
        while True:
            poke()
            await ready.wait()
            ready.clear()
            queued, pool.pending = pool.pending, []
            finished, pool.finished = pool.finished, []
            parts: list = [None] * self.mesh.world_size
            dist.all_gather_object(parts, (not pool.left, finished, [(j, turn, ids, tuple(p), pool.seeds.get(j, 0))
                                                                     for j, turn, ids, p, _ in queued]))
            requests = [(rank, *r) for rank, (_, _, p) in enumerate(parts) for r in p]
            if stop is not None and stop([k for _, f, _ in parts for k in f]):
                pool.pending = queued + pool.pending  # parked: answered by a later call, under its weights
                break
            if not requests and all(done for done, _, _ in parts):
                break
            if requests:
                self._answer(engine, pool, base, version, requests, queued)
            await asyncio.sleep(0)

    async def _session(self, pool: Pool, key: int, prompt, params: SamplingParams) -> dict:
        """One trajectory in its slot of the pool's bound; its result carries its calls' versions and routing."""
        try:
            async with pool.bound:
                pool.running += 1
                try:
                    r = await self._one(prompt, params, self.llm)
                finally:
                    pool.running -= 1
            r["call_versions"] = pool.versions.pop(key, [])
            r["routed_experts"] = trajectory_routing(pool.calls.pop(key, []), r["observation_tokens"][
                : self.cfg.max_len], r["action_ranges"]) if self.routing else None
            return r
        finally:
            pool.seeds.pop(key, None)
            pool.left -= 1
            pool.finished.append(key)
            pool.poke()

    def _answer(self, engine, pool: Pool, base: int, version: int, requests: list, queued: list) -> None:
        """One batched call of the generator for every rank's requests (rank order; each ``(rank, j, turn, ...)``);
        this rank's futures get theirs, with the policy version that sampled them. A call without a trajectory
        (j = -1) is seeded from its rank and its number there."""
        outs = engine.generate_requests([(ids, mt, t, tp, trajectory_seed(s0, turn) if j >= 0 else
                                          turn_seed(base + 7_919 * (rank + 1), 0, turn + 1))
                                         for rank, j, turn, ids, (t, tp, mt), s0 in requests],
                                        **({"with_routing": True} if self.routing else {}))
        mine = [o for (rank, *_), o in zip(requests, outs) if rank == self.mesh.rank]  # in this rank's queue order
        for (j, turn, ids, _, fut), o in zip(queued, mine):
            if self.routing and j >= 0 and o[3] is not None:
                pool.calls[j].append((list(ids) + list(o[0]), o[3]))
            if j >= 0:
                pool.versions[j].append(version)
            pool.generated += len(o[0])
            if not fut.done():
                fut.set_result((*o[:3], version))

    async def _one(self, prompt, params: SamplingParams, llm: _BatchedLLM) -> dict:
        """One trajectory's ``execute``; a custom executor that raises ends its trajectory (prompt only)."""
        kw = {"prompt": prompt.prompt, "label": prompt.label, "sampling_params": params,
              "max_length": self.cfg.max_len, "hf_tokenizer": self.tokenizer, "llm_engine": llm, "images": None,
              "prompt_ids": prompt.prompt_ids.tolist()}
        t0 = time.perf_counter()
        try:
            out = await self.executor.execute(**{k: v for k, v in kw.items() if k in self.accepts})
            if not isinstance(out, dict) or "observation_tokens" not in out or "action_ranges" not in out:
                raise ValueError("execute must return a dict with observation_tokens and action_ranges")
        except Exception as e:  # noqa: BLE001 - a custom executor's failure ends its trajectory only
            ids = prompt.prompt_ids.tolist()
            out = {"observation_tokens": ids, "action_ranges": [], "rollout_log_probs": [0.0] * len(ids),
                   "prompt_length": len(ids), "turns": 0, "done": True, "failure": f"{type(e).__name__}: {e}"}
        traj = CURRENT.get()
        env_s = traj.env_seconds if traj.calls or traj.env_seconds else time.perf_counter() - t0
        keep = ("observation_tokens", "action_ranges", "rollout_log_probs", "reward", "scores", "extra_logs",
                "turns", "done", "last_finished", "prompt_length", "failure", "endpoint", "versions")
        truncated = bool(out.get("truncated", False))  # OpenRLHF's executors' key for a reply cut by its budget
        out = {k: out.get(k) for k in keep}
        out["env_seconds"] = env_s
        for k, v in (("turns", len(out["action_ranges"])), ("done", not truncated), ("last_finished", not truncated)):
            if out[k] is None:
                out[k] = v
        if out["prompt_length"] is None:  # OpenRLHF's executors: the first action starts the response
            out["prompt_length"] = out["action_ranges"][0][0] if out["action_ranges"] else len(
                out["observation_tokens"])
        out["extra_logs"] = {k: float(v.flatten()[0].item()) if hasattr(v, "flatten") else float(v)
                             for k, v in (out["extra_logs"] or {}).items() if _is_number(v)}
        return out

    # ------------------------------------------------------------------------------------------------ results
    def _sample(self, i: int, r: dict) -> Sample:
        """A trajectory as a Sample: the prompt, then every later token (actions and feedback, cut at --max_len)
        as the response; ``action_mask`` marks the model's own tokens."""
        start, obs = r["prompt_length"], r["observation_tokens"][: self.cfg.max_len]
        resp = obs[start:]
        mask = [False] * len(resp)
        for a, b in r["action_ranges"]:
            for p in range(max(a, start), min(b, len(obs))):
                mask[p - start] = True
        lps = (r["rollout_log_probs"] or [0.0] * len(obs))[start:len(obs)]
        failed = r["failure"] is not None
        reward = 0.0 if failed else r["reward"]
        score = 0.0 if failed else (r["scores"] if r["scores"] is not None else reward)
        cut = not failed and (not r["done"] or len(r["observation_tokens"]) > self.cfg.max_len)
        finished = bool(r["done"]) and bool(r.get("last_finished", True)) and not cut
        outcome = AgentOutcome(reward=None if reward is None else float(reward),
                               score=None if score is None else float(score), turns=int(r["turns"] or 0),
                               env_seconds=float(r["env_seconds"]), cut=cut, failure=r["failure"],
                               extra_logs=r["extra_logs"], endpoint=r.get("endpoint"))
        return Sample(i, list(obs[:start]), list(resp), list(lps), finished, action_mask=mask, agent=outcome,
                      routed_experts=r.get("routed_experts"), versions=token_versions(r, len(obs))[start:])

    def _metrics(self, samples: list[Sample]) -> dict[str, float]:
        """agent/*: turns per trajectory, environment seconds (summed over trajectories), the share cut by the
        budget or --max_turns, failures by reason; more than --max_agent_failures stop the job."""
        outs = [s.agent for s in samples]
        n = len(outs)
        reasons = Counter(failure_kind(o.failure) for o in outs if o.failure)
        failures = sum(reasons.values())
        if failures > self.cfg.max_agent_failures:
            first = next(o.failure for o in outs if o.failure)
            raise TooManyAgentFailures(f"{failures} of {n} agent trajectories failed in this step (--max_agent_failures "
                               f"{self.cfg.max_agent_failures}): {dict(reasons)}; the first: {first}")
        if failures and self.mesh.is_rank0:
            log.warning("agent: %d of %d trajectories failed (reward 0): %s", failures, n, dict(reasons))
        m = {"agent/turns": sum(o.turns for o in outs) / n, "agent/env_seconds": sum(o.env_seconds for o in outs),
             "agent/cut_rate": sum(o.cut for o in outs) / n, "agent/failures": float(failures),
             "agent/env_tokens_share": sum(len(s.action_mask) - sum(s.action_mask) for s in samples)
             / max(sum(len(s.response_ids) for s in samples), 1)}
        m.update({f"agent/failures/{k}": float(v) for k, v in reasons.items()})
        m.update(endpoint_metrics([o.endpoint for o in outs if o.endpoint is not None]))
        return m


def trajectory_routing(calls: list, obs: list[int], actions: list) -> object:
    """The routing of a trajectory ``obs`` (its tokens within --max_len) from its generator ``calls`` (each the ids
    fed and sampled, with the experts of those fed, one position fewer): that of the call sharing the longest prefix
    with ``obs``, up to where they part; None unless it covers every position an action's log-probs read (up to
    the token before each action's last)."""
    best, length = None, 0
    for ids, routed in calls:
        c = next((k for k, (a, b) in enumerate(zip(ids, obs)) if a != b), min(len(ids), len(obs)))
        valid = min(c, len(routed))
        if valid > length:
            best, length = routed, valid
    need = max((min(b, len(obs)) - 1 for a, b in actions if a < len(obs)), default=0)
    return best[:length] if best is not None and length >= need else None


def token_versions(r: dict, length: int) -> list[int]:
    """The policy version of each of a trajectory's first ``length`` tokens: a run_agent session's own (its calls'),
    else each action's from its call (the trajectory's calls in order, one per action); a token between actions,
    the environment's, gets the version of the action before it, and the prompt that of the first call."""
    if r.get("versions"):
        return list(r["versions"][:length])
    calls = r.get("call_versions") or [0]
    out = [calls[0]] * length
    for i, (a, _) in enumerate(sorted(r["action_ranges"])):
        out[a:length] = [calls[min(i, len(calls) - 1)]] * max(length - a, 0)
    return out


def failure_kind(failure: str) -> str:
    """timeout | malformed | budget | raised (the metric's name under agent/failures/)."""
    for prefix, kind in (("TimeoutError", "timeout"), ("MalformedStep", "malformed"), ("NoCalls", "malformed"),
                         ("BudgetExceeded", "budget")):
        if failure.startswith(prefix):
            return kind
    return "raised"


def endpoint_metrics(stats: list[dict]) -> dict[str, float]:
    """agent/endpoint/*: requests per session, the share of calls outside the trained chain, the share of
    continued requests whose naive re-tokenization differs from the ids fed (what training on re-tokenized text
    would have got wrong), and the requests that started a new segment."""
    if not stats:
        return {}
    calls = sum(s["calls"] for s in stats)
    cont = sum(s["continued"] for s in stats)
    return {"agent/endpoint/calls": calls / len(stats),
            "agent/endpoint/untrained_share": sum(s["untrained_calls"] for s in stats) / max(calls, 1),
            "agent/endpoint/retokenize_differs_share": sum(s["retokenize_differs"] for s in stats) / max(cont, 1),
            "agent/endpoint/new_segments": float(sum(s["new_segments"] for s in stats))}


def _params_tuple(sp, ids: list[int], max_len: int) -> tuple[float, float, int]:
    """(temperature, top_p, max_tokens) of a request; no max_tokens: up to --max_len."""
    mt = getattr(sp, "max_tokens", None) or max_len - len(ids)
    return float(getattr(sp, "temperature", 1.0)), float(getattr(sp, "top_p", 1.0)), max(int(mt), 1)


def _is_number(v) -> bool:
    if hasattr(v, "numel"):
        return v.numel() >= 1
    return isinstance(v, (int, float)) and not isinstance(v, bool)
