"""Hostile programs in the sandbox (rlhf.sandbox): each asserts its verdict and that the host is untouched. After
every run no process of it is alive (no process is left in any rlhf-sandbox cgroup, none of the test's own
processes was touched), and the host's files are as they were (a planted secret, a watched folder). The fork and
thread bombs run only where the cgroup layer holds them (a fork bomb without a pids limit takes the whole machine):
every layer is required here, and missing ones fail under CI=true (skip elsewhere)."""
from __future__ import annotations

import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from rlhf.sandbox import SandboxConfig, probe, run_program

MISSING = {k: v for k, v in probe().items() if v}
if MISSING:
    msg = "sandbox layers missing: " + "; ".join(f"{k}: {v}" for k, v in MISSING.items())
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true: {msg} (tools/setup_env.sh installs bubblewrap)", pytrace=False)
    pytest.skip(msg, allow_module_level=True)

# The wall-clock limit counts the sandboxed interpreter's start too: runs expected to end "ok" took 0.1-2.7 s in the
# suite on the 2-core AMD EPYC (cold page cache, the other worker busy) and one took 3.2 s, past the 3 s limit this had.
# 20 s leaves them room; the tests whose verdict is the timeout set their own limit (1-2 s).
CFG = SandboxConfig(timeout_s=20.0, memory_mb=256, max_processes=32, max_output_bytes=64 << 10, max_file_mb=8)


def sandbox_processes() -> list[int]:
    """Every process in a cgroup of a run this process started (``rlhf-sandbox/<our pid>-<id>``; none may outlive
    its run). Runs of other processes are not ours to judge: the other pytest worker may be in the middle of one."""
    out, mine = [], f"rlhf-sandbox/{os.getpid()}-"
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if mine in open(f"/proc/{pid}/cgroup").read():
                    out.append(int(pid))
            except OSError:
                pass
    return out


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


@pytest.fixture()
def host(tmp_path, monkeypatch):
    """A planted secret beside 'the data', a watched folder, a secret in this process's environment, a sleeping
    process of the test's own; after the run: nothing of the run alive, all of these as they were."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "prompts.jsonl").write_text('{"prompt": "x"}\n')
    (data / "secret.txt").write_text("TOP-SECRET-7d3f")
    monkeypatch.setenv("RLHF_TEST_SECRET", "ENV-SECRET-91ab")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    before = tree_digest(str(data))
    state = {"tmp": tmp_path, "data": data, "secret": str(data / "secret.txt"), "sleeper": sleeper}
    yield state
    try:
        assert sandbox_processes() == [], "a process of the run outlived it"
        assert sleeper.poll() is None, "the sandbox killed a process of the host"
        assert tree_digest(str(data)) == before, "the host's files changed"
        assert os.path.exists(state["secret"]) and open(state["secret"]).read() == "TOP-SECRET-7d3f"
        assert not [d for d in os.listdir("/tmp") if d.startswith(f"rlhf-sbx-{os.getpid()}-")], \
            "a run's staging folder was left"
    finally:
        sleeper.kill()
        sleeper.wait()


def run(src: str, stdin: str = "", **kw):
    return run_program(textwrap.dedent(src), stdin, SandboxConfig(**{**CFG.__dict__, **kw}))


def test_a_plain_program_runs_with_every_layer(host):
    r = run("import sys; print('sum', sum(map(int, sys.stdin.read().split())))", "1 2 3")
    assert r.status == "ok" and r.exit_code == 0 and r.stdout == "sum 6\n", r
    assert [x.split("(")[0] for x in r.isolation] == ["namespaces", "seccomp", "rlimits", "cgroup"], r.isolation


def test_no_network_not_even_the_hosts_loopback(host):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(0.2)
    port = srv.getsockname()[1]
    r = run(f"""
        import socket
        try:
            socket.create_connection(("127.0.0.1", {port}), timeout=2)
            print("CONNECTED")
        except OSError as e:
            print("blocked", e.errno)
        ifaces = [ln.split(":")[0].strip() for ln in open("/proc/net/dev").read().splitlines()[2:]]
        print("interfaces", ifaces)  # a network namespace of its own: loopback alone (seccomp denies AF_INET too)
    """)
    try:
        srv.accept()
        accepted = True
    except socket.timeout:
        accepted = False
    srv.close()
    assert r.status == "ok" and "blocked" in r.stdout and not accepted, r
    assert r.stdout.splitlines()[-1] == "interfaces ['lo']", r.stdout


def test_no_raw_or_inet_sockets(host):
    r = run("""
        import socket
        for fam, typ in ((socket.AF_INET, socket.SOCK_STREAM), (socket.AF_INET6, socket.SOCK_DGRAM),
                         (socket.AF_PACKET, socket.SOCK_RAW), (socket.AF_NETLINK, socket.SOCK_RAW)):
            try:
                socket.socket(fam, typ); print("OPENED", fam)
            except OSError as e:
                print("denied", e.errno)
    """)
    assert r.status == "ok" and "OPENED" not in r.stdout and r.stdout.count("denied 1") == 4, r  # EPERM


def test_writes_outside_the_working_folder_fail_or_vanish(host):
    r = run(f"""
        import os
        for path in ({str(host['tmp'] / 'pwned.txt')!r}, "/usr/pwned", "/pwned", {host['secret']!r}):
            try:
                open(path, "w").write("pwned"); print("wrote", path)
            except OSError as e:
                print("denied", path, e.errno)
        open("ok.txt", "w").write("mine")  # its own folder is writable
        print("own", open("ok.txt").read())
    """)
    assert r.status == "ok" and "own mine" in r.stdout, r
    assert not (host["tmp"] / "pwned.txt").exists()  # the host's folders are not even there


def test_the_planted_secret_and_the_trainers_files_are_not_readable(host):
    r = run(f"""
        import os
        for path in ({host['secret']!r}, {str(host['data'] / 'prompts.jsonl')!r}, "/work/main/README.md",
                     "/root/.bashrc", "/etc/passwd"):
            try:
                print("READ:", path, open(path).read()[:20])
            except OSError as e:
                print("missing", path)
        hits = []
        for root, dirs, files in os.walk("/"):  # all but the system's read-only /usr and Python install
            if root.startswith(("/proc", "/sys", "/dev", "/usr", {os.path.realpath(sys.base_prefix)!r})):
                dirs[:] = []
                continue
            for f in files:
                try:
                    if "TOP-" + "SECRET" in open(os.path.join(root, f), errors="ignore").read(1 << 16):
                        hits.append(os.path.join(root, f))
                except OSError:
                    pass
        print("hits", hits, "walked", sorted(os.listdir("/")))
    """, timeout_s=20)
    assert r.status == "ok" and "READ:" not in r.stdout and "hits []" in r.stdout, r


def test_the_prompts_hidden_tests_are_not_in_the_sandbox(host):
    """The code reward keeps stdin/stdout and call tests' expected outputs outside: a program that searches the
    whole file system and its own process for them finds nothing and scores 0."""
    import json

    from rlhf.sandbox.code_reward import CodeRewardConfig, grade

    label = json.dumps({"inputs": ["2\n"], "outputs": ["EXPECTED-ANSWER-4417\n"]})
    hostile = textwrap.dedent("""
        import os, sys
        found = []
        for root, dirs, files in os.walk("/"):
            if root.startswith(("/proc", "/sys", "/dev", "/usr", {prefix!r})):
                dirs[:] = []
                continue
            for f in files:
                try:
                    if "EXPECTED-" + "ANSWER" in open(os.path.join(root, f), errors="ignore").read():
                        found.append(f)
                except OSError:
                    pass
        print(found, sys.stdin.read())
    """).replace("{prefix!r}", repr(os.path.realpath(sys.base_prefix)))
    rewards, verdicts = grade([hostile], [label], CodeRewardConfig(code_timeout_s=20))
    assert rewards == [0.0] and verdicts == [["wrong_answer"]], verdicts


def test_fork_bomb_is_held_by_the_pids_limit(host):
    r = run("""
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """, timeout_s=2)
    assert r.status == "timeout", r


def test_thread_bomb_is_held_by_the_pids_limit(host):
    r = run("""
        import threading, time
        n = 0
        while True:
            try:
                threading.Thread(target=time.sleep, args=(60,), daemon=True).start(); n += 1
            except RuntimeError:
                print("stopped at", n); break
    """)
    assert r.status == "ok" and int(r.stdout.split()[-1]) < 32, r


def test_allocating_20_gb_is_a_memory_verdict(host):
    r = run("x = bytearray(20 << 30)\nprint('ALLOCATED')")
    assert r.status == "memory" and "ALLOCATED" not in r.stdout, r


def test_touching_memory_past_the_cgroup_limit_is_killed(host):
    r = run("""
        chunks = []
        while True:
            chunks.append(bytearray(16 << 20))  # touched: the cgroup charges the pages
    """, memory_mb=128)
    assert r.status == "memory", r


def test_infinite_loop_times_out(host):
    t0 = time.monotonic()
    r = run("while True: pass", timeout_s=1.5)
    assert r.status == "timeout" and time.monotonic() - t0 < 10, r


def test_sleeping_past_the_limit_times_out_and_prints_nothing_after(host):
    r = run("import time\nprint('start', flush=True)\ntime.sleep(30)\nprint('LATE')", timeout_s=1)
    assert r.status == "timeout" and r.stdout == "start\n", r


def test_a_double_forked_child_does_not_outlive_the_run(host):
    marker = host["tmp"] / "late.txt"
    r = run(f"""
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                time.sleep(1.5)
                try:
                    open({str(marker)!r}, "w").write("alive")
                except OSError:
                    pass
                open("/sandbox/late", "w")
                time.sleep(60)
            os._exit(0)
        print("parent done")
    """)
    assert r.status == "ok", r
    time.sleep(2)
    assert not marker.exists() and sandbox_processes() == []


def test_killing_the_parent_and_signalling_other_processes_fails(host):
    pids = [os.getpid(), host["sleeper"].pid, os.getppid()]
    r = run(f"""
        import os, signal
        for pid in {pids} + [1]:
            try:
                os.kill(pid, signal.SIGKILL); print("killed?", pid)
            except OSError as e:
                print("no", pid, e.errno)
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError as e:
            print("no -1", e.errno)
        print("still here")
    """)
    assert host["sleeper"].poll() is None  # the host's process lives
    assert r.status in ("ok", "error"), r  # kill(-1) may end the run itself; never anything outside


def test_printing_a_gigabyte_is_cut(host):
    r = run("import sys\nblock = 'x' * (1 << 20)\nfor _ in range(1024): sys.stdout.write(block)")
    assert r.status == "output_limit" and len(r.stdout) == CFG.max_output_bytes and r.stdout_cut > 0, \
        (r.status, len(r.stdout), r.stdout_cut)


def test_writing_a_10_gb_file_fails_and_the_host_disk_is_untouched(host):
    free = shutil.disk_usage("/tmp").free
    r = run("""
        block = b'x' * (1 << 20)
        with open('big.bin', 'wb') as f:
            for _ in range(10 << 10):
                f.write(block)
        print('WROTE')
    """)
    assert r.status == "error" and "WROTE" not in r.stdout, r
    assert shutil.disk_usage("/tmp").free > free - (64 << 20)


def test_locking_the_working_folder_does_not_break_cleanup(host):
    r = run("""
        import os
        os.makedirs('a/b', exist_ok=True)
        open('a/b/f', 'w').write('x')
        os.chmod('a/b', 0); os.chmod('a', 0); os.chmod('.', 0)
        print('locked')
    """)
    assert r.status == "ok" and "locked" in r.stdout, r  # the fixture checks nothing was left behind


def test_raw_system_calls_through_ctypes_are_denied(host):
    r = run("""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        calls = {"unshare": (272, 0x10000000), "mount": (165, 0, 0, 0, 0, 0), "ptrace": (101, 16, 1, 0, 0),
                 "setns": (308, 0, 0), "bpf": (321, 0, 0, 0), "init_module": (175, 0, 0, 0),
                 "keyctl": (250, 0, 0), "chroot": (161, 0), "perf_event_open": (298, 0, 0, 0, 0, 0)}
        for name, (nr, *args) in calls.items():
            rc = libc.syscall(nr, *args)
            print(name, rc, ctypes.get_errno())
        print("clone-newuser", libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0), ctypes.get_errno())
    """)
    lines = dict(ln.split(" ", 1) for ln in r.stdout.splitlines())
    assert r.status == "ok" and len(lines) == 10, r
    assert all(v == "-1 1" for v in lines.values()), lines  # every one: -1, EPERM


def test_proc_shows_only_the_sandbox(host):
    r = run("""
        import os
        pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
        print('pids', pids)
        for path in ('/proc/1/environ', '/proc/self/environ'):
            try:
                print(path, open(path, 'rb').read())
            except OSError as e:
                print(path, 'denied', e.errno)
        try:
            print('root', os.listdir('/proc/1/root'))
        except OSError as e:
            print('root denied', e.errno)
    """)
    assert r.status == "ok", r
    pids = eval(r.stdout.splitlines()[0].split(" ", 1)[1])
    assert len(pids) <= 3, pids  # bubblewrap's init, the program (and its copy step, gone by now)
    assert "ENV-SECRET" not in r.stdout and "RLHF_TEST" not in r.stdout and "/work" not in r.stdout, r.stdout


def test_the_trainers_environment_is_not_inherited(host):
    r = run("import os; print(sorted(os.environ.items()))")
    assert r.status == "ok" and "ENV-SECRET" not in r.stdout, r
    assert eval(r.stdout) == [("HOME", "/sandbox"), ("LANG", "C.UTF-8"), ("PATH", "/usr/bin:/bin"), ("PWD", "/sandbox")]


def test_runs_as_an_unprivileged_user_without_capabilities(host):
    r = run("""
        import os
        print(os.getuid(), os.getgid())
        print([ln for ln in open('/proc/self/status') if ln.startswith(('CapEff', 'NoNewPrivs', 'Seccomp:'))])
    """)
    assert r.status == "ok" and r.stdout.startswith("65534 65534"), r
    assert "CapEff:\\t0000000000000000" in r.stdout and "NoNewPrivs:\\t1" in r.stdout and "Seccomp:\\t2" in r.stdout, \
        r.stdout


def test_nested_namespaces_are_refused(host):
    r = run("""
        import subprocess
        try:
            print(subprocess.run(['/usr/bin/unshare', '-r', 'id'], capture_output=True, text=True).returncode)
        except OSError as e:
            print('no unshare', e.errno)
    """)
    assert r.status == "ok" and r.stdout.strip() != "0", r


def test_a_missing_layer_is_refused_loudly_unless_weaker_is_allowed(host, monkeypatch):
    import rlhf.sandbox.core as core

    monkeypatch.setattr(core, "probe", lambda: {"namespaces": "", "seccomp": "", "cgroup": "no cgroups here",
                                                "rlimits": ""})
    r = run("print('x')")
    assert r.status == "refused" and "cgroup: no cgroups here" in r.reason and r.exit_code is None, r
    r = run("print('x')", allow_weaker=True)
    assert r.status == "ok" and not any(x.startswith("cgroup") for x in r.isolation), r


def test_the_command_line_prints_one_json_line(host, tmp_path):
    import json

    prog, stdin = tmp_path / "p.py", tmp_path / "in.txt"
    prog.write_text("print(input()[::-1])")
    stdin.write_text("abc\n")
    p = subprocess.run([sys.executable, "-m", "rlhf.sandbox", "--program", str(prog), "--stdin", str(stdin),
                        "--timeout_s", "5", "--memory_mb", "128"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(
                           os.path.abspath(__file__))))})
    assert p.returncode == 0 and len(p.stdout.splitlines()) == 1, p.stderr
    r = json.loads(p.stdout)
    assert {k: r[k] for k in ("status", "exit_code", "stdout")} == {"status": "ok", "exit_code": 0, "stdout": "cba\n"}
    assert set(r) >= {"stderr", "seconds", "isolation", "stdout_cut", "stderr_cut"}
    p = subprocess.run([sys.executable, "-m", "rlhf.sandbox", "--program", str(prog), "--timeout_s", "0"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--timeout_s must be > 0" in p.stderr, p.stderr
