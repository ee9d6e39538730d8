"""The code reward (``--reward_fn code``): each reply's program, run in the sandbox against its prompt's test cases
(the prompt's ``--label_key`` field), scored by the share of tests it passes (``--code_reward_mode pass_fraction``)
or 1 when it passes them all (``all_pass``). Compile errors, crashes, timeouts and limits score 0 for the test, and
the reasons are counted in the step's metrics (``reward_extra/code_*``).

Test formats (``rlhf.sandbox.graders``, which names the peer files and commits): APPS / TACO's ``input_output``
(stdin tests, or call tests whose inputs are argument lists or verl/PRIME's strings of JSON lines), graded as verl's
prime_code ``run_test`` grades them; LiveCodeBench's records, graded as its ``grade_stdio`` / ``grade_call_based``;
MBPP's ``test_list``, whose ``assert <call> == <literal>`` asserts become call tests and the others run inside, with
the program (counted as ``code_tests_in_sandbox``: a hostile program can read such a test, since it shares the
process). A label that cannot be read stops the step with a ``ValueError`` naming the prompt, never a silent 0.

The expected outputs of stdin and call tests stay outside the sandbox: the program sees only its inputs. Tests of
all replies run in parallel, at most ``--code_sandbox_workers`` sandboxes at once, locally or on a SandboxFusion
service (``--code_sandbox_url``, ``rlhf.sandbox.fusion``)."""
from __future__ import annotations

import ast
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from rlhf.config.part import Part, flag
from rlhf.sandbox.graders import PRELUDE, Test, parse_tests, stdout_matches, value_matches

__all__ = ["CodeRewardConfig", "Test", "code_reward", "configure", "extract_program", "grade", "parse_tests",
           "verdict"]

MODES = ("pass_fraction", "all_pass")
REASONS = ("passed", "wrong_answer", "runtime_error", "compile_error", "timeout", "memory", "output_limit",
           "no_code", "sandbox_refused")


@dataclass
class CodeRewardConfig(Part):
    """The code reward's sandbox and scoring (``--reward_fn code``)."""

    code_reward_mode: str = flag(choices=MODES, help="--reward_fn code: the reward is the share of the prompt's "
                                                     "tests passed, or 1 when all pass (all_pass)",
                                 default="pass_fraction")
    """(--code_reward_mode) pass_fraction: the share of tests passed; all_pass: 1 if every test passes, else 0"""
    code_timeout_s: float = flag(type=float, help="--reward_fn code: seconds per test run", default=5.0)
    """(--code_timeout_s) wall-clock limit of one test run"""
    code_memory_mb: int = flag(type=int, help="--reward_fn code: memory per test run", default=512)
    """(--code_memory_mb) memory limit of one test run"""
    code_sandbox_workers: int = flag(type=int, help="--reward_fn code: sandboxes at once (one per reply; its tests "
                                                    "run one after another in it)", default=2)
    """(--code_sandbox_workers) sandboxes at once (one per reply, its tests one after another in it)"""
    code_sandbox_url: str | None = flag(help="--reward_fn code: a SandboxFusion run_code URL "
                                             "(http://host:8080/run_code) to run the tests on instead of the local "
                                             "sandbox", default=None)
    """(--code_sandbox_url) a SandboxFusion service's run_code URL instead of the local sandbox"""
    code_allow_weaker: bool = flag(action="store_true", help="--reward_fn code: run with the isolation layers this "
                                                             "machine has instead of refusing (docs/code_rl.md)",
                                   default=False)
    """(--code_allow_weaker) run with the isolation layers this machine has when some are missing"""


    def check(self) -> None:
        if self.code_reward_mode not in MODES:
            raise ValueError(f"--code_reward_mode {self.code_reward_mode!r}: expected one of {', '.join(MODES)}")
        if not self.code_timeout_s > 0:
            raise ValueError(f"--code_timeout_s must be > 0, got {self.code_timeout_s}")
        if self.code_memory_mb < 16:
            raise ValueError(f"--code_memory_mb must be >= 16, got {self.code_memory_mb}")
        if self.code_sandbox_workers < 1:
            raise ValueError(f"--code_sandbox_workers must be >= 1, got {self.code_sandbox_workers}")


_config = CodeRewardConfig()


def configure(cfg: CodeRewardConfig) -> None:
    """The settings ``code_reward`` uses from now on (the job sets them once, from its flags)."""
    global _config
    _config = cfg


# ----------------------------------------------------------------------------------------------- the tests
def extract_program(reply: str) -> str:
    """The last fenced code block of a reply (```python, ```py or a bare ```), else the whole reply."""
    blocks = re.findall(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", reply, flags=re.S)
    return blocks[-1] if blocks else reply


# A call's value leaves the sandbox as a Python literal the host reads with ast.literal_eval (never evaluated, never
# unpickled there): tuples, sets and int keys survive, as the peers compare them in-process. Written with the builtin
# types' own __repr__ (a subclass's is not used), numpy scalars as their item(), big ints in hex (no digit limit), an
# infinity as 1e999; anything else (NaN, objects of other classes) reads as no value: a wrong answer.
_LITERAL = """

def _rlhf_lit(v):
    if v is None or v is True or v is False:
        return repr(v)
    if isinstance(v, int):
        return int.__repr__(v) if -10 ** 18 < v < 10 ** 18 else hex(v)
    if isinstance(v, float):
        return float.__repr__(v) if v - v == 0 else ("1e999" if v > 0 else "-1e999" if v < 0 else "nan")
    for t in (str, bytes, complex):
        if isinstance(v, t):
            return t.__repr__(v)
    if isinstance(v, tuple):
        return "(" + "".join(_rlhf_lit(x) + ", " for x in v) + ")"
    if isinstance(v, list):
        return "[" + ", ".join(map(_rlhf_lit, v)) + "]"
    if isinstance(v, (set, frozenset)):
        return "{" + ", ".join(map(_rlhf_lit, v)) + "}" if v else "set()"
    if isinstance(v, dict):
        return "{" + ", ".join(_rlhf_lit(k) + ": " + _rlhf_lit(x) for k, x in v.items()) + "}"
    if type(v).__module__ == "numpy" and getattr(v, "ndim", None) == 0:
        return _rlhf_lit(v.item())
    return "<" + type(v).__name__ + ">"
"""
_CALL = """
import sys as _rlhf_sys
_rlhf_value = {call}
_rlhf_sys.stdout.write("\\n__RLHF_RESULT__" + _rlhf_lit(_rlhf_value) + "\\n")
"""
_RESULT = "\n__RLHF_RESULT__"


def _program_for(program: str, setup: str, t: Test) -> tuple[str, str]:
    """(source, stdin) of one test's run. APPS and LiveCodeBench tests run after the imports their graders put first
    (graders.PRELUDE); a call test's function is the program's, or its ``class Solution``'s method (the peers'
    test: ``"class Solution" in`` the program); its arguments go in pickled (the host's own data, unpickled only in
    the sandbox)."""
    body = (setup + "\n" if setup else "") + (PRELUDE + "\n" if t.rule in ("apps", "lcb") else "") + program
    if t.kind == "stdin":
        return body, str(t.input)
    if t.kind == "call" and t.fn_name:
        import pickle

        fn = f"Solution().{t.fn_name}" if "class Solution" in program else t.fn_name
        call = f"{fn}(*__import__('pickle').loads({pickle.dumps(list(t.input), protocol=4)!r}))"
        return body + _LITERAL + _CALL.format(call=call), ""
    if t.kind == "call":
        return body + _LITERAL + _CALL.format(call=t.input), ""
    return body + "\n\n" + t.code + "\nprint(" + repr(_INSIDE_MARK + _nonce(t)) + ")\n", ""


_INSIDE_MARK = "__RLHF_PASSED__"


def _nonce(t: Test) -> str:
    """A per-test mark an inside test prints after its assert: a program that exits early with status 0
    (``sys.exit(0)``, ``os._exit(0)``) does not pass (one that reads its own source can still forge it)."""
    import hashlib

    return hashlib.sha256(("rlhf-inside:" + t.code).encode()).hexdigest()[:16] + _SALT


_SALT = __import__("secrets").token_hex(8)  # per process: not guessable from the test alone


def verdict(t: Test, result) -> str:
    """One of ``REASONS`` for a test's sandbox result; the output compared by the test's rule (graders)."""
    if result.status == "refused":
        return "sandbox_refused"
    if result.status in ("timeout", "memory", "output_limit"):
        return result.status
    if result.status != "ok":
        tail = result.stderr[-2000:]
        return "compile_error" if ("SyntaxError" in tail or "IndentationError" in tail) else "runtime_error"
    if t.kind == "inside":
        return "passed" if (_INSIDE_MARK + _nonce(t)) in result.stdout.splitlines() else "wrong_answer"
    if t.kind == "stdin":
        return "passed" if stdout_matches(t, result.stdout) else "wrong_answer"
    marker = result.stdout.rfind(_RESULT)
    if marker < 0:
        return "wrong_answer"
    try:
        got = ast.literal_eval(result.stdout[marker + len(_RESULT):].strip())
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):  # no literal: NaN, an object
        return "wrong_answer"
    return "passed" if value_matches(t, got) else "wrong_answer"


# ----------------------------------------------------------------------------------------------- the reward
def grade(replies, labels, cfg: CodeRewardConfig | None = None, prompts=None):
    """(rewards, per-reply verdict lists) for ``replies`` against their ``labels``' tests; every test of every
    reply is one sandboxed run, ``cfg.code_sandbox_workers`` at a time. Every label is read before any runs: one
    that cannot be read is a ValueError naming its prompt (``prompts``, when given) and what is wrong."""
    from rlhf.sandbox.core import SandboxConfig

    cfg = cfg or _config
    box = SandboxConfig(timeout_s=cfg.code_timeout_s, memory_mb=cfg.code_memory_mb,
                        allow_weaker=cfg.code_allow_weaker)
    runner = _runner(cfg)
    jobs, verdicts = [], [[] for _ in replies]
    parsed = [read_label(label, i, prompts[i] if prompts is not None else None) for i, label in enumerate(labels)]
    for i, (reply, (tests, setup)) in enumerate(zip(replies, parsed)):
        program = extract_program(reply)
        if not program.strip():
            verdicts[i] = ["no_code"] * max(len(tests), 1)
            continue
        for t in tests:
            jobs.append((i, t, *_program_for(program, setup, t)))
    # one sandbox per reply (its tests one after another in it, each a fresh interpreter with its own verdict);
    # a SandboxFusion service takes one request per test
    by_reply: dict[int, list] = {}
    for j in jobs:
        by_reply.setdefault(j[0], []).append(j)
    with ThreadPoolExecutor(max_workers=cfg.code_sandbox_workers, thread_name_prefix="rlhf-code") as pool:
        batches = list(pool.map(lambda js: runner([(j[2], j[3]) for j in js], box), by_reply.values()))
    for js, results in zip(by_reply.values(), batches):
        for (i, t, _, _), r in zip(js, results):
            verdicts[i].append(verdict(t, r))
    rewards = []
    for v in verdicts:
        passed = sum(x == "passed" for x in v)
        if cfg.code_reward_mode == "all_pass":
            rewards.append(1.0 if v and passed == len(v) else 0.0)
        else:
            rewards.append(passed / len(v) if v else 0.0)
    return rewards, verdicts


def read_label(label, i: int, prompt=None) -> tuple[list[Test], str]:
    """``parse_tests(label)``, its ValueError naming the record: the sample's index, its prompt's start, the label's."""
    try:
        return parse_tests(label)
    except ValueError as e:
        who = f"sample {i}" + (f" (prompt {_cut(prompt)!r})" if prompt is not None else "")
        raise ValueError(f"--reward_fn code: the tests of {who} cannot be read: {e}; its label: {_cut(label)!r}") \
            from None


def _cut(v, n: int = 120) -> str:
    text = v if isinstance(v, str) else repr(v)
    return text if len(text) <= n else text[:n] + f"... ({len(text)} characters)"


def _runner(cfg: CodeRewardConfig):
    """``run(list of (program, stdin), box) -> results``: the local sandbox (one per call), or the service."""
    if cfg.code_sandbox_url:
        from rlhf.sandbox.fusion import FusionClient

        client = FusionClient(cfg.code_sandbox_url)
        return lambda runs, box: [client.run(program, stdin, box) for program, stdin in runs]
    from rlhf.sandbox.core import Run, run_batch

    return lambda runs, box: run_batch([Run(program, stdin) for program, stdin in runs], box)


def code_reward(prompts, responses, labels=None, **kwargs):
    """``--reward_fn code``: OpenRLHF's reward-function shape (``rewards`` and ``extra_logs``), the reasons counted
    as shares of all test runs (``code_passed``, ``code_timeout``, ...) and ``code_tests_in_sandbox``."""
    if labels is None:
        raise ValueError("--reward_fn code needs each prompt's tests: pass --label_key (the field with them)")
    rewards, verdicts = grade(responses, labels, prompts=prompts)
    flat = [x for v in verdicts for x in v]
    n = max(len(flat), 1)
    extra = {f"code_{r}": sum(x == r for x in flat) / n for r in REASONS}
    inside = sum(t.kind == "inside" for lab in labels for t in parse_tests(lab)[0])
    extra["code_tests_in_sandbox"] = float(inside)
    extra["code_runs"] = float(len(flat))  # the sandboxed runs of this call (one per test of each reply)
    return {"rewards": rewards, "scores": rewards, "extra_logs": extra}
