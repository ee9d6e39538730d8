"""The host's side of a running sandbox: feeds the supervisor its programs, reads its frames, the launcher's status
pipe and bubblewrap's, keeps each program's CPU budget (from the cgroup, or the run's uid), gives each verdict, and
ends everything of the run."""
from __future__ import annotations

import json
import marshal
import os
import selectors
import signal
import subprocess
import threading
import time

from rlhf.sandbox.records import BUDGET_GRACE_S, Run, SandboxConfig, SandboxResult
from rlhf.sandbox.launch import as_mb_for, python


class _Test:
    """The host's view of one program of the batch while it runs."""

    def __init__(self):
        self.cpu0 = 0.0
        self.oom0: int | None = None
        self.budget_killed = False
        self.result: SandboxResult | None = None


def execute(argv: list[str], fds: dict, runs: list[Run], cfg: SandboxConfig, cg) -> list[SandboxResult]:
    """Start the launcher, feed the supervisor ``runs``, follow them to their ends; each program's result."""
    s = _Session(argv, fds, runs, cfg, cg)
    try:
        s.follow()
    finally:
        s.close()
    return s.results()


class _Session:
    def __init__(self, argv: list[str], fds: dict, runs: list[Run], cfg: SandboxConfig, cg):
        from rlhf.sandbox import seccomp

        self.cfg, self.cg = cfg, cg
        pass_fds = [fds["status"][1]] + ([fds["seccomp"][0]] if "seccomp" in fds else [])
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}  # the launcher's (and bubblewrap's): nothing inherited
        if "seccomp" in fds:
            os.write(fds["seccomp"][1], seccomp.filter_bytes())  # a few hundred bytes: within the pipe's buffer
            os.close(fds["seccomp"][1])
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, env=env, start_new_session=True, pass_fds=pass_fds,
                                         cwd="/")
        finally:
            for fd in pass_fds:
                os.close(fd)
        exe, _ = python(cfg)
        first = {"python": exe, "env": {"PATH": "/usr/bin:/bin", "HOME": "/sandbox", "LANG": "C.UTF-8"}}
        frames = [first] + [{"i": i, "dir": f"run_{i}", "stdin": run.stdin.encode(), "timeout_s": cfg.timeout_s,
                             "cpu_s": cfg.cpu_budget_s, "as": as_mb_for(cfg, cg) << 20,
                             "fsize": cfg.max_file_mb << 20, "nofile": 256, "max_output": cfg.max_output_bytes}
                            for i, run in enumerate(runs)]
        threading.Thread(target=_feed, args=(self.proc.stdin, b"".join(map(_frame, frames))), daemon=True).start()
        self.status_r = fds["status"][0]
        self.tests = [_Test() for _ in runs]
        self.current: int | None = None
        self.launched, self.launcher_says, self.diag = False, [], bytearray()
        self.ev_buf, self.st_buf = bytearray(), bytearray()
        self.sel = selectors.DefaultSelector()
        os.set_blocking(self.status_r, False)
        self.sel.register(self.status_r, selectors.EVENT_READ, self._on_status)
        os.set_blocking(self.proc.stdout.fileno(), False)
        self.sel.register(self.proc.stdout.fileno(), selectors.EVENT_READ, self._on_events)
        os.set_blocking(self.proc.stderr.fileno(), False)
        self.sel.register(self.proc.stderr.fileno(), selectors.EVENT_READ, self._on_stderr)

    def follow(self) -> None:
        # the host's backstop: a supervisor that stops answering (the programs cannot signal it, but the memory
        # limit can kill it) does not hold the trainer
        backstop = self.cfg.timeout_s + 10.0
        last = time.monotonic()
        while self.sel.get_map():
            self._keep_budget()
            if time.monotonic() - last > backstop + (30.0 if not self.launched else 0.0):
                self.launcher_says.append(f"the sandbox did not answer for {backstop:g} s")
                return
            for key, _ in self.sel.select(timeout=0.05 if self.current is not None else 1.0):
                try:
                    data = os.read(key.fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not data:
                    self.sel.unregister(key.fd)
                    continue
                last = time.monotonic()
                key.data(data)

    def _keep_budget(self) -> None:
        if self.current is None or self.cg is None:
            return
        t = self.tests[self.current]
        if not t.budget_killed and self.cg.cpu_seconds() - t.cpu0 > self.cfg.cpu_budget_s + BUDGET_GRACE_S:
            t.budget_killed = True
            _kill_programs(self.cg)

    def _on_stderr(self, data: bytes) -> None:
        self.diag += data[:max(0, 65536 - len(self.diag))]

    def _on_status(self, data: bytes) -> None:
        """bubblewrap's JSON (``child-pid`` once the sandbox is up), or the launcher's own failure."""
        self.st_buf += data
        while b"\n" in self.st_buf:
            line, _, rest = bytes(self.st_buf).partition(b"\n")
            self.st_buf[:] = rest
            try:
                if "child-pid" in json.loads(line):
                    self.launched = True
            except ValueError:
                self.launcher_says.append(line.decode(errors="replace"))

    def _on_events(self, data: bytes) -> None:
        self.ev_buf += data
        while len(self.ev_buf) >= 4 and len(self.ev_buf) >= 4 + int.from_bytes(self.ev_buf[:4], "big"):
            n = int.from_bytes(self.ev_buf[:4], "big")
            ev = marshal.loads(bytes(self.ev_buf[4:4 + n]))
            del self.ev_buf[:4 + n]
            if ev["ev"] == "start":
                self.current = ev["i"]
                t = self.tests[self.current]
                t.cpu0 = self.cg.cpu_seconds() if self.cg is not None else 0.0
                t.oom0 = self.cg.oom_kills() if self.cg is not None else None
            elif ev["ev"] == "end":
                self.tests[ev["i"]].result = _verdict(ev, self.tests[ev["i"]], self.cfg, self.cg)
                self.current = None

    def close(self) -> None:
        _stop(self.proc, self.cg)
        for key in list(self.sel.get_map().values()):
            self.sel.unregister(key.fd)
        self.sel.close()
        os.close(self.status_r)
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                pipe.close()
            except OSError:
                pass

    def results(self) -> list[SandboxResult]:
        """Each program's result; one the supervisor never reported is ``refused`` if the sandbox never started
        (the launcher's or bubblewrap's words), else ``memory`` or ``error``."""
        err = self.diag.decode(errors="replace").strip()
        out = []
        for t in self.tests:
            if t.result is not None:
                out.append(t.result)
            elif not self.launched:
                why = "; ".join(self.launcher_says) or err or \
                    f"bubblewrap ended with {self.proc.returncode} before the sandbox"
                out.append(SandboxResult("refused", None, "", "", reason=f"the sandbox did not start: {why}"[:2000]))
            else:
                oom = self.cg is not None and (self.cg.oom_kills() or 0) > 0
                why = "; ".join(self.launcher_says) or ("the memory limit ended the sandbox's supervisor" if oom else
                                                        "the sandbox's supervisor ended before this program ran")
                out.append(SandboxResult("memory" if oom else "error", None, "", "", reason=why))
        return out


def _verdict(ev: dict, t: _Test, cfg: SandboxConfig, cg) -> SandboxResult:
    out = ev["out"].decode(errors="replace")
    err = ev["err"].decode(errors="replace")
    code = ev["code"] if ev["sig"] is None else -ev["sig"]
    oom = (cg.oom_kills() or 0) - (t.oom0 or 0) if cg is not None and t.oom0 is not None else 0
    if t.budget_killed:
        status, reason = "timeout", f"CPU budget of {cfg.cpu_budget_s:g} s across the program's processes"
    elif ev["why"] == "wall":
        status, reason = "timeout", f"wall-clock limit of {cfg.timeout_s:g} s"
    elif ev["why"] == "output":
        status, reason = "output_limit", f"output over {cfg.max_output_bytes} bytes"
    elif ev["sig"] == signal.SIGXCPU:
        status, reason = "timeout", f"CPU-time limit of {int(cfg.cpu_budget_s + 0.999)} s of a process"
    elif oom > 0:
        status, reason = "memory", f"memory limit of {cfg.memory_mb} MB (the cgroup's OOM kill)"
    elif ev["sig"] == signal.SIGKILL and cg is not None and cg.cpu_seconds() - t.cpu0 >= cfg.cpu_budget_s:
        status, reason = "timeout", f"CPU-time limit of {int(cfg.cpu_budget_s + 0.999)} s of a process (hard)"
    else:
        status, reason = ("ok" if code == 0 else "error"), ""
    used = round(cg.cpu_seconds() - t.cpu0, 4) if cg is not None and _counts_cpu(cg) else None
    return SandboxResult(status, code if ev["why"] == "" else None, out, err, ev["out_cut"], ev["err_cut"],
                         seconds=round(ev["wall"], 4), reason=reason, cpu_s=used)


def _counts_cpu(cg) -> bool:
    return not any(m.startswith("cpu time") for m in cg.missing)


def _kill_programs(cg, timeout: float = 5.0) -> None:
    """SIGKILL the running program's processes (every process of the run in the sandbox's PID namespace but its
    first, the supervisor), e.g. when their CPU budget is spent."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        targets = []
        for pid in cg.pids():
            try:
                with open(f"/proc/{pid}/status") as f:
                    ns = next((ln.split()[1:] for ln in f if ln.startswith("NSpid:")), [])
            except OSError:
                continue
            if len(ns) >= 2 and ns[-1] != "1":
                targets.append(pid)
        if not targets:
            return
        for pid in targets:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.005)


def _frame(obj: dict) -> bytes:
    """One frame of the supervisor's protocol (``rlhf.sandbox.supervisor``)."""
    data = marshal.dumps(obj, 4)
    return len(data).to_bytes(4, "big") + data


def _feed(pipe, data: bytes) -> None:
    try:
        pipe.write(data)
        pipe.close()
    except (BrokenPipeError, ValueError, OSError):  # the sandbox ended before reading it all
        pass


def _stop(proc: subprocess.Popen, cg) -> None:
    """The launcher ends (its supervisor ends after the last program; bubblewrap then exits), else is killed;
    then everything of the run: the cgroup's processes, and the launcher's process group."""
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    if cg is not None:
        cg.kill_all()
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
