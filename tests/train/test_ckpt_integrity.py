"""Checkpoint integrity: a damaged latest checkpoint (truncated file, missing file, changed small file, garbage
``latest``) falls back to the newest intact one with a warning; a save that fails (a full disk) leaves the
previous checkpoint as ``latest``. One in-process rank on gloo, a tiny real engine (model + Adam)."""
import errno
import logging
import os

import pytest
import torch


@pytest.fixture(scope="module")
def ckpt_run(tmp_path_factory):
    """Checkpoints at steps 1 and 2 of an engine whose weights change between them; their weights."""
    from helpers import free_port
    from rlhf.runtime.checkpoint import Checkpointer
    from rlhf.distributed import DistEnv, initialize_mesh
    from rlhf.distributed.mesh import destroy_mesh
    from rlhf.runtime.role import ModelRole, OptimConfig
    from rlhf.models.tiny import make_tiny_hf

    work = tmp_path_factory.mktemp("ckpt")
    make_tiny_hf(str(work / "hf"), "llama", seed=0, num_hidden_layers=2, hidden_size=64)
    mesh = initialize_mesh(1, 1, DistEnv(0, 1, 0, "127.0.0.1", free_port(), "single"))
    eng = ModelRole(mesh, str(work / "hf"), optim=OptimConfig(lr=1e-3, total_steps=4, warmup_ratio=0.0),
                      name="sft")
    ckpt = Checkpointer(mesh, str(work / "ckpts"), max_ckpt_num=3)
    from rlhf.data import SFTSample, collate_sft
    from rlhf.supervised.sft import SFTTask

    t = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    mb = collate_sft([SFTSample(t([5, 6, 7, 2, 9]), torch.tensor([0, 0, 1, 1, 1]).bool(), 2, "a")], 0)
    import psutil

    earlier_children = {c.pid for c in psutil.Process().children(recursive=True)}  # from tests run before
    weights = {}
    for step in (1, 2):  # real Adam steps: the optimizer's state exists and is saved
        eng.train_step([mb], SFTTask().loss_fn(eng), ("loss",))
        ckpt.save(step, {"sft": eng}, {"marker": step})
        weights[step] = {n: p.detach().clone() for n, p in eng.model.named_parameters()}
    yield {"mesh": mesh, "eng": eng, "ckpt": ckpt, "path": str(work / "ckpts"), "weights": weights,
           "earlier_children": earlier_children}
    destroy_mesh()


def _load(run, expect_step: int) -> None:
    state = run["ckpt"].load({"sft": run["eng"]})
    assert state["step"] == expect_step and state["extra"]["marker"] == expect_step
    for n, p in run["eng"].model.named_parameters():
        assert torch.equal(p, run["weights"][expect_step][n]), n


def _biggest(folder: str) -> str:
    files = [os.path.join(r, f) for r, _, fs in os.walk(folder) for f in fs]
    return max(files, key=os.path.getsize)


def test_manifest_lists_every_file(ckpt_run):
    import json

    folder = os.path.join(ckpt_run["path"], "iter_0000002")
    with open(os.path.join(folder, "manifest.json")) as f:
        files = json.load(f)["files"]
    on_disk = {os.path.relpath(os.path.join(r, n), folder) for r, _, ns in os.walk(folder) for n in ns}
    assert set(files) == on_disk - {"manifest.json"}
    assert files["trainer.json"]["sha256"] and any(k.startswith("state/") for k in files)
    _load(ckpt_run, 2)


def test_roles_are_saved_one_at_a_time_and_the_older_layout_loads(ckpt_run):
    """Each role is its own dist checkpoint under state/<role>/ (so a role's distributed-optimizer gather is freed
    before the next role's); a checkpoint written before that, every role in state/ itself, still resumes."""
    import shutil

    from rlhf.runtime.checkpoint import write_ckpt_manifest

    path = ckpt_run["path"]
    folder = os.path.join(path, "iter_0000002")
    assert os.listdir(os.path.join(folder, "state")) == ["sft"]
    backup = os.path.join(path, "backup")
    shutil.copytree(folder, backup)
    try:  # the older layout: what state/sft/ holds, in state/ (one save of {"sft": ...} wrote the same keys)
        inner = os.path.join(folder, "state", "sft")
        for name in os.listdir(inner):
            os.replace(os.path.join(inner, name), os.path.join(folder, "state", name))
        os.rmdir(inner)
        write_ckpt_manifest(folder)
        with torch.no_grad():  # so only a real load can bring step 2's weights back
            for prm in ckpt_run["eng"].model.parameters():
                prm.add_(1.0)
        _load(ckpt_run, 2)
    finally:
        shutil.rmtree(folder)
        os.replace(backup, folder)


@pytest.mark.parametrize("damage", ["truncated", "missing", "changed", "garbage_latest"])
def test_damaged_latest_falls_back_with_a_warning(ckpt_run, damage, caplog):
    from rlhf.runtime.checkpoint import verify_ckpt

    path = ckpt_run["path"]
    folder = os.path.join(path, "iter_0000002")
    backup = os.path.join(path, "backup")
    import shutil

    shutil.copytree(folder, backup)
    shutil.copy(os.path.join(path, "latest"), os.path.join(path, "latest.bak"))
    try:
        if damage == "truncated":
            victim = _biggest(os.path.join(folder, "state"))
            with open(victim, "r+b") as f:
                f.truncate(os.path.getsize(victim) // 2)
        elif damage == "missing":
            os.remove(_biggest(os.path.join(folder, "state")))
        elif damage == "changed":  # same size, other bytes
            with open(os.path.join(folder, "trainer.json"), "r+b") as f:
                first = f.read(1)
                f.seek(0)
                f.write(b" " if first != b" " else b"\n")
        else:
            with open(os.path.join(path, "latest"), "wb") as f:
                f.write(b"\x00\xffnot a checkpoint")
        problem = verify_ckpt(folder)
        assert (problem is None) == (damage == "garbage_latest"), problem
        with caplog.at_level(logging.WARNING, logger="rlhf.runtime.checkpoint"):
            expect = 2 if damage == "garbage_latest" else 1
            assert ckpt_run["ckpt"].resolve() == os.path.join(path, f"iter_000000{expect}")
            _load(ckpt_run, expect)
        text = caplog.text
        if damage == "garbage_latest":
            assert "latest is missing or names no checkpoint folder" in text
        else:
            assert "iter_0000002 is damaged" in text and "resuming from" in text
            assert {"truncated": "bytes", "missing": "missing file", "changed": "checksum"}[damage] in text
    finally:
        shutil.rmtree(folder)
        os.replace(backup, folder)
        os.replace(os.path.join(path, "latest.bak"), os.path.join(path, "latest"))


def test_nothing_intact_is_a_clear_error(ckpt_run, tmp_path):
    from rlhf.runtime.checkpoint import Checkpointer

    empty = Checkpointer(ckpt_run["mesh"], str(tmp_path / "none"))
    with pytest.raises(ValueError, match=r"--load_checkpoint: no intact checkpoint under --ckpt_path"):
        empty.load({"sft": ckpt_run["eng"]})
    # --load_checkpoint's own path: nothing published yet (no folder; or only a killed first save's .tmp) is a
    # fresh start, a damaged checkpoint is not
    assert empty.load_if_any({"sft": ckpt_run["eng"]}) is None
    os.makedirs(tmp_path / "none" / "iter_0000001.tmp")
    assert empty.load_if_any({"sft": ckpt_run["eng"]}) is None
    os.makedirs(tmp_path / "bad" / "iter_0000005")
    with pytest.raises(ValueError, match=r"iter_0000005: no manifest.json or trainer.json"):
        Checkpointer(ckpt_run["mesh"], str(tmp_path / "bad")).resolve()
    with pytest.raises(ValueError, match=r"iter_0000005: no manifest.json or trainer.json"):
        Checkpointer(ckpt_run["mesh"], str(tmp_path / "bad")).load_if_any({"sft": ckpt_run["eng"]})


def test_a_failed_save_keeps_the_previous_checkpoint(ckpt_run, monkeypatch):
    """A full disk during a save: the error surfaces, nothing is published, `latest` still names step 2, its
    temporary folder is gone, and the previous checkpoint still loads."""
    import rlhf.runtime.checkpoint as ck

    real_save = torch.save

    def full_disk(obj, path, *a, **k):
        if str(path).endswith(".pt") and "iter_0000003.tmp" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, path, *a, **k)

    monkeypatch.setattr(ck.torch, "save", full_disk)
    with pytest.raises(OSError, match="No space left"):
        ckpt_run["ckpt"].save(3, {"sft": ckpt_run["eng"]}, {"marker": 3})
    monkeypatch.undo()
    path = ckpt_run["path"]
    assert sorted(d for d in os.listdir(path) if d.startswith("iter_")) == ["iter_0000001", "iter_0000002"]
    with open(os.path.join(path, "latest")) as f:
        assert f.read().strip() == "iter_0000002"
    _load(ckpt_run, 2)


def test_saves_leave_no_helper_process(ckpt_run):
    """megatron-core's save would start a spawned multiprocessing.Manager (an interpreter per rank, alive until the
    job ends) for a queue only an asynchronous save needs; our synchronous saves use a local one."""
    import psutil

    helpers_left = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)
                    if p.pid not in ckpt_run["earlier_children"] and "multiprocessing" in " ".join(p.cmdline())]
    assert not helpers_left, helpers_left


def test_the_first_save_size_is_estimated_before_writing(ckpt_run):
    """Before the first checkpoint the free-space check uses the engines' bytes: within 25% of what was written."""
    from rlhf.runtime.checkpoint import saved_bytes
    from rlhf.models.checkpoint_io import folder_bytes

    written = folder_bytes(os.path.join(ckpt_run["path"], "iter_0000001"))
    estimate = saved_bytes({"sft": ckpt_run["eng"]}, ckpt_run["mesh"])
    assert 0.75 * written < estimate < 1.25 * written, (estimate, written)


def test_a_save_that_cannot_fit_writes_nothing(ckpt_run, monkeypatch):
    """Too little free space for the newest checkpoint's size: a clear ENOSPC error naming --ckpt_path and the
    sizes before anything is written; `latest` still names step 2."""
    import collections
    import shutil

    from rlhf.models.checkpoint_io import folder_bytes

    path = ckpt_run["path"]
    need = folder_bytes(os.path.join(path, "iter_0000002"))
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 * need, 9 * need, need - 1))
    with pytest.raises(OSError, match=r"checkpoint of step 3: --ckpt_path .* MB free and needs about 1.6 MB") as err:
        ckpt_run["ckpt"].save(3, {"sft": ckpt_run["eng"]}, {"marker": 3})
    assert err.value.errno == errno.ENOSPC
    assert sorted(os.listdir(path)) == ["iter_0000001", "iter_0000002", "latest"]
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 * need, 9 * need, need))  # just fits: saves
    ckpt_run["ckpt"].save(3, {"sft": ckpt_run["eng"]}, {"marker": 3})
    with open(os.path.join(path, "latest")) as f:
        assert f.read().strip() == "iter_0000003"


def test_an_export_that_cannot_fit_writes_nothing(ckpt_run, tmp_path, monkeypatch):
    """The HF export (a megatron copy plus the HF files) checks --save_path's free space before writing."""
    import argparse
    import collections
    import shutil

    from rlhf.runtime.checkpoint import export_hf

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(2 ** 40, 2 ** 40, 2 ** 10))
    args = argparse.Namespace(save_path=str(tmp_path / "out"), pretrain=None)
    need = 2 * 4 * sum(p.numel() for p in ckpt_run["eng"].model.parameters())  # fp32, megatron copy + HF files
    with pytest.raises(OSError, match=rf"HF export: --save_path .* 0.0 MB free and needs about {need / 1e6:.1f} MB"):
        export_hf(args, ckpt_run["eng"], ckpt_run["mesh"], {})
    assert os.listdir(tmp_path / "out") == []


@pytest.mark.parametrize("dp,ep,cp,expected", [(4, 2, 1, (400 / 4 + 240 / 2) * 3 + 4 / 4 + 4 / 2),
                                                (2, 1, 1, (400 + 240) * 3 / 2 + 4 / 2 + 4 / 2),
                                                (2, 1, 2, (400 + 240) * 3 / 4 + 4 / 4 + 4 / 4)])
def test_the_estimate_counts_each_replica_group_once(ckpt_run, dp, ep, cp, expected):
    """By hand, one rank's share: a dense fp32 weight of 100 is replicated dp times (dp x cp: context parallelism
    does not shard parameters), an expert weight of 60 (megatron marks it allreduce=False under EP > 1) dp/ep
    times; Adam's exp_avg, exp_avg_sq and step are replicated like their parameter (no ZeRO-1 here). One
    process, so the sum over ranks is this rank's share."""
    from types import SimpleNamespace

    from rlhf.runtime.checkpoint import saved_bytes

    model = torch.nn.Module()
    model.dense, model.expert = torch.nn.Parameter(torch.zeros(100)), torch.nn.Parameter(torch.zeros(60))
    model.expert.allreduce = ep == 1  # as megatron sets it
    opt = torch.optim.Adam(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # creates the states
    engines = {"moe": SimpleNamespace(model=model, optimizer=opt)}
    assert saved_bytes(engines, SimpleNamespace(dp=dp, ep=ep, cp=cp)) == pytest.approx(expected)
