"""rlhf.runtime.offload: megatron engines at TP2 survive an offload/onload cycle bit for bit and train on as if nothing
happened (2 gloo ranks, tests/ppo/_offload_worker.py); the phase scheduler keeps the right parts resident."""
import json
import os
import sys

import pytest
import torch
import helpers
from helpers import REPO, free_port

from rlhf.runtime.offload import PHASES, MemoryScheduler, OffloadManager, Residency, plan_residency

WORKER = os.path.join(REPO, "tests/ppo/_offload_worker.py")
_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                  "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="module")
def worker_result(tmp_path_factory):
    from rlhf.models.tiny import make_tiny_hf

    work = tmp_path_factory.mktemp("offload")
    hf = make_tiny_hf(str(work / "hf"), "llama", seed=0, num_hidden_layers=2, hidden_size=64)
    out = str(work / "result.json")
    # A pytest run inside a torchrun/elastic job must not hand its rank to the child job.
    env = {k: v for k, v in helpers.test_env().items() if k not in _LAUNCHER_VARS and not k.startswith("TORCHELASTIC")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), WORKER, hf, out]
    proc = helpers.run_tagged(cmd, 240, full_env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + "\n--- stderr ---\n" + proc.stderr[-5000:]
    with open(out) as f:
        return json.load(f)


CYCLE_CHECKS = ["grads_nonzero_before", "found_optimizer_state", "bytes_on_device_positive", "offload_moves_all",
                "storages_released", "bytes_on_device_zero", "state_off", "offload_idempotent", "onload_idempotent",
                "bit_identical", "grads_zero_after", "no_host_copy_of_grads", "bytes_restored", "partial_state", "partial_bytes", "host_buffers_reused",
                "bit_identical_after_partial"]
TRAIN_CHECKS = ["twins_agree_before", "views_into_param_data", "second_step_metrics_equal",
                "second_step_weights_equal"]


@pytest.mark.parametrize("tag", ["fp32", "bf16_distopt"])
def test_trainable_engine_cycle_is_invisible(worker_result, tag):
    names = [f"{tag}/{c}" for c in CYCLE_CHECKS + TRAIN_CHECKS]
    if tag == "bf16_distopt":
        names.append(f"{tag}/fp32_main_params_moved_with_optimizer")
    missing = [n for n in names if n not in worker_result]
    assert not missing, missing
    failed = {n: worker_result[n] for n in names if worker_result[n]}
    assert not failed, failed


def test_frozen_engine_cycle(worker_result):
    names = [f"frozen/{c}" for c in CYCLE_CHECKS] + ["frozen/forward_equal"]
    failed = {n: worker_result.get(n, "missing") for n in names if worker_result.get(n, "missing")}
    assert not failed, failed


# ------------------------------------------------------------------------------------- phase scheduling, 1 process
ROLES = ("actor", "critic", "ref", "reward")
ALL, NONE, PARAMS = Residency(True, True, True), Residency(False, False, False), Residency(True, False, False)
NO_GRADS = Residency(True, False, True)


def test_plan_no_flags_keeps_everything_but_idle_grads():
    for phase in PHASES:
        assert plan_residency(phase, ROLES) == {r: ALL if phase == f"{r}_update" else NO_GRADS for r in ROLES}


def test_plan_colocate_all():
    plan = {p: plan_residency(p, ROLES, colocate_all=True) for p in PHASES}
    assert plan["rollout"] == {r: NONE for r in ROLES}
    assert plan["make_experience"] == {r: PARAMS for r in ROLES}
    assert plan["actor_update"] == {"actor": ALL, "critic": NONE, "ref": NONE, "reward": NONE}
    assert plan["critic_update"] == {"actor": NONE, "critic": ALL, "ref": NONE, "reward": NONE}
    assert plan["weight_sync"] == {"actor": PARAMS, "critic": NONE, "ref": NONE, "reward": NONE}


def test_plan_ref_reward_and_adam_offload():
    plan = {p: plan_residency(p, ROLES, ref_reward_offload=True, adam_offload=True) for p in PHASES}
    for p in PHASES:
        for r in ("ref", "reward"):
            assert plan[p][r].params == (p == "make_experience"), (p, r)
        for r in ("actor", "critic"):
            assert plan[p][r] == (ALL if p == f"{r}_update" else PARAMS), (p, r)
    with pytest.raises(ValueError, match="phase"):
        plan_residency("generate", ROLES)


def _engine(name: str, trainable: bool, hidden: int = 8):
    """Enough of a ModelRole for OffloadManager: ``model``, and an optimizer whose ``.optimizer`` is torch's."""
    from types import SimpleNamespace

    torch.manual_seed(len(name))
    model = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Linear(hidden, 2))
    eng = SimpleNamespace(name=name, model=model, ddp=None, optimizer=None)
    if trainable:
        eng.optimizer = SimpleNamespace(optimizer=torch.optim.Adam(model.parameters(), lr=1e-2))
        model(torch.randn(4, 8)).sum().backward()
        eng.optimizer.optimizer.step()
    else:
        model.requires_grad_(False)
    return eng


@pytest.mark.parametrize("flags", [dict(colocate_all=True, adam_offload=True),
                                   dict(ref_reward_offload=True, adam_offload=True)])
def test_scheduler_moves_parts_per_phase(flags):
    engines = {r: _engine(r, r in ("actor", "critic")) for r in ROLES}
    snap = {r: [t.clone() for t in e.model.state_dict().values()] for r, e in engines.items()}
    sched = MemoryScheduler({r: OffloadManager(e) for r, e in engines.items()}, **flags)
    for phase in ("rollout", "make_experience", "actor_update", "critic_update", "weight_sync", "make_experience"):
        with sched.phase(phase) as plan:
            for role, m in sched.managers.items():
                want = plan_residency(phase, ROLES, **flags)[role]
                assert plan[role] == want
                assert m.state == {"params": want.params, "grads": want.grads, "optimizer": want.optimizer}
                groups = m.storages()
                for part in ("params", "grads", "optimizer"):
                    live = all(s.nbytes() > 0 for s in groups[part])
                    dead = all(s.nbytes() == 0 for s in groups[part])
                    assert live if getattr(want, part) else dead, (phase, role, part)
                if want.params:
                    got = list(engines[role].model.state_dict().values())
                    assert all(torch.equal(a, b) for a, b in zip(got, snap[role])), (phase, role)
        assert sched.current == phase


def test_scheduler_without_moves_frees_only_grads():
    """The CPU schedule (``move=False``): whatever the flags, params and optimizer states stay where they are and no
    host copy is made; a role's grads are freed outside its own update and come back as zeros."""
    engines = {r: _engine(r, r in ("actor", "critic")) for r in ROLES}
    snap = {r: [t.clone() for t in e.model.state_dict().values()] for r, e in engines.items()}
    opt_snap = {r: [v.clone() for st in e.optimizer.optimizer.state.values() for v in st.values()]
                for r, e in engines.items() if e.optimizer is not None}
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for r in opt_snap for p in engines[r].model.parameters())
    sched = MemoryScheduler({r: OffloadManager(e) for r, e in engines.items()}, colocate_all=True, move=False)
    for phase in ("rollout", "make_experience", "actor_update", "critic_update", "weight_sync"):
        with sched.phase(phase):
            for role, m in sched.managers.items():
                groups = m.storages()
                assert all(s.nbytes() > 0 for part in ("params", "optimizer") for s in groups[part]), (phase, role)
                grads_live = [s.nbytes() > 0 for s in groups["grads"]]
                assert grads_live == [phase == f"{role}_update"] * len(grads_live), (phase, role)
                if phase == f"{role}_update":
                    assert all(torch.equal(p.grad, torch.zeros_like(p.grad)) for p in engines[role].model.parameters())
                assert not m._host, (phase, role)  # nothing was copied
                got = list(engines[role].model.state_dict().values())
                assert all(torch.equal(a, b) for a, b in zip(got, snap[role])), (phase, role)
                if role in opt_snap:
                    now = [v for st in engines[role].optimizer.optimizer.state.values() for v in st.values()]
                    assert all(torch.equal(a, b) for a, b in zip(now, opt_snap[role])), (phase, role)


def test_cpu_schedule_hands_dropped_grads_to_the_next_update():
    """On CPU one role's worth of gradient memory goes round: the grads both roles were built with are dropped on
    entering weight_sync (the loop's first phase) and one role's worth stays parked through rollout and
    make_experience; the critic's grads come back in it, then the actor's (dropped by the critic), then it is parked
    again. Zero-filled each time, the dropping role left with none, nothing else kept."""
    engines = {r: _engine(r, r in ("actor", "critic")) for r in ROLES}
    sched = MemoryScheduler({r: OffloadManager(e) for r, e in engines.items()}, move=False)
    grads = {r: [p.grad for p in engines[r].model.parameters()] for r in ("actor", "critic")}

    def grad_ptrs(role):
        return sorted(s.data_ptr() for s in sched.managers[role].storages()["grads"])

    sched.enter("weight_sync")
    ring = sorted(s.data_ptr() for s in sched.spare)
    assert len(ring) == len(grads["actor"]) and all(s.nbytes() == 0 for g in grads.values() for s in
                                                   (t.untyped_storage() for t in g))
    for step in range(2):
        sched.enter("critic_update")
        assert grad_ptrs("critic") == ring and not sched.spare, step
        assert all(torch.equal(g, torch.zeros_like(g)) for g in grads["critic"])
        for g in grads["critic"]:
            g.fill_(3.0)  # what the critic's update leaves behind
        sched.enter("actor_update")
        assert grad_ptrs("actor") == ring and not sched.spare, step
        assert all(torch.equal(g, torch.zeros_like(g)) for g in grads["actor"])
        assert all(g.untyped_storage().nbytes() == 0 for g in grads["critic"])
        for g in grads["actor"]:
            g.fill_(5.0)
        for phase in ("weight_sync", "rollout", "make_experience"):
            sched.enter(phase)
            assert all(g.untyped_storage().nbytes() == 0 for g in grads["actor"]), phase
            assert sorted(s.data_ptr() for s in sched.spare) == ring, phase  # parked, not freed
    sched.enter("critic_update")
    grads["critic"][0].add_(1.0)  # writable once back
    assert grads["critic"][0].sum().item() == grads["critic"][0].numel()


def test_cpu_schedule_without_keep_parked_frees_between_phase_changes():
    """``keep_parked=False`` (the planner's measurement): the critic's dropped grads still become the actor's within
    one phase change, but nothing stays parked after it."""
    engines = {r: _engine(r, r in ("actor", "critic")) for r in ROLES}
    sched = MemoryScheduler({r: OffloadManager(e) for r, e in engines.items()}, move=False, keep_parked=False)
    sched.enter("critic_update")
    before = sorted(s.data_ptr() for s in sched.managers["critic"].storages()["grads"])
    sched.enter("actor_update")
    assert sorted(s.data_ptr() for s in sched.managers["actor"].storages()["grads"]) == before
    for phase in ("weight_sync", "rollout", "make_experience"):
        sched.enter(phase)
        assert not sched.spare, phase


def test_cpu_schedule_parks_only_what_every_dropped_role_fits():
    """Roles of different sizes keep no gradient memory between phases (the actor's would be held through the
    critic's update for nothing), and a parked storage is kept for a role up to 9/8 of its size."""
    from rlhf.runtime.offload import _park

    engines = {r: _engine(r, r in ("actor", "critic"), hidden=64 if r == "critic" else 8) for r in ROLES}
    sched = MemoryScheduler({r: OffloadManager(e) for r, e in engines.items()}, move=False)
    sched.enter("weight_sync")  # both roles' grads dropped: only what serves both is kept
    assert sorted(s.nbytes() for s in sched.spare) == [8, 256]  # critic: 2048, 256, 512, 8; actor: 256, 32, 64, 8
    sched.enter("critic_update")
    assert all(torch.equal(p.grad, torch.zeros_like(p.grad)) for p in engines["critic"].model.parameters())
    sched.enter("weight_sync")
    # the actor's grads are 256, 32, 64 and 8 bytes: up to 9/8 of one of them is kept while only its are dropped
    sched.managers["critic"].onload(grads=True)
    for offered, kept in (((288, 290, 256, 100), [256]), ((290, 288), [288]), ((290,), []), ((100, 36, 9), [9, 36])):
        sched.spare[:] = [_park(torch.empty(n, dtype=torch.uint8).untyped_storage()) for n in offered]
        sched._keep_one_role()
        assert sorted(s.nbytes() for s in sched.spare) == kept, offered
    sched.managers["critic"].offload(params=False, optimizer=False, grads=True)  # now both roles' are dropped
    sched.spare[:] = [_park(torch.empty(n, dtype=torch.uint8).untyped_storage()) for n in (64, 32, 2048, 288)]
    sched._keep_one_role()
    assert [s.nbytes() for s in sched.spare] == [288]  # 64, 32: the actor's only; 2048: the critic's only


def test_unpark_takes_the_smallest_fit_only():
    from rlhf.runtime.offload import _park, _unpark

    spare = [_park(torch.ones(n, dtype=torch.uint8).untyped_storage()) for n in (100, 130, 108)]
    empty = torch.UntypedStorage(0)
    assert not _unpark(empty, 140, spare) and not _unpark(empty, 60, spare)  # too small; too big (> 9/8 of 60)
    assert _unpark(empty, 104, spare) and empty.nbytes() == 108  # only 108 fits (130 > 9/8 of 104)
    assert torch.equal(torch.empty(0, dtype=torch.uint8).set_(empty), torch.ones(108, dtype=torch.uint8))
    second = torch.UntypedStorage(0)
    assert _unpark(second, 96, spare) and second.nbytes() == 100  # 100 fits; 130 is too big
    assert [p.nbytes() for p in spare] == [130]
