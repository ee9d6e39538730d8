"""Hostile programs in the sandbox (rlhf.sandbox), each judged from the host: its verdict, and what it could do to
the host (tests/sandbox/conftest.py checks after every run that nothing of it is alive, no cgroup or staging folder
is left, the host's files and processes are as they were). Every attack runs twice (``mode``): with every layer,
and with no cgroup under ``allow_weaker``. Each layer has a test that fails when that layer alone is removed: the
planted bugs in tests/mutants/sandbox.py name them. The fork and thread bombs run only where a process bound holds
them: a fork bomb without one takes the whole machine."""
from __future__ import annotations

import ctypes
import errno
import json
import os
import pwd
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from rlhf.sandbox import Run, SandboxConfig, run_program
from rlhf.sandbox.uids import uid_range
from helpers import descendants
from tests.sandbox.conftest import CFG, run_uid

PREFIX = os.path.realpath(sys.base_prefix)


def lines(r) -> dict[str, str]:
    return dict(ln.split(" ", 1) for ln in r.stdout.splitlines() if " " in ln)


# ------------------------------------------------------------------------------------------- what runs at all
def test_a_plain_program_runs_with_every_layer(mode, host):
    r = host["run"]("import sys; print('sum', sum(map(int, sys.stdin.read().split())))", "1 2 3")
    assert r.status == "ok" and r.exit_code == 0 and r.stdout == "sum 6\n", r
    names = [x.split("(")[0] for x in r.isolation]
    if mode == "full":
        assert names[:4] == ["namespaces", "uid", "seccomp", "rlimits"] and names[4].startswith("cgroup v"), names
        assert not [x for x in r.isolation if x.startswith("missing")], r.isolation
    else:  # the bounds the cgroup held are named missing, the ones left named with their values
        assert names[:4] == ["namespaces", "uid", "seccomp", "rlimits"] and names[4] == "no cgroup", names
        assert "missing: processes (rlimit only)" in r.isolation and \
            "missing: memory (address space per process only)" in r.isolation, r.isolation
        assert "nproc=34 for the uid" in r.isolation[3] and "as=256MB" in r.isolation[3], r.isolation


def test_no_network_not_even_the_hosts_loopback(mode, host):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(0.2)
    port = srv.getsockname()[1]
    r = host["run"](f"""
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


def test_sockets_are_an_allow_list_compared_on_the_kernels_32_bits(mode, host):
    """Only AF_UNIX opens: AF_VSOCK (not network-namespaced: this machine is a VM with /dev/vsock), AF_ALG (the 2026
    page-cache write's entry point), the rest, and a family with garbage in the register's upper half (the kernel
    reads 32 bits, a filter sees 64) all fail with EPERM."""
    r = host["run"]("""
        import ctypes, errno, socket
        libc = ctypes.CDLL(None, use_errno=True)
        families = {"inet": 2, "inet6": 10, "packet": 17, "netlink": 16, "vsock": 40, "alg": 38, "bluetooth": 31,
                    "xdp": 44, "future": 46, "inet+hi": 2 | (1 << 32), "vsock+hi": 40 | (0xdead << 32),
                    "alg+hi": 38 | (1 << 63)}
        for name, fam in families.items():
            fd = libc.syscall(41, ctypes.c_long(fam), ctypes.c_long(1), ctypes.c_long(0))  # socket(2)
            print(name, "OPENED" if fd >= 0 else errno.errorcode[ctypes.get_errno()])
            sv = (ctypes.c_int * 2)()
            rc = libc.syscall(53, ctypes.c_long(fam), ctypes.c_long(1), ctypes.c_long(0), sv)  # socketpair(2)
            print(name + "-pair", "OPENED" if rc == 0 else errno.errorcode[ctypes.get_errno()])
        a, b = socket.socketpair()
        a.sendall(b"hi")
        print("unix", b.recv(2).decode(), socket.socket(socket.AF_UNIX).family == socket.AF_UNIX)
        print("unix+hi", "OPENED" if libc.syscall(41, ctypes.c_long(1 | (1 << 40)), 1, 0) >= 0 else "denied")
    """)
    got = lines(r)
    assert r.status == "ok" and got.pop("unix") == "hi True", r
    assert got.pop("unix+hi") == "OPENED", got  # what the kernel reads as AF_UNIX is AF_UNIX
    assert len(got) == 24 and set(got.values()) == {"EPERM"}, got


def test_no_host_kernel_knob_or_proc_entry_opens_for_writing(mode, host):
    """Every regular file under /proc (its sysctls included) but the program's own process folders is opened for
    writing (nothing written): none may open. core_pattern fails with EROFS: the read-only mount refuses it before
    the file's owner is asked (the uid layer's own refusal is tested below)."""
    r = host["run"]("""
        import errno, os
        tried, opened, errs = 0, [], {}
        own = {str(os.getpid()), "self", "thread-self"}
        for root, dirs, files in os.walk("/proc"):
            if root == "/proc":
                dirs[:] = [d for d in dirs if not d.isdigit() or d == "1"]
            if "/task/" in root or root.endswith("/task"):
                dirs[:] = []
            for f in files:
                p = os.path.join(root, f)
                if os.path.islink(p):
                    continue
                tried += 1
                try:
                    os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY))
                    opened.append(p)
                except OSError as e:
                    errs[errno.errorcode.get(e.errno, e.errno)] = errs.get(errno.errorcode.get(e.errno), 0) + 1
        print("tried", tried)
        print("opened", opened[:20])
        try:
            open("/proc/sys/kernel/core_pattern", "w")
            print("core_pattern OPENED")
        except OSError as e:
            print("core_pattern", errno.errorcode[e.errno])
    """)
    got = lines(r)
    assert r.status == "ok" and int(got["tried"]) > 500, r  # /proc/sys alone has over a thousand here
    assert got["opened"] == "[]", got["opened"]
    assert got["core_pattern"] == "EROFS", got


def test_every_mount_but_the_scratch_folders_is_read_only(mode, host):
    """From the program's own mount table: / (the sandbox's root), /usr, the Python install, /proc, /proc/sys, /dev,
    each host device node and the folder of its files read-only; writable only the sized tmpfs (/sandbox, /tmp,
    /dev/shm) and /dev/pts (a devpts instance of its own)."""
    r = host["run"]("""
        mounts = {}
        for ln in open("/proc/self/mountinfo"):
            f = ln.split()
            mounts[f[4]] = "ro" if "ro" in f[5].split(",") else "rw"
        print(sorted(mounts.items()))
    """)
    assert r.status == "ok", r
    mounts = dict(eval(r.stdout))
    rw = {m for m, v in mounts.items() if v == "rw"}
    assert rw == {"/sandbox", "/tmp", "/dev/shm", "/dev/pts"}, mounts
    for m in ("/", "/usr", PREFIX, "/proc", "/proc/sys", "/dev", "/dev/null", "/dev/urandom", "/.in"):
        assert mounts.get(m) == "ro", (m, mounts)


def test_writes_to_the_hosts_files_devices_and_proc_modes_are_absent_on_the_host(mode, host):
    watched = ["/dev/null", "/dev/urandom", "/dev/zero", "/proc/sys/kernel/core_pattern", "/proc/kallsyms",
               "/proc/sys/vm/drop_caches", "/usr/bin", PREFIX]
    before = {p: (os.stat(p).st_mode, os.stat(p).st_uid) for p in watched}
    targets = [os.path.join(d, "rlhf-pwned") for d in ("/usr", "/usr/lib", PREFIX, os.path.join(PREFIX, "lib"))]
    r = host["run"](f"""
        import os
        for p in {targets!r} + ["/rlhf-pwned", "/dev/rlhf-pwned", "/proc/rlhf-pwned"]:
            try:
                open(p, "w").write("x"); print("WROTE", p)
            except OSError as e:
                print("no", p)
        for p in {watched!r}:
            for how in ("chmod", "chown"):
                try:
                    os.chmod(p, 0o777) if how == "chmod" else os.chown(p, 65534, 65534)
                    print("CHANGED", how, p)
                except OSError as e:
                    print("no", how, p)
    """)
    assert r.status == "ok" and "WROTE" not in r.stdout and "CHANGED" not in r.stdout, r
    assert {p: (os.stat(p).st_mode, os.stat(p).st_uid) for p in watched} == before
    assert not any(os.path.exists(t) for t in targets + ["/rlhf-pwned"])


def test_the_programs_run_as_a_host_uid_of_their_own_in_the_runs_cgroup(mode, host):
    """Seen from the host while the program sleeps: every process of the run (the launcher turned bubblewrap, the
    supervisor, the program) has the run's uid as real, effective and saved uid (none is root), a uid of the range
    that the host's passwd does not know; with a cgroup every one is in the run's cgroup (each controller); the
    program has no capability, no new privileges and the filter."""
    seen: dict[int, dict] = {}
    done = threading.Event()

    def watch():
        while not done.is_set():
            for pid in descendants(os.getpid()):
                try:
                    cmd = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
                    if "bwrap" in cmd.split("\x00")[0] or "python" in cmd.split("\x00")[0] and "-I\x00-S" in cmd:
                        seen[pid] = {"status": open(f"/proc/{pid}/status").read(), "cmd": cmd,
                                     "cgroup": open(f"/proc/{pid}/cgroup").read()}
                except OSError:
                    pass
            time.sleep(0.05)

    t = threading.Thread(target=watch)
    t.start()
    try:
        r = host["run"]("import time\ntime.sleep(2)\nprint('done')")
    finally:
        done.set()
        t.join()
    assert r.status == "ok", r
    uid = run_uid(r)
    base, count = uid_range()
    assert base <= uid < base + count
    with pytest.raises(KeyError):
        pwd.getpwuid(uid)
    ours = seen
    for v in ours.values():
        argv = v["cmd"].split("\x00")
        v["kind"] = "bwrap" if "bwrap" in argv[0] else "supervisor" if "-c" in argv else "program"
    kinds = sorted(v["kind"] for v in ours.values())
    assert kinds == ["bwrap", "program", "supervisor"], {p: v["cmd"][:80] for p, v in seen.items()}
    for pid, v in ours.items():
        uids = next(ln for ln in v["status"].splitlines() if ln.startswith("Uid:")).split()[1:]
        assert set(uids) == {str(uid)}, (pid, v["cmd"][:60], uids)
        if mode == "full":
            cg = dict(ln.split(":", 2)[1:] for ln in v["cgroup"].splitlines())
            for controller in ("pids", "memory"):
                assert f"/rlhf-sandbox/{os.getpid()}-" in cg[controller], (pid, v["cmd"][:60], cg)
    program = [v for v in ours.values() if v["kind"] == "program"]
    assert len(program) == 1, ours
    status = dict(ln.split(":\t", 1) for ln in program[0]["status"].splitlines() if ":\t" in ln)
    assert status["CapEff"] == status["CapPrm"] == status["CapBnd"] == "0000000000000000"
    assert status["NoNewPrivs"] == "1" and status["Seccomp"] == "2", status


def test_root_only_files_are_closed_to_the_program(mode, host):
    """The owner check refuses the program (it is not root on the host): /proc/kmsg (root's, 0400) fails with
    EACCES, where a program running as host root without capabilities would get EPERM from the capability check
    after the owner's check passed."""
    r = host["run"]("""
        import errno
        try:
            open("/proc/kmsg", "rb"); print("kmsg OPENED")
        except OSError as e:
            print("kmsg", errno.errorcode[e.errno])
    """)
    assert r.status == "ok" and lines(r)["kmsg"] == "EACCES", r


# -------------------------------------------------------------------------------------- files and secrets
def test_writes_outside_the_working_folder_fail_or_vanish(mode, host):
    r = host["run"](f"""
        import os
        for path in ({str(host['tmp'] / 'pwned.txt')!r}, "/usr/pwned", "/pwned", {host['secret']!r}):
            try:
                open(path, "w").write("pwned"); print("wrote", path)
            except OSError as e:
                print("denied", path, e.errno)
        open("ok.txt", "w").write("mine")  # its own folder is writable
        print("own", open("ok.txt").read())
    """)
    assert r.status == "ok" and "own mine" in r.stdout and "wrote" not in r.stdout, r
    assert not (host["tmp"] / "pwned.txt").exists()  # the host's folders are not even there


def test_the_planted_secret_and_the_trainers_files_are_not_readable(mode, host):
    r = host["run"](f"""
        import os
        for path in ({host['secret']!r}, {str(host['data'] / 'prompts.jsonl')!r}, "/work/main/README.md",
                     "/root/.bashrc", "/etc/passwd"):
            try:
                print("READ:", path, open(path).read()[:20])
            except OSError as e:
                print("missing", path)
        hits = []
        for root, dirs, files in os.walk("/"):  # all but the system's read-only /usr and Python install
            if root.startswith(("/proc", "/sys", "/dev", "/usr", {PREFIX!r})):
                dirs[:] = []
                continue
            for f in files:
                try:
                    if "TOP-" + "SECRET" in open(os.path.join(root, f), errors="ignore").read(1 << 16):
                        hits.append(os.path.join(root, f))
                except OSError:
                    pass
        print("hits", hits, "walked", sorted(os.listdir("/")))
    """)
    assert r.status == "ok" and "READ:" not in r.stdout and "hits []" in r.stdout, r


def test_the_prompts_hidden_tests_are_not_in_the_sandbox(mode, host):
    """The code reward keeps stdin/stdout and call tests' expected outputs outside: a program that searches the
    whole file system and its own process for them finds nothing and scores 0."""
    from rlhf.sandbox.code_reward import CodeRewardConfig, grade

    label = json.dumps({"inputs": ["2\n", "3\n"], "outputs": ["EXPECTED-ANSWER-4417\n", "EXPECTED-ANSWER-5\n"]})
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
    """).replace("{prefix!r}", repr(PREFIX))
    rewards, verdicts = grade([hostile], [label], CodeRewardConfig(code_timeout_s=20,
                                                                   code_allow_weaker=host["weaker"]))
    assert rewards == [0.0] and verdicts == [["wrong_answer", "wrong_answer"]], verdicts


# ---------------------------------------------------------------------------------------- processes, memory
def test_fork_bomb_is_held(mode, host):
    r = host["run"]("""
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """, timeout_s=2)
    assert r.status == "timeout", r


def test_the_process_limit_holds(mode, host):
    """A bounded attempt (it stops at 200, so a missing bound fails the test and spares the machine): at most
    ``max_processes`` processes and threads in all. With a cgroup its ``pids.max`` acts (the uid's RLIMIT_NPROC is
    set looser, at twice the limit); without one, RLIMIT_NPROC on the run's own uid."""
    r = host["run"]("""
        import os, time
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
    """)
    assert r.status == "ok", r
    n = int(lines(r)["children"])
    assert CFG.max_processes - 4 <= n <= CFG.max_processes - 1, n  # the supervisor and bubblewrap count too


def test_thread_bomb_is_held(mode, host):
    r = host["run"]("""
        import threading, time
        n = 0
        while True:
            try:
                threading.Thread(target=time.sleep, args=(60,), daemon=True).start(); n += 1
            except RuntimeError:
                print("stopped at", n); break
    """)
    assert r.status == "ok" and int(r.stdout.split()[-1]) < CFG.max_processes, r


def test_allocating_20_gb_fails_and_is_no_memory_verdict(mode, host):
    """The address-space rlimit refuses it at once; the program's MemoryError is its own error (a memory verdict
    comes only from the cgroup's OOM kills)."""
    r = host["run"]("x = bytearray(20 << 30)\nprint('ALLOCATED')")
    assert r.status == "error" and "MemoryError" in r.stderr and "ALLOCATED" not in r.stdout, r


def test_resident_memory_past_the_cgroup_limit_is_an_oom_kill(host):
    """Touched pages, under an address-space limit looser than the cgroup's: the cgroup's limit acts (the program
    gets close to it), its OOM kill gives the verdict."""
    r = host["run"]("""
        import sys
        chunks = []
        while True:
            chunks.append(b"x" * (8 << 20))  # touched: the cgroup charges the pages
            print(len(chunks) * 8, flush=True)
    """, memory_mb=128)
    assert r.status == "memory" and r.exit_code == -signal.SIGKILL, r
    assert "as=768MB" in next(x for x in r.isolation if x.startswith("rlimits")), r.isolation
    assert int(r.stdout.split()[-1]) >= 64, r.stdout[-200:]  # it got half way at least: no rlimit stopped it


def test_memory_without_a_cgroup_is_held_by_the_address_space_limit(monkeypatch, host):
    monkeypatch.setenv("RLHF_SANDBOX_CGROUP", "none")
    r = run_program("chunks = []\nwhile True:\n    chunks.append(b'x' * (8 << 20))\n",
                    "", SandboxConfig(**{**CFG.__dict__, "memory_mb": 128, "allow_weaker": True}))
    host["uids"].append(run_uid(r))
    assert r.status == "error" and "MemoryError" in r.stderr, r
    assert "missing: memory (address space per process only)" in r.isolation, r.isolation


def test_memory_no_bound_sees_is_denied(mode, host):
    """memfd and System V segments hold memory outside any address space (a segment outlives its process): denied."""
    r = host["run"]("""
        import ctypes, errno, os
        libc = ctypes.CDLL(None, use_errno=True)
        for name, nr, args in (("memfd_create", 319, (b"x", 0)), ("shmget", 29, (0, 1 << 30, 0o1600)),
                               ("msgget", 68, (0, 0o1600))):
            rc = libc.syscall(nr, *args)
            print(name, rc if rc >= 0 else errno.errorcode[ctypes.get_errno()])
    """)
    assert r.status == "ok" and lines(r) == {"memfd_create": "EPERM", "shmget": "EPERM", "msgget": "EPERM"}, r


def test_the_scratch_folders_are_sized(mode, host):
    """/sandbox, /tmp and /dev/shm are tmpfs of ``max_file_mb`` each (8 MB here): files under the file-size limit
    fill one only that far."""
    r = host["run"]("""
        import errno
        for d in ("/sandbox", "/tmp", "/dev/shm"):
            total = 0
            try:
                for i in range(4):
                    with open(f"{d}/f{i}", "wb") as f:
                        for _ in range(6):
                            f.write(b"x" * (1 << 20))
                            f.flush()
                            total += 1
            except OSError as e:
                print(d, total, errno.errorcode[e.errno])
            else:
                print(d, total, "ALL")
    """)
    assert r.status == "ok", r
    for d in ("/sandbox", "/tmp", "/dev/shm"):
        mb, how = lines(r)[d].split()
        assert how == "ENOSPC" and 6 <= int(mb) <= 8, (d, mb, how)


# --------------------------------------------------------------------------------------------------- time
def test_infinite_loop_times_out(mode, host):
    t0 = time.monotonic()
    r = host["run"]("while True: pass", timeout_s=1.5)
    assert r.status == "timeout" and time.monotonic() - t0 < 10, r


def test_sleeping_past_the_limit_times_out_and_prints_nothing_after(mode, host):
    r = host["run"]("import time\nprint('start', flush=True)\ntime.sleep(30)\nprint('LATE')", timeout_s=1)
    assert r.status == "timeout" and r.stdout == "start\n" and "wall-clock" in r.reason, r


def test_the_cpu_time_limit_is_a_timeout_by_sigxcpu(mode, host):
    """A process's CPU-time rlimit has its soft limit below the hard one: SIGXCPU ends it, reported as a timeout
    with its reason (a soft limit equal to the hard one would send SIGKILL, which says nothing)."""
    r = host["run"]("while True: pass", timeout_s=20, cpu_s=1)
    assert r.status == "timeout" and r.exit_code == -signal.SIGXCPU and "CPU-time limit" in r.reason, r


def test_the_cpu_budget_holds_many_processes_together(mode, host):
    """Eight spinning processes, a budget of 1 CPU second for all of them: stopped long before the wall limit."""
    t0 = time.monotonic()
    r = host["run"]("""
        import os
        for _ in range(8):
            if os.fork() == 0:
                break
        while True:
            pass
    """, timeout_s=20, cpu_s=1)
    assert r.status == "timeout" and "CPU budget" in r.reason and time.monotonic() - t0 < 10, r
    assert 1.0 <= r.cpu_s < 4.0, r


def test_the_cpu_rate_is_capped(host):
    """Four processes spinning for 2 s of wall time under a quarter of a core: the cgroup's CPU time stays near a
    quarter of the wall time (unbounded, four processes on two cores get 4 s)."""
    r = host["run"]("""
        import os, time
        for _ in range(4):
            if os.fork() == 0:
                t = time.monotonic()
                while time.monotonic() - t < 2:
                    pass
                os._exit(0)
        for _ in range(4):
            os.wait()
    """, cpus=0.25)
    assert r.status == "ok", r
    assert r.cpu_s <= 0.25 * r.seconds * 1.3 + 0.1, (r.cpu_s, r.seconds)


# -------------------------------------------------------------------------------------- the run's processes
def test_a_double_forked_child_does_not_outlive_the_run(mode, host):
    marker = host["tmp"] / "late.txt"
    r = host["run"](f"""
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
    assert not marker.exists()


def test_killing_the_parent_and_signalling_other_processes_fails(mode, host):
    pids = [os.getpid(), host["sleeper"].pid, os.getppid()]
    r = host["run"](f"""
        import os, signal
        for pid in {pids} + [1]:
            try:
                os.kill(pid, signal.SIGKILL); print("sent", pid)
            except OSError as e:
                print("no", pid, e.errno)
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError as e:
            print("no -1", e.errno)
        print("still here")
    """)
    assert host["sleeper"].poll() is None  # the host's process lives
    assert r.status in ("ok", "error"), r  # kill(-1) may end the program itself; never anything outside


def test_the_supervisor_cannot_be_killed_read_or_forged_and_nothing_survives_a_program(mode, host):
    """A batch of two, as for a reply's tests: the first tries to kill the sandbox's first process (the supervisor),
    to open its pipes and memory through /proc, to forge a result frame on it, and leaves a daemon, files in /tmp,
    /dev/shm and a locked folder; the second finds only itself and the supervisor, and clean folders."""
    first = textwrap.dedent("""
        import errno, marshal, os, signal, time
        for sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGSEGV):
            os.kill(1, sig)
        for p in ("/proc/1/fd/1", "/proc/1/fd/0", "/proc/1/mem", "/proc/1/environ"):
            try:
                f = os.open(p, os.O_WRONLY)
                frame = marshal.dumps({"ev": "end", "i": 1, "code": 0, "sig": None, "why": "", "out": b"FORGED",
                                       "err": b"", "out_cut": 0, "err_cut": 0, "wall": 0.0}, 4)
                os.write(f, len(frame).to_bytes(4, "big") + frame)
                print("OPENED", p)
            except OSError as e:
                print("no", p, errno.errorcode[e.errno])
        open("/tmp/left", "w").write("x")
        open("/dev/shm/left", "w").write("x")
        os.makedirs("locked/in", exist_ok=True)
        os.chmod("locked", 0)
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                while True:
                    open("/tmp/daemon", "w").write(str(time.time()))
                    time.sleep(0.05)
            os._exit(0)
        time.sleep(0.3)
        print("first done")
    """)
    second = textwrap.dedent("""
        import os
        print("pids", sorted(int(p) for p in os.listdir("/proc") if p.isdigit()), os.getpid())
        print("tmp", os.listdir("/tmp"), os.listdir("/dev/shm"), sorted(os.listdir(".")))
    """)
    r1, r2 = host["batch"]([Run(first), Run(second)])
    assert r1.status == "ok" and "OPENED" not in r1.stdout and "first done" in r1.stdout, r1
    assert r2.status == "ok" and "FORGED" not in r2.stdout, r2
    pids_line, tmp_line = r2.stdout.splitlines()
    assert pids_line == f"pids [1, {pids_line.split()[-1]}] {pids_line.split()[-1]}", r2.stdout
    assert tmp_line == "tmp [] [] ['main.py']", r2.stdout


def test_a_batch_gives_each_program_its_own_verdict(mode, host):
    runs = [Run("print(input())", "a"), Run("import sys; sys.exit(3)"), Run("import time; time.sleep(30)"),
            Run("print('x' * (1 << 20))"), Run("print(input()[::-1])", "abc")]
    rs = host["batch"](runs, timeout_s=2)
    assert [(r.status, r.stdout[:4]) for r in rs] == [
        ("ok", "a\n"), ("error", ""), ("timeout", ""), ("output_limit", "x" * 4), ("ok", "cba\n")], rs
    assert rs[1].exit_code == 3 and rs[2].exit_code is None


def test_printing_a_gigabyte_is_cut(mode, host):
    r = host["run"]("import sys\nblock = 'x' * (1 << 20)\nfor _ in range(1024): sys.stdout.write(block)")
    assert r.status == "output_limit" and len(r.stdout) == CFG.max_output_bytes and r.stdout_cut > 0, \
        (r.status, len(r.stdout), r.stdout_cut)


def test_writing_a_10_gb_file_fails_and_the_host_disk_is_untouched(mode, host):
    import shutil

    free = shutil.disk_usage("/tmp").free
    r = host["run"]("""
        block = b'x' * (1 << 20)
        with open('big.bin', 'wb') as f:
            for _ in range(10 << 10):
                f.write(block)
        print('WROTE')
    """)
    assert r.status == "error" and "WROTE" not in r.stdout, r
    assert shutil.disk_usage("/tmp").free > free - (64 << 20)


def test_locking_the_working_folder_does_not_break_cleanup(mode, host):
    r = host["run"]("""
        import os
        os.makedirs('a/b', exist_ok=True)
        open('a/b/f', 'w').write('x')
        os.chmod('a/b', 0); os.chmod('a', 0); os.chmod('.', 0)
        print('locked')
    """)
    assert r.status == "ok" and "locked" in r.stdout, r  # the fixture checks nothing was left behind


def test_raw_system_calls_through_ctypes_are_denied(mode, host):
    r = host["run"]("""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        calls = {"unshare": (272, 0x10000000), "mount": (165, 0, 0, 0, 0, 0), "ptrace": (101, 16, 1, 0, 0),
                 "setns": (308, 0, 0), "bpf": (321, 0, 0, 0), "init_module": (175, 0, 0, 0),
                 "keyctl": (250, 0, 0), "chroot": (161, 0), "perf_event_open": (298, 0, 0, 0, 0, 0)}
        for name, (nr, *args) in calls.items():
            rc = libc.syscall(nr, *args)
            print(name, rc, ctypes.get_errno())
        print("clone-newuser", libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0), ctypes.get_errno())
        print("clone-newuser-hi", libc.syscall(56, ctypes.c_long(0x10000000 | 17 | (1 << 40)), 0, 0, 0, 0),
              ctypes.get_errno())
    """)
    got = lines(r)
    assert r.status == "ok" and len(got) == 11, r
    assert all(v == "-1 1" for v in got.values()), got  # every one: -1, EPERM


def test_proc_shows_only_the_sandbox(mode, host):
    r = host["run"]("""
        import os
        pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
        print('pids', pids)
        for path in ('/proc/1/environ', '/proc/self/environ', '/proc/1/cmdline'):
            try:
                print(path, open(path, 'rb').read()[:200])
            except OSError as e:
                print(path, 'denied', e.errno)
        try:
            print('root', os.listdir('/proc/1/root'))
        except OSError as e:
            print('root denied', e.errno)
    """)
    assert r.status == "ok", r
    pids = eval(r.stdout.splitlines()[0].split(" ", 1)[1])
    assert pids[0] == 1 and len(pids) == 2, pids  # the supervisor and the program
    assert "ENV-SECRET" not in r.stdout and "RLHF_TEST" not in r.stdout and "/work" not in r.stdout, r.stdout
    assert "/proc/1/environ denied 13" in r.stdout, r.stdout  # the supervisor is not dumpable


def test_the_trainers_environment_is_not_inherited(mode, host):
    r = host["run"]("import os; print(sorted(os.environ.items()))")
    assert r.status == "ok" and "ENV-SECRET" not in r.stdout, r
    assert eval(r.stdout) == [("HOME", "/sandbox"), ("LANG", "C.UTF-8"), ("PATH", "/usr/bin:/bin")]


def test_runs_without_capabilities(mode, host):
    r = host["run"]("""
        import os
        print(os.getuid(), os.getgid())
        print([ln for ln in open('/proc/self/status') if ln.startswith(('CapEff', 'NoNewPrivs', 'Seccomp:'))])
    """)
    assert r.status == "ok" and r.stdout.startswith("65534 65534"), r
    assert "CapEff:\\t0000000000000000" in r.stdout and "NoNewPrivs:\\t1" in r.stdout and "Seccomp:\\t2" in r.stdout, \
        r.stdout


def test_nested_namespaces_are_refused(mode, host):
    r = host["run"]("""
        import subprocess
        try:
            print(subprocess.run(['/usr/bin/unshare', '-r', 'id'], capture_output=True, text=True).returncode)
        except OSError as e:
            print('no unshare', e.errno)
    """)
    assert r.status == "ok" and r.stdout.strip() != "0", r


# --------------------------------------------------------------------------------------------------- verdicts
def test_verdicts_a_program_cannot_forge(mode, host):
    """Exit statuses and text a program controls give ``error`` (or ``ok``), never ``refused``, ``memory`` or
    ``timeout``: 125 with nothing on stderr (once the launcher's failure code), "MemoryError" printed, 128 + SIGXCPU
    and 128 + SIGKILL (bubblewrap's way of reporting a signal), a SIGKILL it sends itself."""
    progs = ["import sys; sys.exit(125)",
             "import sys; print('MemoryError', file=sys.stderr); sys.exit(1)",
             "import sys; sys.exit(128 + 24)", "import sys; sys.exit(128 + 9)",
             "import os; os.kill(os.getpid(), 9)"]
    rs = host["batch"]([Run(p) for p in progs])
    assert [r.status for r in rs] == ["error"] * 5, rs
    assert [r.exit_code for r in rs] == [125, 1, 152, 137, -9], rs


def test_a_missing_layer_is_refused_loudly_unless_weaker_is_allowed(host, monkeypatch):
    import rlhf.sandbox.core as core

    real = core.probe()
    monkeypatch.setattr(core, "probe", lambda: {**real, "cgroup": "no cgroups here"})
    r = run_program("print('x')", "", CFG)
    assert r.status == "refused" and "cgroup: no cgroups here" in r.reason and r.exit_code is None, r
    monkeypatch.setenv("RLHF_SANDBOX_CGROUP", "none")
    r = host["run"]("print('x')", allow_weaker=True)
    assert r.status == "ok" and not any(x.startswith("cgroup") for x in r.isolation), r


def test_the_probe_runs_the_real_command_line(tmp_path, monkeypatch):
    """A bubblewrap that does not know a flag this code passes (0.6, Ubuntu 22.04's, has no ``--disable-userns``)
    leaves the namespaces layer missing with its words: every run is refused by name, never an error per run."""
    import rlhf.sandbox.core as core

    import pathlib
    import tempfile

    fake = pathlib.Path(tempfile.mkdtemp(prefix="rlhf-fake-bwrap-"))  # bubblewrap runs as the run's uid: not
    fake.chmod(0o755)  # under pytest's root-only folder
    monkeypatch.setattr(core, "_probe_cache", {})
    real = subprocess.run(["which", "bwrap"], capture_output=True, text=True).stdout.strip()
    (fake / "bwrap").write_text("#!/bin/sh\nfor a in \"$@\"; do [ \"$a\" = --disable-userns ] && "
                                "{ echo 'bwrap: Unknown option --disable-userns' >&2; exit 1; }; done\n"
                                f"exec {real} \"$@\"\n")
    (fake / "bwrap").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    try:
        layers = core.probe()
        assert "Unknown option --disable-userns" in layers["namespaces"], layers
        r = run_program("print(1)", "", SandboxConfig(allow_weaker=True))
        assert r.status == "refused" and "Unknown option --disable-userns" in r.reason, r
    finally:
        import shutil

        shutil.rmtree(fake)


def test_a_launcher_failure_is_refused_not_the_programs_error(host, monkeypatch):
    """The launcher's own failures (here: joining the run's cgroup) reach the host on a pipe no program can write."""
    from rlhf.sandbox import cgroup

    real = cgroup.V1Cgroup.join_paths
    monkeypatch.setattr(cgroup.V1Cgroup, "join_paths", lambda self: real(self) + ["/proc/rlhf-no-such-cgroup/procs"])
    r = host["run"]("print('x')")
    assert r.status == "refused" and "could not join the run's cgroup" in r.reason, r


def test_the_command_line_prints_one_json_line(host, tmp_path):
    prog, stdin = tmp_path / "p.py", tmp_path / "in.txt"
    prog.write_text("print(input()[::-1])")
    stdin.write_text("abc\n")
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))}
    p = subprocess.run([sys.executable, "-m", "rlhf.sandbox", "--program", str(prog), "--stdin", str(stdin),
                        "--timeout_s", "5", "--memory_mb", "128"], capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 0 and len(p.stdout.splitlines()) == 1, p.stderr
    r = json.loads(p.stdout)
    assert {k: r[k] for k in ("status", "exit_code", "stdout")} == {"status": "ok", "exit_code": 0, "stdout": "cba\n"}
    assert set(r) >= {"stderr", "seconds", "isolation", "stdout_cut", "stderr_cut", "cpu_s"}
    p = subprocess.run([sys.executable, "-m", "rlhf.sandbox", "--program", str(prog), "--timeout_s", "0"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 2 and "--timeout_s must be > 0" in p.stderr, p.stderr


def test_the_command_lines_limits_are_the_configs_fields():
    """python -m rlhf.sandbox declares a flag per limit of SandboxConfig (the interpreter excepted), with the field's
    default and type: the command line's defaults are the library's, and every limit can be given."""
    from dataclasses import fields

    from rlhf.sandbox.__main__ import config_of, parser

    assert config_of(parser().parse_args(["--program", "p.py"])) == SandboxConfig()
    given = {"timeout_s": 3.5, "memory_mb": 99, "max_processes": 7, "max_output_bytes": 1000, "max_file_mb": 2,
             "cpus": 0.5, "cpu_s": 1.5, "allow_weaker": True}
    assert {f.name for f in fields(SandboxConfig)} - {"python"} == set(given)
    argv = ["--program", "p.py"] + [t for k, v in given.items()
                                    for t in ([f"--{k}"] if v is True else [f"--{k}", str(v)])]
    assert config_of(parser().parse_args(argv)) == SandboxConfig(**given)
