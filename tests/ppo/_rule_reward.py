"""A rule reward for the tests: ``--reward_fn _rule_reward:length_reward`` (tests/ppo on PYTHONPATH)."""


def length_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """Longer replies score higher, capped: min(characters, 12) / 12."""
    return [min(len(r), 12) / 12.0 for r in responses]


NOT_CALLABLE = 3
