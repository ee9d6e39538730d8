"""The sandbox's cgroup-v2 backend (rlhf.sandbox.cgroup.V2Cgroup), as far as this machine allows.

These machines mount cgroup v2 beside the v1 hierarchies (``/sys/fs/cgroup/unified``, no controller in it: they are
all bound to v1): there the backend's own mechanics run for real (a run's cgroup made under the folder, joined by the
launcher, its CPU time from ``cpu.stat``, everything killed by ``cgroup.kill``, the missing controllers named and a
run refused for them unless ``allow_weaker``). ``pids.max``, ``memory.max``/``memory.events`` and ``cpu.max`` need a
subtree that has those controllers (a cgroup-v2 host: Debian 12, Ubuntu 22.04 and later): the last test runs them
there and is skipped here, saying so. ``RLHF_TEST_CGROUP_V2`` names another v2 folder to test."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from rlhf.sandbox import SandboxConfig, probe, run_program
from rlhf.sandbox.cgroup import V2Cgroup, v2_available

CANDIDATES = [os.environ.get("RLHF_TEST_CGROUP_V2", ""), "/sys/fs/cgroup", "/sys/fs/cgroup/unified"]
ROOT = next((c for c in CANDIDATES if c and not v2_available(c)), None)
pytestmark = pytest.mark.skipif(ROOT is None, reason="no writable cgroup v2 folder here: "
                                + "; ".join(v2_available(c) for c in CANDIDATES if c))
CONTROLLERS = set(open(os.path.join(ROOT, "cgroup.controllers")).read().split()) if ROOT else set()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_a_v2_cgroup_joins_counts_and_kills_a_whole_tree():
    """A launcher joins the run's cgroup as the sandbox's does (its own pid into cgroup.procs), then forks a tree:
    a spinning child and a double-forked setsid grandchild. The cgroup lists them, counts their CPU time, and
    ``kill_all`` ends every one of them; ``remove`` leaves nothing."""
    cg = V2Cgroup(32, 128 << 20, 1.0, root=ROOT)
    prog = textwrap.dedent("""
        import os, sys, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                t = time.process_time()
                while time.process_time() - t < 0.4:
                    pass
                time.sleep(60)
            os._exit(0)
        print(os.getpid(), flush=True)
        time.sleep(60)
    """)
    launcher = subprocess.Popen(["/bin/sh", "-c", 'echo $$ > "$1" && exec "$2" -c "$3"', "l",
                                 cg.join_paths()[0], sys.executable, prog], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(launcher.stdout.readline())
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (len(cg.pids()) < 2 or cg.cpu_seconds() < 0.3):
            time.sleep(0.05)
        pids = cg.pids()
        assert pid in pids and len(pids) == 2, pids  # the launcher turned python, and the setsid grandchild
        assert cg.cpu_seconds() >= 0.3, cg.cpu_seconds()
        for c in ("pids", "memory", "cpu"):
            assert (c in cg.on) == (c in CONTROLLERS)
            assert any(m.startswith({"pids": "processes", "memory": "memory", "cpu": "cpu rate"}[c])
                       for m in cg.missing) == (c not in CONTROLLERS), (c, cg.missing)
        killed = cg.kill_all()
        assert set(pids) <= set(killed), (pids, killed)
        launcher.wait(timeout=10)
        assert launcher.returncode == -signal.SIGKILL
        assert not [p for p in pids if _alive(p)]
    finally:
        cg.remove()
        launcher.kill()
        launcher.wait()
    assert not os.path.exists(cg.dir)


def test_a_run_on_this_v2_subtree_names_what_it_lacks(monkeypatch):
    """The sandbox pointed at the v2 folder (``RLHF_SANDBOX_CGROUP``): refused while it lacks the pids or memory
    controller, named; with ``allow_weaker`` the run goes on in a v2 cgroup of its own (seen from the host), its
    process bound then the uid's RLIMIT_NPROC, its CPU budget from the v2 cgroup's ``cpu.stat``."""
    import rlhf.sandbox.core as core

    monkeypatch.setenv("RLHF_SANDBOX_CGROUP", ROOT)
    monkeypatch.setattr(core, "_probe_cache", {})
    layers = probe()
    lacking = [c for c in ("pids", "memory") if c not in CONTROLLERS]
    if lacking:
        assert f"lacks the {' and '.join(lacking)} controller" in layers["cgroup"], layers
        r = run_program("print(1)", "", SandboxConfig(timeout_s=20))
        assert r.status == "refused" and "cgroup v2" in r.reason, r
    cfg = SandboxConfig(timeout_s=20, memory_mb=256, max_processes=32, allow_weaker=True)
    r = run_program(textwrap.dedent("""
        import os, time
        print(open("/proc/self/cgroup").read().strip())
        n = 0
        for _ in range(200):
            try:
                if os.fork() == 0:
                    time.sleep(5)
                    os._exit(0)
                n += 1
            except OSError:
                break
        print("children", n)
    """), "", cfg)
    assert r.status == "ok", r
    assert any(x.startswith("cgroup v2(") for x in r.isolation), r.isolation
    n = int(r.stdout.split()[-1])
    assert 28 <= n <= 31, n  # 32 in all, the supervisor and bubblewrap included
    r = run_program("import os\nfor _ in range(6):\n    if os.fork() == 0: break\nwhile True: pass\n", "",
                    SandboxConfig(timeout_s=20, cpu_s=1, allow_weaker=True))
    assert r.status == "timeout" and "CPU budget" in r.reason and r.cpu_s >= 1.0, r


def _needs(controller: str):
    return pytest.mark.skipif(controller not in CONTROLLERS, reason=(
        f"the v2 folder {ROOT} has controllers {sorted(CONTROLLERS)}: this needs {controller} (a cgroup-v2 host)"))


@_needs("pids")
def test_v2_pids_max_holds_the_processes(monkeypatch):
    monkeypatch.setenv("RLHF_SANDBOX_CGROUP", ROOT)
    cfg = SandboxConfig(timeout_s=20, memory_mb=128, max_processes=32, allow_weaker=True)
    r = run_program("import os, time\nn = 0\nfor _ in range(200):\n    try:\n        if os.fork() == 0:\n"
                    "            time.sleep(5); os._exit(0)\n        n += 1\n    except OSError:\n        break\n"
                    "print(n)\n", "", cfg)
    assert "nproc=66" in next(x for x in r.isolation if x.startswith("rlimits")), r.isolation  # looser: pids.max acts
    assert r.status == "ok" and 28 <= int(r.stdout) <= 31, r


@_needs("memory")
def test_v2_memory_max_gives_the_memory_verdict(monkeypatch):
    monkeypatch.setenv("RLHF_SANDBOX_CGROUP", ROOT)
    r = run_program("c = []\nwhile True:\n    c.append(b'x' * (8 << 20))\n", "",
                    SandboxConfig(timeout_s=20, memory_mb=128, allow_weaker=True))
    assert r.status == "memory" and "OOM" in r.reason, r  # memory.events' oom_kill


@_needs("cpu")
def test_v2_cpu_max_caps_the_rate(monkeypatch):
    monkeypatch.setenv("RLHF_SANDBOX_CGROUP", ROOT)
    r = run_program("import os, time\nfor _ in range(2): os.fork()\nt = time.monotonic()\n"
                    "while time.monotonic() - t < 2: pass\n", "",
                    SandboxConfig(timeout_s=20, cpus=0.25, allow_weaker=True))
    assert r.status == "ok" and r.cpu_s <= 0.25 * r.seconds * 1.3 + 0.1, r
