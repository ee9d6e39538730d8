"""The offline evaluation's metrics (rlhf/offline/eval_metrics.py) against hand counts, against the definition
(every k-subset of a prompt's samples enumerated: the share holding a correct one), and against HumanEval's own
estimator (``estimate_pass_at_k``, transcribed in tests/peer_math.py from openai/human-eval at 6d43fb98)."""
from __future__ import annotations

import itertools
import random

import pytest

from peer_math import humaneval_pass_at_k
from rlhf.offline.eval_metrics import default_ks, evaluate_groups, majority_correct, pass_at_k, table


@pytest.mark.parametrize("n,c,k,want", [(4, 2, 1, 1 / 2), (4, 2, 2, 5 / 6), (4, 2, 3, 1.0), (5, 1, 2, 2 / 5),
                                        (5, 1, 3, 3 / 5), (3, 0, 3, 0.0), (8, 3, 2, 1 - 10 / 28)])
def test_pass_at_k_by_hand(n, c, k, want):
    """e.g. n=4, c=2, k=2: of the C(4,2)=6 pairs only the two wrong samples together fail: 5/6."""
    assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-15)


def test_pass_at_k_is_the_subset_share_and_humanevals():
    rng = random.Random(0)
    for _ in range(40):
        n = rng.randint(1, 9)
        row = [rng.random() < 0.4 for _ in range(n)]
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(row, k))
            want = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, sum(row), k) == pytest.approx(want, abs=1e-12)
            assert pass_at_k(n, sum(row), k) == pytest.approx(humaneval_pass_at_k(n, sum(row), k), abs=1e-12)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)


def test_majority_vote_by_hand():
    assert majority_correct(["1", "2", "2", None], [True, False, False, False]) is False  # "2" wins 2 to 1
    assert majority_correct(["1", "2", "2", None][:1], [True]) is True
    assert majority_correct(["1", "2"], [False, True]) is False  # a tie: the first answer seen
    assert majority_correct([None, "3", None, "3", "4"], [False, True, False, True, False]) is True  # None votes not
    assert majority_correct([None, None], [True, True]) is False  # no answer: wrong


def test_the_groups_metrics_by_hand():
    """Two prompts of 4 samples: (T, F, F, T) and (F, F, F, F); answers vote a, b, b, a (tie: a, right) and c, c, d, c
    (c, wrong)."""
    correct = [[True, False, False, True], [False] * 4]
    answers = [["a", "b", "b", "a"], ["c", "c", "d", "c"]]
    rewards = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.5, 0.0, 0.0]]
    m = evaluate_groups(correct, answers, rewards, [1, 2, 4])
    assert m["pass@1"] == pytest.approx((2 / 4 + 0) / 2)
    assert m["pass@2"] == pytest.approx((5 / 6 + 0) / 2)
    assert m["pass@4"] == pytest.approx(1 / 2)
    assert m["avg@1"] == pytest.approx(1 / 2) and m["avg@2"] == pytest.approx(1 / 4) and m["avg@4"] == 1 / 4
    # maj@1: a (right), c (wrong); maj@2: a-b tie -> a (right), c; maj@4: a-b tie -> a, c
    assert m["maj@1"] == m["maj@2"] == m["maj@4"] == pytest.approx(1 / 2)
    assert m["mean_reward"] == pytest.approx(2.5 / 8)
    assert default_ks(8) == [1, 2, 4, 8] and default_ks(6) == [1, 2, 4, 6] and default_ks(1) == [1]
    assert table(m, [1, 2]).splitlines()[2] == "| 1 | 0.2500 | 0.5000 | 0.5000 |"
    with pytest.raises(ValueError, match="every prompt needs 4 samples"):
        evaluate_groups([[True] * 4, [True] * 3], answers, rewards, [1])
