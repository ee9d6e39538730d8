"""Planted bugs of the reward path in a job: a reward attached to another sample than its own."""
from tests.mutants import Mutant

MUTANTS = [
    Mutant("rewards-replies-out-of-order", "rlhf/ppo/reward_sources.py",
           find='''self.tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)''',
           replace='''self.tokenizer.batch_decode([s.response_ids for s in samples[::-1]], skip_special_tokens=True)''',
           claim="each sample's reward is its own reply's (with dynamic filtering and partial rollouts)",
           tests=("tests/ppo/test_code_rl.py::test_each_samples_reward_is_its_own_programs_verdict",)),
]
