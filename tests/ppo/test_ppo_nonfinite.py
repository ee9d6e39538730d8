"""PPO's non-finite guard: a non-finite reward (here one NaN reply per batch from the reward rule) skips the step's
actor and critic updates; --max_skipped_steps in a row stop the job with one ``error:`` line (exit 3) and nothing
is exported. launch/ppo.py's body (rlhf.ppo.main) in this process, one rank, the megatron generator, GRPO."""
import os

from ppo_common import TINY_GRPO, ppo_args


def test_nan_reward_skips_updates_then_stops(ppo_setup, tmp_path, monkeypatch, capsys):
    from helpers import free_port
    from rlhf.ppo import main

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    out = tmp_path / "o"
    argv = ppo_args(ppo_setup, str(out), **{**TINY_GRPO, "--reward_fn": "_rule_reward:one_nan_reward",
                                            "--rollout_backend": "megatron", "--max_skipped_steps": "2",
                                            "--save_steps": "1"})
    assert main(argv) == 3
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "actor: 2 updates in a row skipped at update 1: non-finite reward=nan" in err[0], err
    # step 1 was skipped and checkpointed (the initial, finite weights); step 2 stopped the job: no export
    assert sorted(d for d in os.listdir(out / "checkpoints") if d.startswith("iter_")) == ["iter_0000001"]
    assert not (out / "config.json").exists()


def test_skipped_step_resyncs_the_sleeping_vllm(ppo_setup, tmp_path):
    """A skipped step leaves the actor unchanged, but vLLM slept after its rollout (CUDA: sleep level 2; CPU: its
    weights freed) and holds no weights: the next step must sync anyway. Without that sync, the second rollout
    generates from freed weights (CPU: an error; CUDA: garbage)."""
    from helpers import REPO, require, run_torchrun, tail

    require("vllm")
    out = tmp_path / "o"
    argv = ppo_args(ppo_setup, str(out), **{**TINY_GRPO, "--reward_fn": "_rule_reward:one_nan_reward",
                                            "--max_skipped_steps": "2"})
    p = run_torchrun(os.path.join(REPO, "launch/ppo.py"), 1, argv, timeout=600,
                     PYTHONPATH=os.path.dirname(os.path.abspath(__file__)) + os.pathsep + REPO)
    # The rank exits 3 (torchrun reports it as a failed child); the second skip needs the second rollout to run.
    assert p.returncode != 0 and "exitcode  : 3" in p.stderr + p.stdout, tail(p)
    assert "actor: 2 updates in a row skipped at update 1: non-finite reward=nan" in p.stderr + p.stdout, tail(p)
