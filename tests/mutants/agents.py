"""Planted bugs of the agents' OpenAI endpoint and run_agent programs (rlhf/agents): token exactness, the OpenAI
surface, a session's budget, failures and their reasons, the concurrency bound, OpenRLHF's executor files."""
from tests.mutants import Mutant

EP = "tests/ppo/test_agent_endpoint.py::"
JOBS = "tests/ppo/test_agent_programs.py::"
TOOL = EP + "test_a_tool_conversation_is_fed_and_trained_on_the_sampled_ids"
CHAT_JOB = JOBS + "test_a_run_agent_chat_trains_the_sampled_tokens"
FAILING = JOBS + "test_programs_that_raise_hang_or_overrun_get_reward_0_and_a_reason"
SWE = "tests/ppo/test_agent_swe.py::"
REPO = SWE + "test_the_repository_lives_on_the_host_and_runs_in_the_sandbox"
SCRIPTED = SWE + "test_a_scripted_model_fixes_a_bug_through_the_tools"
CALC = JOBS + "test_the_calculator_program_feeds_calc_agents_conversation"
MINI = SWE + "test_mini_swe_agent_fixes_a_bug_through_the_endpoint_in_the_sandbox"
EVAL_JOB = "tests/ppo/test_agents.py::test_held_out_evaluation_runs_the_agent"
ROUTE_HAND = "tests/ppo/test_agents.py::test_a_trajectorys_routing_is_its_longest_prefix_call"
ROUTE_JOB = "tests/ppo/test_routing_replay_ppo.py::test_grpo_with_routing_replay[agent_rollout]"
OWN = "tests/ppo/test_agents.py::test_each_ranks_calls_get_their_own_answers"
CARRY = "tests/ppo/test_agent_partial.py::"
PARKED = CARRY + "test_parked_sessions_cross_an_update_with_their_versions_and_resume_exactly"
K0 = CARRY + "test_max_staleness_0_is_the_synchronous_agent_job"
CARRY_PROGRAM = CARRY + "test_a_run_agent_program_is_carried_through_its_endpoint"
REFUSED = "tests/ppo/test_partial_buffer.py::test_combinations_not_built_are_refused_by_name"

MUTANTS = [
    Mutant("agents-continuation-reencoded", "rlhf/agents/tokens.py",
           find='''        ids = c.prompt_ids + c.completion_ids + (self.tok(text=rest, add_special_tokens=False)["input_ids"]
                                                 if rest else [])''',
           replace='''        ids = naive''',
           claim="a continued request is fed the earlier call's prompt and sampled ids verbatim, not the client's "
                 "conversation re-encoded",
           tests=(TOOL, CHAT_JOB)),
    Mutant("agents-turn-end-dropped", "rlhf/agents/tokens.py",
           find='''        if eos and end.startswith(eos):
            return end[len(eos):]
        return end''',
           replace='''        if eos and end.startswith(eos):
            return ""
        return end''',
           claim="after the sampled ids the template's end of the assistant turn follows, less the EOS sampled",
           tests=(TOOL,)),
    Mutant("agents-rewritten-history-continued", "rlhf/agents/tokens.py",
           find='''            if full.startswith(prev) and prev.endswith(self.fmt.turn_end):''',
           replace='''            if True:''',
           claim="a template that renders earlier turns otherwise once later ones follow starts a new segment",
           tests=(EP + "test_a_template_that_rewrites_earlier_turns_starts_a_new_segment",)),
    Mutant("agents-logprobs-not-placed", "rlhf/agents/tokens.py",
           find='''            lps[a:b] = c.logprobs''', replace='''            pass''',
           claim="each trained token carries the generator's log-prob of it",
           tests=(TOOL, CHAT_JOB)),
    Mutant("agents-stop-keeps-all-ids", "rlhf/agents/openai_api.py",
           find='''            return list(ids[:k]), part[:min(hits)], True''',
           replace='''            return list(ids), part[:min(hits)], True''',
           claim="a reply cut at a stop string keeps the ids through the token that completed it, no more",
           tests=(EP + "test_n_stop_max_tokens_completions_and_stream",)),
    Mutant("agents-temperature-taken-from-request", "rlhf/agents/openai_api.py",
           find='''        if v is not None and (not isinstance(v, (int, float)) or abs(float(v) - job) > 1e-6):''',
           replace='''        if False:''',
           claim="a request asking for another temperature or top_p than the job's is refused",
           tests=(EP + "test_requests_the_endpoint_cannot_serve_are_refused_by_name[body0-400-this endpoint samples "
                       "at the job's --temperature 1]",)),
    Mutant("agents-budget-not-a-failure", "rlhf/agents/endpoint.py",
           find='''        st.failure = BudgetExceeded(msg)''', replace='''        pass''',
           claim="a session asking past --max_len or --max_turns fails with reason budget",
           tests=(EP + "test_a_session_past_its_budget_fails[cfg0-leave no room for a reply within --max_len 30]",
                  FAILING)),
    Mutant("agents-timeout-counted-as-raised", "rlhf/agents/rollout.py",
           find='''(("TimeoutError", "timeout"), ''', replace='''(("TimeoutErrorX", "timeout"), ''',
           claim="a program that hangs is counted under agent/failures/timeout",
           tests=(FAILING,)),
    Mutant("agents-hung-program-not-cancelled", "rlhf/agents/program.py",
           find='''            if late:
                task.cancel()''', replace='''            if late:
                pass''',
           claim="a program that goes --agent_timeout_s without a request in flight is cancelled",
           tests=(FAILING,)),
    Mutant("agents-sessions-unbounded", "rlhf/agents/rollout.py",
           find='''            pool.bound = asyncio.Semaphore(self.cfg.agent_max_sessions or max(len(starts), 1))''',
           replace='''            pool.bound = asyncio.Semaphore(max(len(starts), 1))''',
           claim="at most --agent_max_sessions trajectories run at once on a rank",
           tests=(FAILING,)),
    Mutant("agents-no-reward-not-left-to-the-rule", "rlhf/ppo/reward_sources.py",
           find='''        if self.cfg.agent and not (unscored and (scores or self.cfg.remote_rm_url)):''',
           replace='''        if self.cfg.agent:''',
           claim="an executor that returns no reward (OpenRLHF's one-turn ones) leaves the reward to --reward_fn",
           tests=(JOBS + "test_openrlhfs_openai_server_executor_runs_with_its_import_changed",)),
    Mutant("agents-program-scores-ignored", "rlhf/agents/program.py",
           find='''        return r, (None if s is None else as_float(s, "run_agent's scores")), dict(value.get("extra_logs") or {})''',
           replace='''        return r, None, dict(value.get("extra_logs") or {})''',
           claim="a run_agent program's scores are what dynamic filtering reads",
           tests=(JOBS + "test_dynamic_filtering_reads_a_programs_scores",)),
    Mutant("agents-completion-eos-twice", "rlhf/agents/tokens.py",
           find='''                if eos and rest.startswith(eos):  # the client wrote the turn's end the model sampled (not in the text)
                    rest = rest[len(eos):]''',
           replace='''                pass''',
           claim="a completion client that writes the sampled EOS itself is fed it once",
           tests=(EP + "test_a_completion_client_writing_the_sampled_eos_gets_it_once",)),
    Mutant("agents-swe-graded-by-exit-status", "rlhf/demo/swe_task.py",
           find='''        return r.status == "ok" and r.exit_code == 0 and r.stdout.splitlines()[-1:] == [f"{tag} {n} passed, 0 failed"]''',
           replace='''        return r.status == "ok" and r.exit_code == 0''',
           claim="a module of the agent's that ends the grader with status 0 before any test ran scores 0",
           tests=(REPO,)),
    Mutant("agents-swe-graded-on-the-visible-test", "rlhf/demo/swe_task.py",
           find='''        r = self._run(RUN_TESTS.format(module="hidden_tests", tag=tag + " "),
                      extra={"hidden_tests.py": self.task.hidden})
        n = len(re.findall(r"^def test_", self.task.hidden, re.M))''',
           replace='''        r = self._run(RUN_TESTS.format(module=self.task.test, tag=tag + " "))
        n = len(re.findall(r"^def test_", self.task.files[self.task.test + ".py"], re.M))''',
           claim="the reward is the hidden tests': a fix that passes the visible test only scores 0",
           tests=(REPO, SCRIPTED)),
    Mutant("agents-swe-write-lost", "rlhf/demo/swe_task.py",
           find='''        self.files[path] = content''', replace='''        pass''',
           claim="a file the agent writes is what the next sandbox command runs on",
           tests=(SCRIPTED,)),
    Mutant("agents-swe-shell-edits-lost", "rlhf/demo/swe_task.py",
           find='''        self.files = {n: t for n, t in kept.items() if''',
           replace='''        _ = {n: t for n, t in kept.items() if''',
           claim="the files a shell command leaves in the sandbox's working folder become the repository's",
           tests=(REPO,)),
    Mutant("agents-calc-program-past-max-calls", "rlhf/demo/calc_program.py",
           find='''        if call is None or calls >= MAX_CALLS:''',
           replace='''        if call is None or calls > MAX_CALLS:''',
           claim="the calculator program ends a trajectory where calc_agent.py does: the reply after MAX_CALLS calls",
           tests=(CALC,)),
    Mutant("agents-calc-program-reply-dropped", "rlhf/demo/calc_program.py",
           find='''        messages += [{"role": "assistant", "content": reply},''',
           replace='''        messages += [''',
           claim="the calculator program's requests are fed what calc_agent.py's executor feeds",
           tests=(CALC,)),
    Mutant("agents-swe-mini-commands-on-the-host", "rlhf/demo/swe_mini.py",
           find='''        out, code = self.repo.shell(exports + action.get("command", ""),''',
           replace='''        return super().execute(action, cwd, timeout=timeout)
        out, code = self.repo.shell(exports + action.get("command", ""),''',
           claim="mini-swe-agent's commands run in the sandbox on the trajectory's repository, not on the host",
           tests=(MINI,)),
    Mutant("agents-swe-mini-submit-ignored", "rlhf/demo/swe_mini.py",
           find='''        self._check_finished(output)  # raises Submitted''',
           replace='''        pass  # raises Submitted''',
           claim="mini-swe-agent's submit command ends its run in the sandbox as on its own environment",
           tests=(MINI,)),
    Mutant("agents-routing-first-call", "rlhf/agents/rollout.py",
           find="        if valid > length:\n", replace="        if not length:\n",
           claim="a trajectory replays the routing of its longest prefix call (the last turn), not its first",
           tests=(ROUTE_HAND, ROUTE_JOB)),
    Mutant("agents-routing-uncovered-kept", "rlhf/agents/rollout.py",
           find="    return best[:length] if best is not None and length >= need else None",
           replace="    return best[:length] if best is not None else None",
           claim="a trajectory whose actions its calls' routing does not cover gets no routing (R3 refuses it) "
                 "instead of filler experts",
           tests=(ROUTE_HAND,)),
    Mutant("agents-routing-not-asked", "rlhf/agents/rollout.py",
           find="r[\"routed_experts\"] = trajectory_routing(", replace="r[\"routed_experts\"] = None and trajectory_routing(",
           claim="an MoE actor's agent trajectories carry their generator's routing into R3",
           tests=(ROUTE_JOB,)),
    Mutant("agents-eval-single-turn", "rlhf/ppo/evaluation.py",
           find="            if roles.agent is not None:  # every rank gets every trajectory",
           replace="            if False:  # every rank gets every trajectory",
           claim="--eval_dataset with an agent runs the held-out prompts as the agent's trajectories",
           tests=(EVAL_JOB,)),
    Mutant("agents-eval-environment-reward-dropped", "rlhf/ppo/trainer.py",
           find="remote_rm_timeout=r.remote_rm_timeout, agent=r.agent)",
           replace="remote_rm_timeout=r.remote_rm_timeout)",
           claim="the held-out trajectories are scored by their environments' rewards",
           tests=(EVAL_JOB,)),
    Mutant("agents-carried-turns-restamped", "rlhf/agents/rollout.py",
           find="        out[a:length] = [calls[min(i, len(calls) - 1)]] * max(length - a, 0)",
           replace="        out[a:length] = [calls[-1]] * max(length - a, 0)",
           claim="with partial rollouts a carried session's turns keep the policy version that sampled each",
           tests=(PARKED,)),
    Mutant("agents-endpoint-call-session-version", "rlhf/agents/rollout.py",
           find="                fut.set_result((*o[:3], version))",
           replace="                fut.set_result((*o[:3], pool.versions[j][0] if j >= 0 else version))",
           claim="an endpoint call records the version of the round that answered it, not the session's first",
           tests=(CARRY_PROGRAM,)),
    Mutant("agents-live-session-checkpointed", "rlhf/ppo/partial_step.py",
           find="job.partial.whole_groups or (closing and roles.agent is not None)",
           replace="job.partial.whole_groups",
           claim="a step that saves runs every agent session to its end, so a resumed job is the straight one",
           tests=(PARKED,)),
    Mutant("agents-carried-seed-shifted", "rlhf/agents/carry.py",
           find="    starts = [(_key(s, n), s.seed, prompts[s.prompt_index]) for s in new[lo:hi]]",
           replace="    starts = [(_key(s, n), s.seed + 1, prompts[s.prompt_index]) for s in new[lo:hi]]",
           claim="a partial round's new trajectory is seeded as the synchronous step seeds that sample",
           tests=(K0,)),
    Mutant("agents-partial-drop-stale-allowed", "rlhf/rollout/partial_config.py",
           find="    if job.agent.agent_func_path and p.partial_rollout_drop_stale:",
           replace="    if False:",
           claim="--partial_rollout_drop_stale is refused with agents (parked sessions are never dropped)",
           tests=(REFUSED,)),
    Mutant("agents-partial-sessions-on-evals-endpoint", "rlhf/agents/rollout.py",
           find="        self.executor.endpoint, self.executor.timeout_s = ep, self.cfg.agent_timeout_s",
           replace="        if self.executor.endpoint is None or not keep:\n            self.executor.endpoint = ep\n"
                   "        self.executor.timeout_s = self.cfg.agent_timeout_s",
           claim="with partial rollouts a held-out evaluation's sessions use an endpoint of their own, the next "
                 "round's the job's again",
           tests=(CARRY_PROGRAM,)),
    Mutant("agents-answers-by-call-number", "rlhf/agents/rollout.py",
           find="        mine = [o for (rank, *_), o in zip(requests, outs) if rank == self.mesh.rank]  # in this rank's queue order",
           replace="        got = {(j, turn): o for (_, j, turn, *_), o in zip(requests, outs)}\n"
                   "        mine = [got[(j, turn)] for j, turn, *_ in queued]",
           claim="each rank's calls get their own answers, calls without a trajectory (numbered per rank) included",
           tests=(OWN,)),
    Mutant("agents-foreign-seed-per-job", "rlhf/agents/rollout.py",
           find="turn_seed(base + 7_919 * (rank + 1), 0, turn + 1))",
           replace="turn_seed(base + 7_919, 0, turn + 1))",
           claim="calls without a trajectory on different ranks are seeded apart",
           tests=(OWN,)),
    Mutant("agents-environment-tokens-counted-generated", "rlhf/ppo/stages.py",
           find="        return sum(len(s.response_ids) if s.action_mask is None else sum(s.action_mask) for s in self.samples)",
           replace="        return sum(len(s.response_ids) for s in self.samples)",
           claim="a rollout's generated tokens (tokens_per_s/rollout, dynamic_filtering/generated_tokens) are the "
                 "sampled ones, not a trajectory's environment tokens",
           tests=(K0,)),
]
