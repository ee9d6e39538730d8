"""A rule reward for the tests: ``--reward_fn _rule_reward:length_reward`` (tests/ppo on PYTHONPATH)."""


def length_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """Longer replies score higher, capped: min(characters, 12) / 12."""
    return [min(len(r), 12) / 12.0 for r in responses]


NOT_CALLABLE = 3


def one_nan_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """0.5 for every reply but the first of each batch, which scores NaN (the non-finite guard's test)."""
    return [float("nan")] + [0.5] * (len(responses) - 1)


def constant_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """0.5 for every reply: GRPO's advantages are all zero, so only other losses (ptx) move the actor."""
    return [0.5] * len(responses)


def parity_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """1 for a reply of an even number of characters, else 0: a binary verifier whose groups of replies sometimes
    agree (dynamic filtering drops them) and sometimes not."""
    return [float(len(r) % 2 == 0) for r in responses]


def char_code_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """(sum of the reply's character codes mod 7) / 6: almost surely different within a group, so every group has a
    nonzero advantage."""
    return [(sum(map(ord, r)) % 7) / 6.0 for r in responses]


SCRIPTED_PROGRAMS = ("def f(a, b):\n    return a + b\n",  # passes the 3 tests
                     "def f(a, b):\n    return a - b\n",  # passes 2 of them
                     "def f(a, b) return a + b\n")        # does not compile
"""The programs ``scripted_code_reward`` grades: one a reply's text picks (``scripted_program``)."""


def scripted_program(reply: str) -> str:
    return SCRIPTED_PROGRAMS[sum(map(ord, reply)) % 3]


def scripted_code_reward(prompts, responses, labels=None, **kw):
    """The code reward (``--reward_fn code``'s function, the real sandbox) on the program each reply's text picks:
    rewards 1, 2/3 or 0 by reply, so a reward attached to another sample's row shows."""
    from rlhf.sandbox.code_reward import code_reward

    return code_reward(prompts, ["```python\n" + scripted_program(r) + "```" for r in responses], labels=labels,
                       **kw)


def first_word(reply: str) -> str | None:
    """A reply's answer for majority voting (launch/evaluate.py --answer_fn): its first word, None when empty."""
    words = reply.split()
    return words[0] if words else None
