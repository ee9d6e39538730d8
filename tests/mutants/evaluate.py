"""Planted bugs of the offline evaluation (launch/evaluate.py: rlhf/offline/evaluate.py, eval_metrics.py): each
caught by the hand counts of tests/offline/test_eval_metrics.py or by the real 2-rank job of
tests/ppo/test_evaluate.py."""
from tests.mutants import Mutant

UNIT = "tests/offline/test_eval_metrics.py::"
JOB = "tests/ppo/test_evaluate.py::"
M = "rlhf/offline/eval_metrics.py"
E = "rlhf/offline/evaluate.py"

MUTANTS = [
    Mutant("evaluate-pass-at-k-biased", M,
           find="    return float(1 - Fraction(comb(n - c, k), comb(n, k)))",
           replace="    return float(1 - (1 - Fraction(c, n)) ** k)",
           claim="pass@k is the unbiased estimator (samples drawn without replacement), not 1 - (1 - c/n)^k",
           tests=(UNIT + "test_pass_at_k_by_hand", UNIT + "test_pass_at_k_is_the_subset_share_and_humanevals")),
    Mutant("evaluate-pass-at-k-first-k", M,
           find='''        out[f"pass@{k}"] = sum(pass_at_k(n, sum(map(bool, row)), k) for row in correct) / p''',
           replace='''        out[f"pass@{k}"] = sum(any(row[:k]) for row in correct) / p''',
           claim="pass@k estimates over all n samples, not whether the first k hold a correct one",
           tests=(UNIT + "test_the_groups_metrics_by_hand", JOB + "test_results_are_the_hand_count")),
    Mutant("evaluate-avg-over-all", M,
           find='''        out[f"avg@{k}"] = sum(sum(map(bool, row[:k])) / k for row in correct) / p''',
           replace='''        out[f"avg@{k}"] = sum(sum(map(bool, row)) / n for row in correct) / p''',
           claim="avg@k is the accuracy of each prompt's first k samples",
           tests=(UNIT + "test_the_groups_metrics_by_hand", JOB + "test_results_are_the_hand_count")),
    Mutant("evaluate-maj-tie-last", M,
           find="    winner = next(a for a in answers if a is not None and votes[a] == top)  # ties: the first seen",
           replace="    winner = [a for a in answers if a is not None and votes[a] == top][-1]",
           claim="a tied majority vote goes to the answer seen first",
           tests=(UNIT + "test_majority_vote_by_hand",)),
    Mutant("evaluate-maj-none-votes", M,
           find="    votes = Counter(a for a in answers if a is not None)",
           replace="    votes = Counter(answers)",
           claim="samples without an answer do not vote",
           tests=(UNIT + "test_majority_vote_by_hand",)),
    Mutant("evaluate-rule-reward-one-shard", E,
           find="        for idx, got in shares:\n            if idx:\n",
           replace="        for idx, got in shares[:1]:\n            if idx:\n",
           claim="every rank's share of the rule reward reaches its samples",
           tests=(JOB + "test_results_are_the_hand_count",)),
    Mutant("evaluate-threshold-strict", E,
           find='''"correct": total[j].item() >= args.pass_threshold''',
           replace='''"correct": total[j].item() > args.pass_threshold''',
           claim="a sample is correct when its reward is at least --pass_threshold",
           tests=(JOB + "test_results_are_the_hand_count",)),
    Mutant("evaluate-resume-ignored", E,
           find="    done = agreed(resume_point(path, args.chunk_size * args.n_samples_per_prompt) if mesh.is_rank0 else 0)",
           replace="    done = agreed(0)",
           claim="a relaunch keeps the complete chunks and continues after them",
           tests=(JOB + "test_a_stopped_run_resumes_to_the_straight_run",)),
    Mutant("evaluate-judge-verdicts-misaligned", E,
           find="        verdict = judge.score([prompts[s.prompt_index].prompt for s in samples], replies,\n",
           replace="        verdict = judge.score([prompts[s.prompt_index].prompt for s in samples], replies[::-1],\n",
           claim="a judge in the evaluation scores each sample's own reply",
           tests=(JOB + "test_judge_in_the_evaluation_scores_each_sample_by_its_verdict",)),
    Mutant("evaluate-judge-dropped", E,
           find="        scores[\"judge\"], failures = torch.tensor(verdict.rewards, dtype=torch.float32), list(verdict.failures)\n",
           replace="        scores[\"judge\"], failures = torch.zeros(len(samples)), list(verdict.failures)\n",
           claim="the judge's verdicts are the evaluation's judge reward",
           tests=(JOB + "test_judge_in_the_evaluation_scores_each_sample_by_its_verdict",)),
]
