"""MoE routing replay end to end (--moe_router_replay, rlhf.ppo.routing): GRPO on a tiny Mixtral, the megatron
fallback generator recording the experts of every token it feeds (vLLM 0.32 returns routed experts only from its V2
model runner, which needs Triton: not on CPU). R3 with the experts over 2 EP ranks: the generator's routing replayed
in the old-log-prob, the reference and both epochs' update forwards; R2 over 2 pipeline stages with packed
micro-batches and --gradient_checkpointing: each stage records its own layers in the old-log-prob forward, merged,
replayed in the updates and their recomputes; R3 with a two-turn agent (--agent_func_path, DP 2): each trajectory
replays the experts of its last turn's generator call, which fed the first turn and the tool's answer again. The
routing-flip metric logged each step. Both jobs run through
tests/ppo/_routing_worker.py, which watches the actor's routers in every replaying forward: the experts used are the
replayed ones on every token (replayed flips 0), while the router's own choice differs on some (unreplayed flips > 0:
the second epoch's weights moved it), so replay is shown to act, not only to be harmless. Bad input: a dense actor,
and R3 with vLLM on CPU, are refused by name before any model loads."""
import json
import os

import pytest
from helpers import REPO, require, run_torchrun, tail
from ppo_common import ppo_args

PPO = os.path.join(REPO, "launch/ppo.py")


@pytest.mark.parametrize("layout", [{"--ep": 2, "--moe_router_replay": "rollout"},
                                    {"--pp": 2, "--packing_samples": "", "--moe_router_replay": "train",
                                     "--gradient_checkpointing": ""},
                                    {"--moe_router_replay": "rollout", "--agent_func_path": "ENV", "--max_len": "64"}],
                         ids=["ep2_rollout", "pp2_packed_recompute_train", "agent_rollout"])
def test_grpo_with_routing_replay(ppo_setup, family_actors, tmp_path, layout):
    save, dump = str(tmp_path / "out"), tmp_path / "dump"
    dump.mkdir()
    if "--agent_func_path" in layout:  # test_agents.py's tool: a second turn after its answer
        from test_agents import TOOL_ENV

        (tmp_path / "tool_env.py").write_text(TOOL_ENV)
        layout = {**layout, "--agent_func_path": str(tmp_path / "tool_env.py")}
    args = ppo_args({**ppo_setup, "actor": family_actors["mixtral"]}, save,
                    **{"--advantage_estimator": "grpo", **layout, "--rollout_backend": "megatron",
                       "--rollout_batch_size": 4, "--n_samples_per_prompt": 2,
                       "--train_batch_size": 8, "--micro_train_batch_size": 2, "--micro_rollout_batch_size": 2,
                       "--num_episodes": 1, "--max_samples": 4, "--init_kl_coef": 0.05,
                       "--reward_fn": "_rule_reward:length_reward", "--reward_pretrain": None,
                       "--generate_max_len": 4, "--vllm_tensor_parallel_size": 1, "--vllm_kv_cache_mb": None,
                       "--moe_routing_flip_interval": 1})
    p = run_torchrun(os.path.join(os.path.dirname(__file__), "_routing_worker.py"), 2, args, timeout=600,
                     PYTHONPATH=f"{REPO}{os.pathsep}{os.path.dirname(__file__)}", RLHF_TEST_ROUTING_DUMP=str(dump))
    assert p.returncode == 0, tail(p)
    hist = json.load(open(os.path.join(save, "ppo_result.json")))["history"]
    assert len(hist) == 1
    counts = [json.load(open(dump / f"rank{r}.json")) for r in (0, 1)]
    assert all(c["replay_forward"] > 0 and c["replayed_flips"] == 0 for c in counts), counts  # replay used every time
    if "--gradient_checkpointing" in layout:  # the recomputes in the backwards replay too
        assert all(c["replay_backward"] > 0 for c in counts), counts
    assert all(c["ref_replay_routers"] == 0 for c in counts), counts  # the reference routes itself
    # ... where the router would have chosen others: 0 in the forwards at the generator's weights, then nearly every
    # token in the second epoch (one Adam step at lr 1e-2 moves the tiny router's weights by about half their std)
    assert sum(c["unreplayed_flips"] for c in counts) > 0, counts
    for m in hist:
        if "--agent_func_path" in layout:  # every trajectory took both turns: its actions span a tool's answer
            assert m["agent/turns"] == 2.0 and m["agent/failures"] == 0.0 and m["agent/env_tokens_share"] > 0, m
        # the unreplayed forward against the generator's routing: the same megatron numerics in fp32, so no flip
        assert m["moe/routing_flip_tokens"] == 0.0 and m["moe/routing_flip_pairs"] == 0.0, m
        assert m["rollout_logprob_drift_max"] <= 1e-4, m  # old log-probs replayed (R3) or as generated (R2)
        assert m["actor/grad_norm"] > 0, m


def _refused(ppo_setup, tmp_path, capsys, monkeypatch, actor, **flags):
    import rlhf.runtime.role
    from rlhf.ppo import main

    def boom(*a, **k):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(rlhf.runtime.role.ModelRole, "__init__", boom)
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1")):
        monkeypatch.setenv(k, v)
    argv = ppo_args({**ppo_setup, "actor": actor}, str(tmp_path / "o"),
                    **{"--vllm_tensor_parallel_size": 1, "--rollout_batch_size": 4, "--n_samples_per_prompt": 2,
                       "--train_batch_size": 8, "--micro_rollout_batch_size": 4, **flags})
    code = main(argv)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("flags,needle", [
    ({"--moe_router_replay": "R3", "--rollout_backend": "megatron"}, "is not a mixture-of-experts model"),
    ({"--use-routing-replay": "", "--rollout_backend": "megatron"}, "--moe_router_replay train"),
    ({"--moe_router_replay": "sometimes"}, "--moe_router_replay 'sometimes'")], ids=["dense", "slime_r2", "value"])
def test_dense_actor_refused(ppo_setup, tmp_path, capsys, monkeypatch, flags, needle):
    code, err = _refused(ppo_setup, tmp_path, capsys, monkeypatch, ppo_setup["actor"], **flags)
    assert code == 2 and needle in err, err


def test_rollout_replay_with_vllm_on_cpu_refused(ppo_setup, family_actors, tmp_path, capsys, monkeypatch):
    import torch

    require("vllm", "the refusal names vLLM's own limitation")

    if torch.cuda.is_available():
        pytest.skip("vLLM returns routed experts on GPU")
    code, err = _refused(ppo_setup, tmp_path, capsys, monkeypatch, family_actors["mixtral"],
                         **{"--moe_router_replay": "rollout", "--rollout_backend": "vllm"})
    assert code == 2 and "Model Runner V2" in err and "--rollout_backend megatron" in err, err


@pytest.fixture(scope="module")
def eos_mixtral(family_actors, tmp_path_factory):
    """The tiny Mixtral whose config names 25 end-of-sequence tokens (as Llama 3's names several; the megatron
    fallback stops on each): its random replies end at very different lengths, so a partial round stops with
    samples unfinished."""
    import shutil

    d = str(tmp_path_factory.mktemp("eos_mixtral") / "actor")
    shutil.copytree(family_actors["mixtral"], d)
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["eos_token_id"] = [cfg["eos_token_id"]] + list(range(100, 124))
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    return d


@pytest.mark.parametrize("layout", [{"--ep": 2, "--generate_max_len": 12},
                                    {"--agent_func_path": "VARIED", "--max_len": 64, "--generate_max_len": 3}],
                         ids=["ep2", "agent_dp2"])
def test_rollout_replay_with_partial_rollouts(ppo_setup, eos_mixtral, tmp_path, layout):
    """R3 with --partial_rollout (K = 1), the megatron fallback generating over 2 ranks with the experts over EP 2
    (each rank its share of the groups; a rank whose share is whole keeps feeding the EP collectives): samples are
    stopped unfinished and continued a step later. A finished sample carries the routing of the round it finished
    in, every position's (the prefix fed again at that version, as vLLM's prefill of a continued request). For every
    token of a step's own weights, continued samples' included, the replayed old-log-prob forward gives the
    generator's log-prob (drift <= 1e-4: the routing lines up with every token), and where all of a step's tokens
    are fresh the trainer's own routing equals the generator's (no flip); carried tokens reach the update one update
    old. The same with an agent of 1-3 turns over DP 2 (tests/ppo/test_agent_partial.py's environment; the
    generator's batched turns are refused with EP): sessions parked on either rank, a trajectory replaying the
    routing of its last call, which fed every earlier turn again at the weights that sampled its last."""
    save = str(tmp_path / "out")
    if "--agent_func_path" in layout:
        from test_agent_partial import VARIED

        (tmp_path / "varied_env.py").write_text(VARIED.replace("random.randint(1, 5)", "random.randint(1, 3)"))
        layout = {**layout, "--agent_func_path": str(tmp_path / "varied_env.py")}
    args = ppo_args({**ppo_setup, "actor": eos_mixtral}, save,
                    **{"--advantage_estimator": "grpo", **layout, "--moe_router_replay": "rollout",
                       "--rollout_backend": "megatron", "--partial_rollout": "", "--max_staleness": 1,
                       "--partial_rollout_oversample": 1, "--rollout_batch_size": 2, "--n_samples_per_prompt": 2,
                       "--train_batch_size": 4, "--micro_train_batch_size": 2, "--micro_rollout_batch_size": 2,
                       "--num_episodes": 1, "--max_samples": 8, "--actor_learning_rate": "1e-3",
                       "--reward_fn": "_rule_reward:char_code_reward", "--reward_pretrain": None,
                       "--vllm_tensor_parallel_size": 1, "--vllm_kv_cache_mb": None,
                       "--moe_routing_flip_interval": 1})
    p = run_torchrun(PPO, 2, args, timeout=600, PYTHONPATH=f"{REPO}{os.pathsep}{os.path.dirname(__file__)}")
    assert p.returncode == 0, tail(p)
    hist = json.load(open(os.path.join(save, "ppo_result.json")))["history"]
    assert len(hist) == 4, hist
    assert sum(h["partial/aborted_samples"] for h in hist) > 0, hist  # rounds stopped with samples unfinished
    assert all(h["partial/trained_groups"] == 2 for h in hist), hist
    fresh = [h for h in hist if h["partial/tokens_age_1"] == 0]
    stale = [h for h in hist if h["partial/tokens_age_1"] > 0]
    assert fresh and stale, hist
    assert all(h["rollout_logprob_drift_max"] <= 1e-4 for h in fresh), hist
    # every token of this step's weights, continued samples' included (their prefixes fed again and routed anew):
    # the replayed old-log-prob forward gives the generator's log-probs; carried tokens' moved with the update
    # (a step whose trained groups were all whole a step earlier has no such token, and no such metric)
    with_fresh = [h for h in hist if "partial/logprob_drift_fresh_max" in h]
    assert with_fresh and all(h in with_fresh for h in fresh), hist
    assert all(h["partial/logprob_drift_fresh_max"] <= 1e-4 for h in with_fresh), hist
    assert all(h["partial/logprob_drift_carried"] > 1e-3 for h in stale), hist
    # the trainer's own routing equals the generator's for every token of this step's weights; a sample that finished
    # a step earlier carries that step's routing, which the update may have moved (measured: 31% and 11% of tokens
    # flipped at the two steps with carried tokens, AMD EPYC): what replay keeps from the trainer
    assert all(h["moe/routing_flip_tokens"] == 0.0 for h in fresh), hist
