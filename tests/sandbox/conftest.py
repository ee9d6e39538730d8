"""Shared by the sandbox's tests: the two ways the suite runs every attack, and the host-side checks after each run.

* ``full``: every layer (the machine's cgroup: v1 here);
* ``weaker``: no cgroup at all (``RLHF_SANDBOX_CGROUP=none``) with ``allow_weaker``, as on a host without a
  writable cgroup: the run's own uid's ``RLIMIT_NPROC``, the address-space rlimit and the sized tmpfs must then
  hold what the cgroup held.

After every run, from the host: no process of the run's uid is alive, no cgroup of this process's runs is left,
nothing of a run's staging folder is left, the host's files are as they were, the test's own process lives."""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import textwrap

import pytest

from rlhf.sandbox import SandboxConfig, probe, run_batch, run_program
from rlhf.sandbox.uids import processes_of

# The wall-clock limit counts the sandboxed interpreter's start too: runs expected to end "ok" took 0.1-2.7 s in the
# suite on the 2-core AMD EPYC (cold page cache, the other worker busy) and one took 3.2 s. 20 s leaves them room;
# the tests whose verdict is the timeout set their own limit (1-2 s).
CFG = SandboxConfig(timeout_s=20.0, memory_mb=256, max_processes=32, max_output_bytes=64 << 10, max_file_mb=8)
MODES = ("full", "weaker")


def require_layers() -> None:
    missing = {k: v for k, v in probe().items() if v}
    if missing:
        msg = "sandbox layers missing: " + "; ".join(f"{k}: {v}" for k, v in missing.items())
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true: {msg} (tools/setup_env.sh installs bubblewrap)", pytrace=False)
        pytest.skip(msg)


def run_uid(result) -> int | None:
    m = re.search(r"uid\(host uid (\d+)", " ".join(result.isolation))
    return int(m.group(1)) if m else None


def my_cgroups() -> list[str]:
    """Cgroups of runs this process started still on the host (v1 hierarchies, a v2 mount or folder)."""
    import glob

    pattern = f"rlhf-sandbox/{os.getpid()}-*"
    return glob.glob(f"/sys/fs/cgroup/*/{pattern}") + glob.glob(f"/sys/fs/cgroup/{pattern}")


def tree_digest(path: str) -> str:
    h = hashlib.sha256()
    for root, dirs, files in sorted(os.walk(path)):
        dirs.sort()
        for name in sorted(files):
            p = os.path.join(root, name)
            h.update(p.encode())
            st = os.stat(p)
            h.update(f"{st.st_size}:{st.st_mode}".encode())
            h.update(open(p, "rb").read())
    return h.hexdigest()


@pytest.fixture(params=MODES)
def mode(request, monkeypatch) -> str:
    if request.param == "weaker":
        monkeypatch.setenv("RLHF_SANDBOX_CGROUP", "none")
    require_layers() if request.param == "full" else _require_weaker()
    return request.param


def _require_weaker() -> None:
    missing = {k: v for k, v in probe().items() if v and k != "cgroup"}
    if missing:
        require_layers()


@pytest.fixture()
def host(tmp_path, monkeypatch, request):
    """A planted secret beside 'the data', a watched folder, a secret in this process's environment, a sleeping
    process of the test's own; after the run: nothing of the run alive, all of these as they were. ``host["run"]``
    runs a program in the test's mode (``mode`` fixture, else full) and remembers the run's uid."""
    weaker = "mode" in request.fixturenames and request.getfixturevalue("mode") == "weaker"
    if "mode" not in request.fixturenames:
        require_layers()
    data = tmp_path / "data"
    data.mkdir()
    (data / "prompts.jsonl").write_text('{"prompt": "x"}\n')
    (data / "secret.txt").write_text("TOP-SECRET-7d3f")
    monkeypatch.setenv("RLHF_TEST_SECRET", "ENV-SECRET-91ab")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    before = tree_digest(str(data))
    uids: list[int] = []

    def run(src: str, stdin: str = "", **kw):
        r = run_program(textwrap.dedent(src), stdin, SandboxConfig(**{**CFG.__dict__, "allow_weaker": weaker, **kw}))
        if run_uid(r) is not None:
            uids.append(run_uid(r))
        return r

    def batch(runs, **kw):
        rs = run_batch(runs, SandboxConfig(**{**CFG.__dict__, "allow_weaker": weaker, **kw}))
        uids.extend(u for u in map(run_uid, rs) if u is not None)
        return rs

    state = {"tmp": tmp_path, "data": data, "secret": str(data / "secret.txt"), "sleeper": sleeper, "run": run,
             "batch": batch, "uids": uids, "weaker": weaker}
    yield state
    try:
        for uid in uids:
            assert processes_of(uid) == [], f"a process of the run's uid {uid} outlived it"
        assert my_cgroups() == [], "a run's cgroup was left"
        assert sleeper.poll() is None, "the sandbox killed a process of the host"
        assert tree_digest(str(data)) == before, "the host's files changed"
        assert os.path.exists(state["secret"]) and open(state["secret"]).read() == "TOP-SECRET-7d3f"
        assert not [d for d in os.listdir("/tmp") if d.startswith(f"rlhf-sbx-{os.getpid()}-")], \
            "a run's staging folder was left"
    finally:
        sleeper.kill()
        sleeper.wait()
