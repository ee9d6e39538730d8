"""A small software-engineering task set, written for this project (not taken from SWE-bench or any other set): six
tasks, each a repository of two files (a module with a bug and a visible test that fails on it), an issue that
describes the bug, and hidden tests that decide the reward. ``SweRepo`` is one trajectory's copy of a task's
repository: the files live on the host as text, and every command on them (listing, reading a file, running the
tests, a shell command, the grade) runs in ``rlhf.sandbox`` with the files copied in; none of the repository's code
runs on the host.

    python -m rlhf.demo.swe_task --out data/swe       # prompts.jsonl: {"prompt": issue, "task": id}
"""
from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import time
from dataclasses import dataclass

from rlhf.demo.arith_task import TaskDataPart
from rlhf.sandbox.core import run_program
from rlhf.sandbox.records import SandboxConfig, SandboxResult


@dataclass(frozen=True)
class SweTask:
    id: str
    issue: str
    files: dict
    """name -> text: the repository (plain file names: the sandbox's working folder is flat)"""
    test: str
    """the visible test module's name (in ``files``); it fails on the bug"""
    hidden: str
    """the hidden tests' source (a module ``hidden_tests``), copied in only to grade"""


def _task(id, issue, name, source, visible, hidden) -> SweTask:
    return SweTask(id=id, issue=issue, files={name: source, f"test_{id}.py": visible}, test=f"test_{id}", hidden=hidden)


TASKS = [
    _task("slug", "textutil.slugify('Hello World') returns 'Hello-World'; slugs must be lower case: 'hello-world'.",
          "textutil.py", "def slugify(s):\n    return '-'.join(s.split())\n",
          "from textutil import slugify\n\ndef test_lower():\n    assert slugify('Hello World') == 'hello-world'\n",
          "from textutil import slugify\n\ndef test_a():\n    assert slugify('A B  C') == 'a-b-c'\n\n"
          "def test_b():\n    assert slugify('x') == 'x'\n"),
    _task("mean", "stats.mean([]) raises ZeroDivisionError; the mean of no numbers should be 0.0.",
          "stats.py", "def mean(xs):\n    return sum(xs) / len(xs)\n",
          "from stats import mean\n\ndef test_empty():\n    assert mean([]) == 0.0\n",
          "from stats import mean\n\ndef test_a():\n    assert mean([]) == 0.0\n\ndef test_b():\n"
          "    assert mean([1, 2, 3, 6]) == 3.0\n"),
    _task("chunks", "seqs.chunks([1, 2, 3, 4, 5], 2) drops the last element; it should give [[1, 2], [3, 4], [5]].",
          "seqs.py", "def chunks(xs, n):\n    return [xs[i:i + n] for i in range(0, len(xs) - 1, n)]\n",
          "from seqs import chunks\n\ndef test_tail():\n"
          "    assert chunks([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]\n",
          "from seqs import chunks\n\ndef test_a():\n    assert chunks([1, 2, 3], 3) == [[1, 2, 3]]\n\n"
          "def test_b():\n    assert chunks([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]\n\ndef test_c():\n"
          "    assert chunks([], 2) == []\n"),
    _task("palin", "words.is_palindrome('Never odd or even') is False; case and spaces should not count.",
          "words.py", "def is_palindrome(s):\n    return s == s[::-1]\n",
          "from words import is_palindrome\n\ndef test_phrase():\n    assert is_palindrome('Never odd or even')\n",
          "from words import is_palindrome\n\ndef test_a():\n    assert is_palindrome('Never odd or even')\n\n"
          "def test_b():\n    assert not is_palindrome('abc')\n\ndef test_c():\n    assert is_palindrome('Aba')\n"),
    _task("kv", "config.parse_kv('a = 1; b=2') gives {'a ': ' 1', ' b': '2'}; keys and values should be stripped.",
          "config.py", "def parse_kv(s):\n    return dict(p.split('=') for p in s.split(';') if p)\n",
          "from config import parse_kv\n\ndef test_spaces():\n"
          "    assert parse_kv('a = 1; b=2') == {'a': '1', 'b': '2'}\n",
          "from config import parse_kv\n\ndef test_a():\n    assert parse_kv('a = 1; b=2') == {'a': '1', 'b': '2'}\n\n"
          "def test_b():\n    assert parse_kv('x=y') == {'x': 'y'}\n"),
    _task("clamp", "mathx.clamp(5, 0, 3) returns 5; a value above the upper bound should become the bound, 3.",
          "mathx.py", "def clamp(x, lo, hi):\n    return max(lo, x)\n",
          "from mathx import clamp\n\ndef test_high():\n    assert clamp(5, 0, 3) == 3\n",
          "from mathx import clamp\n\ndef test_a():\n    assert clamp(5, 0, 3) == 3\n\ndef test_b():\n"
          "    assert clamp(-1, 0, 3) == 0\n\ndef test_c():\n    assert clamp(2, 0, 3) == 2\n"),
]
BY_ID = {t.id: t for t in TASKS}

RUN_TESTS = '''import sys, traceback
sys.path.insert(0, ".")
import {module} as t
names = sorted(n for n in dir(t) if n.startswith("test_"))
failed = 0
for n in names:
    try:
        getattr(t, n)()
        print("PASS", n)
    except Exception:
        failed += 1
        print("FAIL", n)
        traceback.print_exc(limit=-1, file=sys.stdout)
print(f"{tag}{{len(names) - failed}} passed, {{failed}} failed")
raise SystemExit(1 if failed or not names else 0)
'''
"""The test runner (no pytest in the sandbox's interpreter): ``module``'s ``test_*`` functions, one line each, then
the count, after ``tag`` (the grade's nonce; "" for the agent's own runs)."""
SHELL = '''import json, os, subprocess, sys
try:
    p = subprocess.run(sys.stdin.read(), shell=True, capture_output=True, text=True, errors="replace",
                       timeout={timeout})
    out, code = p.stdout + p.stderr, p.returncode
except subprocess.TimeoutExpired:
    out, code = "[the command ran past {timeout} s and was stopped]", 124
print(out, end="")
files = {{}}
for n in os.listdir("."):
    if n != "main.py" and os.path.isfile(n) and os.path.getsize(n) < 1 << 18:
        try:
            files[n] = open(n).read()
        except UnicodeDecodeError:  # a binary file stays in the sandbox
            pass
sys.stderr.write("\\n@@FILES@@" + json.dumps(files))
raise SystemExit(code if 0 <= code < 256 else 1)
'''
"""A shell command (``sh -c``), then the working folder's text files back to the host, after a marker on stderr."""


class SweRepo:
    """One trajectory's repository of ``task``. Its methods block (each a sandbox run, about a second); the
    counters say how many commands ran and how long the sandbox took."""

    def __init__(self, task: SweTask, cfg: SandboxConfig | None = None):
        self.task, self.files = task, dict(task.files)
        self.cfg = cfg or SandboxConfig(timeout_s=20.0, memory_mb=256, max_processes=32)
        self.commands, self.sandbox_s = 0, 0.0

    def _run(self, program: str, stdin: str = "", extra: dict | None = None) -> SandboxResult:
        t0 = time.perf_counter()
        try:
            return run_program(program, stdin, self.cfg, files={**self.files, **(extra or {})})
        finally:
            self.commands += 1
            self.sandbox_s += time.perf_counter() - t0

    @staticmethod
    def _text(r: SandboxResult) -> str:
        """What the model reads of a run: its output and its errors (a test module that does not import fails on
        stderr), or why the sandbox stopped it."""
        if r.status not in ("ok", "error"):
            return f"[{r.status}: {r.reason}]"
        return r.stdout + r.stderr

    def list_files(self) -> str:
        return self._text(self._run('import os\nprint("\\n".join(sorted(n for n in os.listdir(".") '
                                    'if n != "main.py")))'))

    def read_file(self, path: str) -> str:
        if path not in self.files:
            return f"no such file: {path!r}"
        return self._text(self._run(f"print(open({path!r}).read(), end='')"))

    def write_file(self, path: str, content: str) -> str:
        """Kept on the host (the next command copies it in); plain file names only."""
        if os.path.basename(path) != path or not path or path == "main.py" or not isinstance(content, str):
            return f"cannot write {path!r}: a plain file name other than main.py is expected"
        self.files[path] = content
        return f"wrote {len(content)} characters to {path}"

    def run_tests(self) -> str:
        return self._text(self._run(RUN_TESTS.format(module=self.task.test, tag="")))

    def shell(self, command: str, timeout: float = 15.0) -> tuple[str, int]:
        """``sh -c command`` in the sandbox; the files it leaves in the working folder become the repository's."""
        r = self._run(SHELL.format(timeout=timeout), stdin=command)
        _, marker, files = r.stderr.rpartition("\n@@FILES@@")
        try:
            kept = json.loads(files) if marker else None
        except ValueError:  # cut at the sandbox's output limit
            kept = None
        if not isinstance(kept, dict):
            return self._text(r) + "\n[the working folder did not come back; the repository is as before]", -1
        self.files = {n: t for n, t in kept.items() if os.path.basename(n) == n and n not in ("", ".", "..")
                      and isinstance(t, str)}
        return r.stdout, (r.exit_code if r.exit_code is not None else -1)

    def hidden_pass(self) -> bool:
        """The reward: every hidden test passes, the repository as the agent left it. The verdict is the runner's
        last line, stamped with a fresh nonce and the hidden tests' count, not the exit status alone: the agent's
        modules run in the runner's process, and one that ends it with status 0 on import passed no test. (Code
        written to read the nonce out of the runner would still pass: the grade is not proof against a model that
        learns to attack it.)"""
        tag = secrets.token_hex(8)
        r = self._run(RUN_TESTS.format(module="hidden_tests", tag=tag + " "),
                      extra={"hidden_tests.py": self.task.hidden})
        n = len(re.findall(r"^def test_", self.task.hidden, re.M))
        return r.status == "ok" and r.exit_code == 0 and r.stdout.splitlines()[-1:] == [f"{tag} {n} passed, 0 failed"]


def records() -> list[dict]:
    return [{"prompt": t.issue, "task": t.id} for t in TASKS]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    TaskDataPart.add_args(p, only=("out",))
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "prompts.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records())
    print(os.path.join(a.out, "prompts.jsonl"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
