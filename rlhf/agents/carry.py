"""Partial rollouts with agents (``--partial_rollout`` or ``--async_one_step_off`` with ``--agent_func_path``): a
round of ``rlhf.rollout.partial`` whose samples are agent trajectories. The sessions a round does not finish are not
aborted: each waits, parked on its unanswered request, in the rank's asyncio loop while the trainer updates the
weights, and the next round answers that request under the new weights, so a session's turns keep the policy
version that sampled each of them (``Sample.versions``) and its tokens are those sampled, whatever the session's
program does between turns. One pool of live sessions per rank for the job (``rlhf.agents.rollout.Pool``), one
endpoint for the job (a session's URL outlives a step); a session lives on the rank that started it.

A live session is a coroutine, not data: a step that saves a checkpoint (``--save_steps``, the last step) runs every
session to its end before it stops the round, and the whole groups it does not train are carried as finished
samples (``PartialSample.agent``), which the checkpoint holds; a resumed job continues exactly as the straight
one. Between two saves nothing is lost either: sessions are parked, never dropped (``--partial_rollout_drop_stale``,
which would drop them, is refused with agents)."""
from __future__ import annotations

import torch.distributed as dist

from rlhf.agents.environment import SamplingParams
from rlhf.agents.rollout import Pool


def _key(s, n: int) -> int:
    return s.group * n + s.k


def agent_round(agent, engine, prompts: list, groups: list, *, groups_needed: int, due: list[bool], version: int,
                temperature: float, top_p: float, max_tokens: int, seed: int) -> tuple[list, dict]:
    """One round over ``groups`` (lists of ``PartialSample``, the same on every rank) with ``agent``
    (``AgentRollout``) driving ``engine``: the samples no rank has started begin now (their ``seed``, contiguous
    shares of them per rank), parked sessions get their answers under ``version``, and the round stops once
    ``groups_needed`` groups are whole and every ``due`` one is. Returns the groups, a finished trajectory's
    sample filled in (``done``, ``agent``, its tokens and their versions; a live one's ``versions`` are its
    calls'), and the counts: ``aborted`` (sessions left parked), ``generated`` tokens."""
    mesh, pool = agent.mesh, _pool(agent)
    n = len(groups[0]) if groups else 1
    new = [s for g in groups for s in g if not s.done and s.group >= agent.next_group]
    agent.next_group = max([agent.next_group] + [g[0].group + 1 for g in groups])
    lo, hi = mesh.rank * len(new) // mesh.world_size, (mesh.rank + 1) * len(new) // mesh.world_size
    starts = [(_key(s, n), s.seed, prompts[s.prompt_index]) for s in new[lo:hi]]
    done = {_key(s, n) for g in groups for s in g if s.done}

    def stop(finished: list[int]) -> bool:
        done.update(finished)
        whole = [all(_key(s, n) in done for s in g) for g in groups]
        return sum(whole) >= groups_needed and all(w or not d for w, d in zip(whole, due))

    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens)

    async def go():
        await agent._endpoint(params, keep=True)
        before = pool.generated
        await agent._drive(engine, pool, starts, params, seed, version, stop=stop)
        results = {k: pool.tasks.pop(k).result() for k in [k for k, t in pool.tasks.items() if t.done()]}
        return results, {k: list(pool.versions.get(k, [])) for k in pool.tasks}, pool.generated - before

    mine = agent.loop.run_until_complete(go())
    parts: list = [None] * mesh.world_size
    dist.all_gather_object(parts, mine)
    results = {k: r for p in parts for k, r in p[0].items()}
    live = {k: v for p in parts for k, v in p[1].items()}
    for g in groups:
        for s in g:
            k = _key(s, n)
            if k in results:
                smp = agent._sample(s.prompt_index, results[k])
                s.done, s.finished, s.agent = True, smp.finished, smp
                s.response_ids, s.logprobs, s.versions = list(smp.response_ids), list(smp.logprobs), list(smp.versions)
            elif k in live:
                s.versions = live[k]
    return groups, {"aborted": len(live), "generated": sum(p[2] for p in parts)}


def _pool(agent) -> Pool:
    """The rank's live sessions, for the job: at most --agent_max_sessions at once, else unbounded."""
    if agent.carry is None:
        import asyncio

        agent.carry = Pool(bound=asyncio.Semaphore(agent.cfg.agent_max_sessions or 1 << 30))
    return agent.carry
