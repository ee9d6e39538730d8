"""Rank discovery from torchrun, OpenMPI and Slurm variables, and the layout checks."""
import pytest

from rlhf.distributed.env import DistEnv, first_slurm_host
from rlhf.distributed.mesh import validate_layout


def test_torchrun_vars():
    env = DistEnv.from_environ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.2",
                                "MASTER_PORT": "1234"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port, env.launcher) == \
        (3, 8, 1, "10.0.0.2", 1234, "torchrun")


def test_openmpi_vars():
    env = DistEnv.from_environ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "16",
                                "OMPI_COMM_WORLD_LOCAL_RANK": "5", "MASTER_ADDR": "node1"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port, env.launcher) == \
        (5, 16, 5, "node1", 29500, "openmpi")


def test_slurm_vars_derive_master_from_nodelist_and_port_from_job():
    env = DistEnv.from_environ({"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
                                "SLURM_JOB_NODELIST": "gpu[017-020,031]", "SLURM_JOB_ID": "123456"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.launcher) == \
        (9, 16, 1, "gpu017", "slurm")
    assert env.master_port == 20000 + 123456 % 20000


def test_torchrun_wins_over_slurm():
    env = DistEnv.from_environ({"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "7", "SLURM_NTASKS": "8"})
    assert env.launcher == "torchrun" and env.world_size == 2


def test_single_process_default():
    env = DistEnv.from_environ({})
    assert (env.rank, env.world_size, env.launcher) == (0, 1, "single")


@pytest.mark.parametrize("nodelist,first", [("node1", "node1"), ("a[3-5]", "a3"), ("x[007,009]", "x007"),
                                            ("n[1-2],m[4-5]", "n1"), ("host-a,host-b", "host-a")])
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


@pytest.mark.parametrize("bad", [{"RANK": "4", "WORLD_SIZE": "4"}, {"RANK": "0", "WORLD_SIZE": "2",
                                                                      "MASTER_PORT": "http"}])
def test_bad_env_raises(bad):
    with pytest.raises(ValueError):
        DistEnv.from_environ(bad)


def test_validate_layout():
    assert validate_layout(8, 2, 2) == 2
    with pytest.raises(ValueError, match="--tensor_model_parallel_size 4"):
        validate_layout(6, 4, 1)
    with pytest.raises(ValueError, match="--pipeline_model_parallel_size must be >= 1"):
        validate_layout(4, 1, 0)


def test_free_port_is_below_the_ephemeral_range_and_bindable():
    import socket

    from rlhf.distributed.env import free_port

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(max(1024, low - 12000) <= p < low for p in ports), (ports, low)
    assert len(ports) > 1  # drawn at random, not one fixed port
    with socket.socket() as s:  # free at the time it is returned
        s.bind(("127.0.0.1", ports.pop()))
