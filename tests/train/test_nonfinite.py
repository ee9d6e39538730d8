"""The non-finite guard: an update whose loss or grad norm is not finite is skipped (parameters, optimizer state
and scheduler untouched) and counted; --max_skipped_steps in a row stop the job with a one-line error; nothing
non-finite is checkpointed or exported. Engine-level checks on one in-process rank, then the real SFT and RM
entry points (rlhf.supervised.loop.main, in this process) at a learning rate that overflows."""
import math
import os

import pytest
import torch


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from helpers import free_port
    from rlhf.distributed import DistEnv, initialize_mesh
    from rlhf.distributed.mesh import destroy_mesh
    from rlhf.runtime.role import ModelRole, OptimConfig
    from rlhf.models.tiny import make_tiny_hf

    work = tmp_path_factory.mktemp("nonfinite")
    make_tiny_hf(str(work / "hf"), "llama", seed=0, num_hidden_layers=2, hidden_size=64)
    mesh = initialize_mesh(1, 1, DistEnv(0, 1, 0, "127.0.0.1", free_port(), "single"))
    eng = ModelRole(mesh, str(work / "hf"), optim=OptimConfig(lr=1e-3, total_steps=10, warmup_ratio=0.0,
                                                                max_skipped_steps=3), name="sft")
    yield eng, mesh, work
    destroy_mesh()


def _batch():
    from rlhf.data import SFTSample, collate_sft

    t = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    return collate_sft([SFTSample(t([5, 6, 7, 2, 9]), torch.tensor([0, 0, 1, 1, 1]).bool(), 2, "a")], 0)


def _snapshot(eng):
    params = {n: p.detach().clone() for n, p in eng.model.named_parameters()}
    from rlhf.compat.megatron import inner_optimizers

    states = {(i, j): {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()}
              for i, inner in enumerate(inner_optimizers(eng.optimizer))
              for j, s in enumerate(inner.optimizer.state.values())}
    assert states  # Adam's moments exist after the first step
    return params, states, eng.steps, eng.optimizer.param_groups[0]["lr"], eng.scheduler.num_steps


def _same(a, b) -> bool:
    pa, sa, *ra = a
    pb, sb, *rb = b
    return (ra == rb and all(torch.equal(pa[n], pb[n]) for n in pa)
            and all(torch.equal(sa[k][n], sb[k][n]) if torch.is_tensor(sa[k][n]) else sa[k][n] == sb[k][n]
                    for k in sa for n in sa[k]))


def test_non_finite_updates_are_skipped_then_stop(engine):
    from rlhf.runtime.role import TrainingDiverged
    from rlhf.supervised.sft import SFTTask

    eng, _, _ = engine
    sft = SFTTask().loss_fn(eng)
    nan_loss = lambda b, logits: sft(b, logits * float("nan"))  # noqa: E731

    def inf_grads(b, logits):  # finite loss, infinite gradients
        logits.register_hook(lambda g: g * float("inf"))
        return sft(b, logits)

    m = eng.train_step([_batch()], sft, ("loss",))  # a real step first: the optimizer has state
    assert m["skipped_steps"] == 0 and eng.steps == 1
    before = _snapshot(eng)
    m = eng.train_step([_batch()], nan_loss, ("loss",))
    assert m["skipped_steps"] == 1 and m["loss"] != m["loss"] and _same(before, _snapshot(eng))
    m = eng.train_step([_batch()], inf_grads, ("loss",))
    # each condition on its own: the skip count, a finite loss, a non-finite (inf or nan) grad norm
    assert m["skipped_steps"] == 2, m
    assert math.isfinite(m["loss"]) and not math.isfinite(m["grad_norm"]), m
    assert _same(before, _snapshot(eng))
    m = eng.train_step([_batch()], sft, ("loss",))  # a finite update applies and resets the run of skips
    assert eng.steps == 2 and eng.consecutive_skips == 0 and m["skipped_steps"] == 2
    assert not torch.equal(before[0]["embedding.word_embeddings.weight"],
                           eng.model.embedding.word_embeddings.weight)
    for _ in range(2):
        eng.train_step([_batch()], nan_loss, ("loss",))
    with pytest.raises(TrainingDiverged, match=r"sft: 3 updates in a row skipped at update 3: non-finite "
                                               r"loss=nan.*--max_skipped_steps 3"):
        eng.train_step([_batch()], nan_loss, ("loss",))


def test_a_step_without_loss_tokens_is_not_a_divergence(engine):
    """Every micro-batch of a step has an empty loss mask (0 / 0): the update is skipped as "no loss token", not
    as a non-finite loss, nothing moves, and --max_skipped_steps in a row stop the job advising to check the data
    (not to lower the learning rate). A micro-batch without loss tokens beside one with some trains normally."""
    from rlhf.data import SFTSample, collate_sft
    from rlhf.runtime.role import TrainingDiverged
    from rlhf.supervised.sft import SFTTask

    eng, _, _ = engine
    sft = SFTTask().loss_fn(eng)
    t = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    empty = collate_sft([SFTSample(t([5, 6, 7]), torch.tensor([0, 0, 0]).bool(), 3, "e")], 0)
    eng.consecutive_skips = 0
    before = _snapshot(eng)
    skipped = eng.skipped_steps
    m = eng.train_step([empty, empty], sft, ("loss",))
    assert m["skipped_steps"] == skipped + 1 and m["grad_norm"] == 0.0 and _same(before, _snapshot(eng))
    m = eng.train_step([empty, _batch()], sft, ("loss",))  # the other micro-batch has loss tokens
    assert math.isfinite(m["loss"]) and m["skipped_steps"] == skipped + 1 and eng.consecutive_skips == 0
    for _ in range(2):
        eng.train_step([empty], sft, ("loss",))
    with pytest.raises(TrainingDiverged, match=r"3 updates in a row skipped at update \d+: no loss token in the "
                                               r"step .*Check the data") as e:
        eng.train_step([empty], sft, ("loss",))
    assert "non-finite loss" not in str(e.value) and "learning rate" not in str(e.value)
    eng.consecutive_skips = 0


def test_non_finite_weights_are_never_saved(engine):
    from rlhf.runtime.checkpoint import Checkpointer
    from rlhf.runtime.role import TrainingDiverged

    eng, mesh, work = engine
    w = eng.model.decoder.final_layernorm.weight
    keep = w.detach().clone()
    with torch.no_grad():
        w[0] = float("nan")
    try:
        with pytest.raises(TrainingDiverged, match=r"non-finite weights \(decoder.final_layernorm.weight\): "
                                                   r"checkpoint of step 7 refused"):
            Checkpointer(mesh, str(work / "ckpts")).save(7, {"sft": eng}, {})
        assert not os.path.exists(work / "ckpts" / "iter_0000007")
    finally:
        with torch.no_grad():
            w.copy_(keep)


@pytest.mark.parametrize("task", ["sft", "rm"])
def test_overflowing_run_stops_with_one_line_and_saves_nothing(train_setup, tmp_path, monkeypatch, capsys, task):
    """The issue's run: a learning rate that overflows. Step 1 is finite; from step 2 the loss is NaN, the updates
    are skipped, and after --max_skipped_steps 2 the entry point returns 3 with one ``error:`` line; no checkpoint
    and no HF model were written."""
    from helpers import free_port
    from rlhf.supervised import rm
    from rlhf.supervised import sft
    from rlhf.distributed.mesh import destroy_mesh
    from rlhf.supervised.loop import main

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    data = ["--dataset", train_setup["sft"], "--input_key", "input", "--output_key", "output"] if task == "sft" \
        else ["--dataset", train_setup["rm"]]
    out = tmp_path / "out"
    argv = ["--pretrain", train_setup["model"], *data, "--save_path", str(out), "--train_batch_size", "8",
            "--micro_train_batch_size", "4", "--max_len", "64", "--learning_rate", "1e30", "--lr_warmup_ratio",
            "0", "--lr_scheduler", "constant", "--max_skipped_steps", "2", "--save_steps", "1", "--max_epochs", "1"]
    try:
        assert main(sft if task == "sft" else rm, argv) == 3
    finally:
        destroy_mesh()
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    # SFT's loss turns NaN; RM's pairwise loss saturates to a finite value while its gradient norm is NaN
    import re

    assert len(err) == 1 and re.search(r"2 updates in a row skipped at update 2: non-finite "
                                       r"(loss=nan|grad_norm=nan)", err[0]), err
    # Loop steps 1 and 2 were checkpointed: step 2's update was skipped, so it holds update 1's finite weights
    # (every save checks). Step 3 stopped the job before its save, and nothing was exported.
    ckpts = sorted(d for d in os.listdir(out / "checkpoints") if d.startswith("iter_"))
    assert ckpts == ["iter_0000001", "iter_0000002"]
    assert not (out / "config.json").exists() and not (out / "megatron").exists()
