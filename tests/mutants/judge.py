"""Planted bugs of the LLM judge (``rlhf.rewards.judge``, its place among the reward sources and in the memory
schedule): each caught by tests/ppo/test_judge.py."""
from tests.mutants import Mutant

T = "tests/ppo/test_judge.py::"
J = "rlhf/rewards/judge.py"
JOB = T + "test_judge_in_the_job_rewards_each_reply_by_its_verdict"
URL = T + "test_judge_behind_openai_api_counts_what_it_cannot_read"

MUTANTS = [
    Mutant("judge-verdicts-of-another-ranks-replies", "rlhf/ppo/reward_sources.py",
           find="            lo = self.mesh.dp_rank * len(rollout.local)\n",
           replace="            lo = 0\n",
           claim="at DP > 1 each rank's replies get their own verdicts out of the step's (the judge in the job "
                 "answers every reply of the step on every rank)",
           tests=(JOB,)),
    Mutant("judge-weight-ignored", "rlhf/rewards/sources.py",
           find='            out["judge"] = self.judge\n',
           replace='            out["judge"] = 1.0\n',
           claim="--judge_weight weighs the judge's reward in the sum of the sources",
           tests=(JOB,)),
    Mutant("judge-first-number-read", J,
           find="            x = float(found[-1])\n",
           replace="            x = float(found[0])\n",
           claim="number:LO:HI reads the answer's last number (a judge that reasons first ends with its rating)",
           tests=(T + "test_parsers_by_hand",)),
    Mutant("judge-first-choice-read", J,
           find="            at = {c: text.rfind(c) for c in self.choices}\n",
           replace="            at = {c: text.find(c) for c in self.choices}\n",
           claim="choice:... takes the choice appearing last in the answer",
           tests=(T + "test_parsers_by_hand",)),
    Mutant("judge-fail-reward-ignored", J,
           find="        rewards.append(fail_reward if r is None else r)\n",
           replace="        rewards.append(0.0 if r is None else r)\n",
           claim="a failed judgement gets --judge_fail_reward",
           tests=(T + "test_verdicts_count_failures_and_pay_the_fail_reward", URL)),
    Mutant("judge-refusal-stops-the-job", J,
           find='                    return None, "refused"\n',
           replace='                    raise ValueError(f"--judge_url {url}: {last}")\n',
           claim="a request the judge's server refuses (HTTP 4xx) is counted as judge/refused, never a crash",
           tests=(URL,)),
    Mutant("judge-label-not-rendered", J,
           find='"{label}": "" if label is None else str(label)}',
           replace='"{label}": ""}',
           claim="the template's {label} is the record's --label_key field",
           tests=(T + "test_render_fills_only_its_placeholders",)),
    Mutant("judge-chat-template-skipped", J,
           find="        if self.chat:\n",
           replace="        if False:\n",
           claim="the judge reads the rendered template as a user message through its own chat template",
           tests=(T + "test_model_judge_prompts_through_its_chat_template_and_skips_what_is_too_long",)),
    Mutant("judge-too-long-generated", J,
           find="        fits = [i for i, x in enumerate(ids) if 0 < len(x) <= room]\n",
           replace="        fits = [i for i, x in enumerate(ids) if 0 < len(x)]\n",
           claim="a prompt past the judge's context is not generated for and counts as judge/too_long",
           tests=(T + "test_model_judge_prompts_through_its_chat_template_and_skips_what_is_too_long",)),
    Mutant("judge-not-offloaded", "rlhf/runtime/offload.py",
           find='(role in ("ref", "judge") or role.startswith("reward"))',
           replace='(role == "ref" or role.startswith("reward"))',
           claim="--ref_reward_offload keeps the judge's weights on the host outside make_experience",
           tests=(T + "test_the_judge_is_resident_when_the_reward_models_are",)),
]
