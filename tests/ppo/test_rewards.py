"""rlhf/rewards/sources.py: the weighted combination against hand numbers, --reward_fn loading and checks, and PPO's bad
reward flags (an ``error:`` naming the flag, exit 2, no model loaded)."""
import os

import pytest
import torch
from ppo_common import ppo_args

HERE = os.path.dirname(os.path.abspath(__file__))


def test_combine_rewards_by_hand():
    from rlhf.rewards.sources import combine_rewards

    scores = {"rm0": torch.tensor([1.0, 2.0]), "rm1": torch.tensor([3.0, -1.0]), "fn": torch.tensor([1.0, 0.0])}
    weights = {"rm0": 0.5, "rm1": 0.25, "fn": 2.0}
    combined, raw = combine_rewards(scores, weights, {"rm0": (1.0, 2.0)})
    # rm0 normalized: (1-1)/2 = 0, (2-1)/2 = .5; rm1 and fn as they are.
    assert combined.tolist() == pytest.approx([0.5 * 0 + 0.25 * 3 + 2 * 1, 0.5 * 0.5 + 0.25 * -1 + 0])
    assert raw.tolist() == pytest.approx([0.5 * 1 + 0.25 * 3 + 2 * 1, 0.5 * 2 + 0.25 * -1 + 0])
    combined, raw = combine_rewards({"rm0": torch.tensor([1.5])}, {"rm0": 1.0})  # one RM: itself
    assert combined.tolist() == raw.tolist() == [1.5]


def test_reward_config_weights_and_sources():
    from rlhf.rewards.sources import RewardConfig

    cfg = RewardConfig(reward_pretrain="a,b", reward_fn="m:f", reward_fn_weight=0.5)
    assert cfg.source_weights == {"rm0": 1.0, "rm1": 1.0, "fn": 0.5}  # default: a plain sum
    assert RewardConfig(reward_pretrain="a,b", reward_weights="0.2,0.8").weights == [0.2, 0.8]
    for kw, needle in (({"reward_pretrain": "a,b", "reward_weights": "1"}, "--reward_weights 1: 1 weight(s) for 2"),
                       ({"reward_pretrain": "a", "reward_weights": "x"}, "--reward_weights must be comma-separated"),
                       ({"reward_weights": "1"}, "--reward_weights 1 needs --reward_pretrain"),
                       ({}, "no reward: pass --reward_pretrain (reward models), --reward_fn")):
        with pytest.raises(ValueError, match=None) as e:
            RewardConfig(**kw)
        assert needle in str(e.value), e.value


def test_load_and_call_reward_fn(monkeypatch):
    from rlhf.rewards.sources import call_reward_fn, load_reward_fn

    monkeypatch.syspath_prepend(HERE)
    fn = load_reward_fn("_rule_reward:length_reward")
    assert call_reward_fn(fn, ["p", "p"], ["ab", "x" * 20]).tolist() == pytest.approx([2 / 12, 1.0])
    for spec, needle in (("nosuchmodule:f", "--reward_fn nosuchmodule:f: ModuleNotFoundError"),
                         ("_rule_reward:nope", "AttributeError"), ("_rule_reward:NOT_CALLABLE", "not callable"),
                         ("_rule_reward", "must be module:function")):
        with pytest.raises(ValueError) as e:
            load_reward_fn(spec)
        assert needle in str(e.value), e.value
    with pytest.raises(ValueError, match="--reward_fn: returned 1 values for 2 responses"):
        call_reward_fn(lambda p, r: [0.0], ["a", "b"], ["c", "d"])


@pytest.mark.parametrize("flags,needle", [
    ({"--reward_weights": "0.5"}, "--reward_weights 0.5: 1 weight(s) for 2 reward model(s)"),
    ({"--reward_fn": "nosuchmodule:f"}, "--reward_fn nosuchmodule:f"),
    ({"--reward_pretrain": None, "--reward_fn": "_rule_reward:length_reward"}, "needs --critic_pretrain"),
    ({"--reward_pretrain": None}, "no reward: pass --reward_pretrain (reward models), --reward_fn"),
    ({"--normalize_reward": ""}, "has no reward statistics (rlhf.reward_mean"),
])
def test_ppo_bad_reward_flags(ppo_setup, reward_pair, tmp_path, no_models, capsys, flags, needle):
    from rlhf.ppo import main

    kw = {"--reward_pretrain": ",".join(reward_pair)}
    if "--normalize_reward" in flags:
        kw["--reward_pretrain"] = f"{reward_pair[0]},{ppo_setup['rm']}"  # the second has no saved statistics
    kw.update(flags)
    argv = ppo_args(ppo_setup, str(tmp_path / "o"), **{k: v for k, v in kw.items() if v is not None})
    if kw["--reward_pretrain"] is None:
        i = argv.index("--reward_pretrain")
        del argv[i:i + 2]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error:" in err and needle in err, err
