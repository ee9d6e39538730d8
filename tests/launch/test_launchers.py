"""Cluster launch on CPU: mpirun (real OpenMPI) runs the same job as torchrun, bit for bit; Slurm's rank variables
start a job without Slurm; start-up health checks (rendezvous timeout, config consistency) stop every rank with
an error that names the cause; the launcher scripts follow the house rules."""
import json
import os
import re
import shutil
import subprocess
import sys
import uuid

import pytest
import helpers
from helpers import REPO, free_port, run_torchrun, tail

SFT = os.path.join(REPO, "launch/sft.py")
_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
                  "MASTER_PORT")


def clean_env(**extra: str) -> dict:
    """The test environment without any launcher's rank variables (pytest may itself run under one)."""
    env = {k: v for k, v in helpers.test_env().items() if k not in _LAUNCHER_VARS and not k.startswith(
        ("TORCHELASTIC", "OMPI_", "PMIX_", "SLURM_"))}
    env.update(extra)
    return env


def sft_args(setup, save, **extra) -> list[str]:
    args = {"--pretrain": setup["model"], "--dataset": setup["data"], "--save_path": save,
            "--train_batch_size": "16", "--micro_train_batch_size": "4", "--max_len": "32", "--max_epochs": "1",
            "--learning_rate": "1e-3", "--lr_warmup_ratio": "0", "--seed": "7"}
    args.update({k: str(v) for k, v in extra.items()})
    return [x for kv in args.items() for x in kv]


def _missing(msg: str) -> None:
    """Skip on a developer's machine; under CI=true a missing launcher is an install bug that a skip would hide
    (as helpers.require does for packages)."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true: {msg}", pytrace=False)
    pytest.skip(msg)


def ensure_openmpi() -> str:
    """mpirun from OpenMPI; installs Debian's openmpi-bin when missing (root only), else skips saying why (fails
    under CI=true)."""
    def openmpi() -> str | None:
        exe = shutil.which("mpirun")
        if exe is None:
            return None
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
        return exe if "Open MPI" in out.stdout + out.stderr else None

    exe = openmpi()
    if exe:
        return exe
    if shutil.which("mpirun"):
        _missing("the mpirun on PATH is not OpenMPI's (the test needs OMPI_COMM_WORLD_* variables)")
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        _missing("OpenMPI is not installed and cannot be installed here (needs root and apt-get): "
                 "apt-get install openmpi-bin")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", "openmpi-bin"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:  # a stale package index: refresh it once
        subprocess.run(["apt-get", "update"], capture_output=True, text=True, env=env, timeout=900)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    exe = openmpi()
    if exe is None:
        _missing(f"installing openmpi-bin failed: {(proc.stdout + proc.stderr)[-500:]}")
    return exe


@pytest.mark.slow
def test_mpirun_matches_torchrun(sft_setup, tmp_path):
    """The same 4-rank SFT job (TP2 x DP2, 4 steps) under torchrun and under launch/mpirun_sft.sh: every rank's
    weight shards hash the same and the last step's loss / grad-norm are equal to the last bit. The entry point
    is launch/sft.py's trainer with its final checkpoint and HF export replaced by that hash (_sft_digest.py),
    which are deterministic given the shards and cost more than the run on CPU."""
    ensure_openmpi()
    entry = os.path.join(REPO, "tests/launch/_sft_digest.py")
    ref, mpi = str(tmp_path / "torchrun"), str(tmp_path / "mpirun")
    p = run_torchrun(entry, 4, sft_args(sft_setup, ref, **{"--tensor_model_parallel_size": 2}), timeout=300,
                     launcher="torchrun")
    assert p.returncode == 0, tail(p)
    assert "launcher=torchrun" in p.stdout + p.stderr, tail(p)
    mpirun_args = "--bind-to none --oversubscribe" + (" --allow-run-as-root" if os.geteuid() == 0 else "")
    env = clean_env(NP="4", PYTHON=sys.executable, ENTRY=entry, MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
                    MPIRUN_ARGS=mpirun_args)
    q = helpers.run_tagged(["bash", os.path.join(REPO, "launch/mpirun_sft.sh")] +
                           sft_args(sft_setup, mpi, **{"--tensor_model_parallel_size": 2}), 300, full_env=env)
    assert q.returncode == 0, tail(q)
    assert "launcher=openmpi" in q.stdout + q.stderr, tail(q)  # 4 ranks of one job, not 4 single-rank jobs
    da, db = (json.load(open(os.path.join(s, "digest.json"))) for s in (ref, mpi))
    assert len(da) == 4 and da == db, (da, db)
    assert da["0"] == da["2"] and da["0"] != da["1"]  # DP replicas agree; TP ranks hold different shards
    ra, rb = (json.load(open(os.path.join(s, "train_result.json")))["train"] for s in (ref, mpi))
    for key in ("loss", "grad_norm", "lr", "epoch"):
        assert ra[key] == rb[key], (key, ra[key], rb[key])


def _slurm_port_and_job() -> tuple[int, int]:
    """A free port P in [20000, 40000) and the job id J that DistEnv maps to it (P = 20000 + J % 20000). P comes
    from ``free_port``, below the kernel's ephemeral range: a port drawn inside it (as this helper once did, from
    all of [20000, 40000)) can be taken by any outgoing connection before rank 0 binds it, and rank 1 then waits
    on someone else's port until the test's 180 s timeout (seen once in a full run)."""
    port = free_port()
    if not 20000 <= port < 40000:
        raise RuntimeError(f"free_port gave {port}, outside the [20000, 40000) that SLURM_JOB_ID maps to")
    return port, port - 20000 + 20000 * 7


def test_slurm_rank_mapping_and_config_mismatch(sft_setup, tmp_path):
    """Two processes started as srun would start them (SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID, master from
    SLURM_JOB_NODELIST, port from SLURM_JOB_ID; no MASTER_* or RANK) form one job; rank 1 is given a different
    --learning_rate, and both ranks stop with the same error naming that flag and each rank's value."""
    _, job = _slurm_port_and_job()
    worker = os.path.join(REPO, "tests/launch/_skewed_sft.py")
    procs, tag = [], uuid.uuid4().hex
    for rank in range(2):
        env = clean_env(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank),
                        SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID=str(job), RLHF_TEST_SKEW_RANK="1",
                        RLHF_TEST_SKEW_ARGS="--learning_rate 2e-3", **{helpers.JOB_TAG: tag})
        procs.append(subprocess.Popen([sys.executable, worker] + sft_args(sft_setup, str(tmp_path / "o")),
                                      cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True))
    outs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=180)
            outs.append((proc.returncode, out + err))
    finally:  # a timeout, or a rank that left something behind: nothing of the two outlives the test
        left = helpers.leftovers(tag, grace=0 if len(outs) < 2 else 10)
    assert not left, f"processes of the job outlived it: {left}"
    # Rendezvous at localhost:{port} worked from the Slurm variables alone.
    assert "world=2" in outs[0][1] and "launcher=slurm" in outs[0][1], outs[0][1][-3000:]
    for rank, (rc, text) in enumerate(outs):
        errors = [ln for ln in text.splitlines() if ln.startswith("error:")]
        assert rc == 2 and errors, f"rank {rank} rc={rc}\n{text[-3000:]}"
        assert "--learning_rate" in errors[0] and "rank 0 has 0.001" in errors[0] and "rank 1 has 0.002" in errors[0], \
            errors[0]


def test_init_timeout_names_master_address():
    """Nobody at the master address (rank 1 of 2), and a rank 0 whose peer never comes: each rendezvous gives
    up after its 1 s timeout with an error naming MASTER_ADDR and MASTER_PORT."""
    code = ("import sys, time\nfrom rlhf.distributed.env import DistEnv\n"
            "from rlhf.distributed.mesh import init_process_group\n"
            "for rank, port in ((1, int(sys.argv[1])), (0, int(sys.argv[2]))):\n"
            "    t = time.time()\n"
            "    try:\n        init_process_group(DistEnv(rank, 2, 0, '127.0.0.1', port, 'torchrun'), timeout_s=1)\n"
            "    except RuntimeError as e:\n        print('ERR', round(time.time() - t, 1), str(e).splitlines()[0])\n")
    ports = [free_port(), free_port()]
    p = subprocess.run([sys.executable, "-c", code] + [str(x) for x in ports], cwd=REPO, env=clean_env(),
                       capture_output=True, text=True, timeout=60)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("ERR")]
    assert len(lines) == 2, tail(p)
    for (rank, port), line in zip(((1, ports[0]), (0, ports[1])), lines):
        assert f"rank {rank}/2" in line and f"MASTER_ADDR=127.0.0.1 MASTER_PORT={port}" in line, line
        assert float(line.split()[1]) < 10, line


def test_first_difference_and_message():
    from rlhf.distributed.health import first_difference

    same = {"a": "1", "b": "2"}
    assert first_difference([same, dict(same)]) is None
    assert first_difference([same, {"a": "1", "b": "3"}, same]) == ("b", ["2", "3", "2"])
    assert first_difference([same, {"a": "1", "b": "2", "c": "x"}]) == ("c", [None, "x"])


LAUNCHERS = ["launch/slurm/ppo.sbatch", "launch/slurm/sft.sbatch", "launch/slurm/rm.sbatch", "launch/mpirun.sh"]


@pytest.mark.parametrize("path", LAUNCHERS)
def test_launcher_scripts(path):
    """bash -n clean; set -euo pipefail; every default overridable; mpirun forwards every variable it sets."""
    full = os.path.join(REPO, path)
    assert subprocess.run(["bash", "-n", full], capture_output=True).returncode == 0
    text = open(full).read()
    assert "set -euo pipefail" in text
    exports = re.findall(r"^export (\w+)=(.*)$", text, flags=re.M)
    assert any(k == "NCCL_SOCKET_IFNAME" for k, _ in exports) and any(k == "NCCL_IB_HCA" for k, _ in exports)
    for name, value in exports:
        assert value.startswith(f"${{{name}:-"), f"{path}: {name} is not overridable: {value}"
    if "mpirun" in path:
        for name, _ in exports:
            assert f"-x {name}" in text, f"{path}: mpirun does not forward {name} to other nodes"
    entry = "$NAME" if path.endswith("mpirun.sh") else os.path.basename(path).split(".")[0]
    assert f"{entry}.py" in text


@pytest.mark.parametrize("name", ["sft", "rm", "ppo"])
def test_mpirun_wrappers_run_the_one_launcher(name):
    """launch/mpirun_{sft,rm,ppo}.sh (the names users call) hand their flags to launch/mpirun.sh with their entry
    point's name, and nothing else (test_mpirun_matches_torchrun runs one of them end to end)."""
    path = os.path.join(REPO, f"launch/mpirun_{name}.sh")
    assert subprocess.run(["bash", "-n", path], capture_output=True).returncode == 0
    lines = [ln for ln in open(path).read().splitlines() if ln and not ln.startswith("#")]
    assert lines == ["set -euo pipefail", f'exec bash "$(dirname "$0")/mpirun.sh" {name} "$@"'], lines
