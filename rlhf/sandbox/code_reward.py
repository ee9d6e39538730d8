"""The code reward (``--reward_fn code``): each reply's program, run in the sandbox against its prompt's test cases
(the prompt's ``--label_key`` field), scored by the share of tests it passes (``--code_reward_mode pass_fraction``)
or 1 when it passes them all (``all_pass``). Compile errors, crashes, timeouts and limits score 0 for the test, and
the reasons are counted in the step's metrics (``reward_extra/code_*``).

Test formats (a label is a JSON object, or a string holding one):

* APPS / TACO's ``input_output`` object: ``{"inputs": [...], "outputs": [...]}`` runs the program with each input
  on stdin and compares its stdout with the output (lines stripped of trailing blanks, trailing blank lines
  ignored); with ``"fn_name"`` each input is the argument list of a call to that function and the output its
  return value (compared as JSON values).
* MBPP's ``test_list`` (``{"test_list": ["assert f(1) == 2", ...], "test_setup_code": "..."}``): each assert of the
  form ``assert <call> == <literal>`` becomes a call test (the expected value never enters the sandbox); any other
  assert runs inside, with the program (counted as ``code_tests_in_sandbox``: a hostile program can read such a
  test, since it shares the process).

The expected outputs of stdin and call tests stay outside the sandbox: the program sees only its inputs. Tests of
all replies run in parallel, at most ``--code_sandbox_workers`` sandboxes at once, locally or on a SandboxFusion
service (``--code_sandbox_url``, ``rlhf.sandbox.fusion``)."""
from __future__ import annotations

import ast
import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from rlhf.part import Part

MODES = ("pass_fraction", "all_pass")
REASONS = ("passed", "wrong_answer", "runtime_error", "compile_error", "timeout", "memory", "output_limit",
           "no_code", "sandbox_refused")


@dataclass
class CodeRewardConfig(Part):
    """The code reward's sandbox and scoring (``--reward_fn code``)."""

    code_reward_mode: str = "pass_fraction"
    """(--code_reward_mode) pass_fraction: the share of tests passed; all_pass: 1 if every test passes, else 0"""
    code_timeout_s: float = 5.0
    """(--code_timeout_s) wall-clock limit of one test run"""
    code_memory_mb: int = 512
    """(--code_memory_mb) memory limit of one test run"""
    code_sandbox_workers: int = 2
    """(--code_sandbox_workers) sandboxes at once (one per reply, its tests one after another in it)"""
    code_sandbox_url: str | None = None
    """(--code_sandbox_url) a SandboxFusion service's run_code URL instead of the local sandbox"""
    code_allow_weaker: bool = False
    """(--code_allow_weaker) run with the isolation layers this machine has when some are missing"""

    @classmethod
    def add_args(cls, g) -> None:
        g.add_argument("--code_reward_mode", default="pass_fraction", choices=MODES,
                       help="--reward_fn code: the reward is the share of the prompt's tests passed, or 1 when all "
                            "pass (all_pass)")
        g.add_argument("--code_timeout_s", type=float, default=5.0, help="--reward_fn code: seconds per test run")
        g.add_argument("--code_memory_mb", type=int, default=512, help="--reward_fn code: memory per test run")
        g.add_argument("--code_sandbox_workers", type=int, default=2,
                       help="--reward_fn code: sandboxes at once (one per reply; its tests run one after "
                            "another in it)")
        g.add_argument("--code_sandbox_url", default=None,
                       help="--reward_fn code: a SandboxFusion run_code URL (http://host:8080/run_code) to run the "
                            "tests on instead of the local sandbox")
        g.add_argument("--code_allow_weaker", action="store_true",
                       help="--reward_fn code: run with the isolation layers this machine has instead of refusing "
                            "(docs/code_rl.md)")

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
@dataclass(frozen=True)
class Test:
    kind: str
    """stdin | call | inside"""
    input: object = None
    """stdin text; or the call's argument list; or, for ``call`` from an assert, the call's source"""
    expected: object = None
    fn_name: str = ""
    code: str = ""
    """an ``inside`` test's source (run after the program)"""


def parse_tests(label) -> tuple[list[Test], str]:
    """(tests, setup code) from a label; ValueError naming what is wrong."""
    obj = json.loads(label) if isinstance(label, str) else label
    if isinstance(obj, dict) and "input_output" in obj:  # a whole APPS / TACO record
        io = obj["input_output"]
        obj = json.loads(io) if isinstance(io, str) else io
    if not isinstance(obj, dict):
        raise ValueError(f"code tests: expected a JSON object, got {type(obj).__name__}")
    if "inputs" in obj:
        ins, outs = obj["inputs"], obj.get("outputs")
        if not isinstance(ins, list) or not isinstance(outs, list) or len(ins) != len(outs):
            raise ValueError("code tests: 'inputs' and 'outputs' must be lists of the same length")
        fn = obj.get("fn_name")
        if fn:
            return [Test("call", list(i) if isinstance(i, list) else [i], o, fn) for i, o in zip(ins, outs)], ""
        return [Test("stdin", i if isinstance(i, str) else "\n".join(map(str, i)), o) for i, o in zip(ins, outs)], ""
    if "test_list" in obj:
        tests = [_assert_test(t) for t in obj["test_list"]]
        return tests, obj.get("test_setup_code", "") or ""
    raise ValueError("code tests: expected APPS/TACO's {inputs, outputs[, fn_name]} or MBPP's {test_list}")


def _assert_test(src: str) -> Test:
    """``assert <call> == <literal>`` -> a call test (expected kept outside); anything else runs inside."""
    try:
        node = ast.parse(src.strip()).body[0]
        if (isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare) and len(node.test.ops) == 1
                and isinstance(node.test.ops[0], ast.Eq) and isinstance(node.test.left, ast.Call)):
            expected = ast.literal_eval(node.test.comparators[0])
            return Test("call", ast.unparse(node.test.left), _jsonable(expected))
    except (SyntaxError, ValueError, IndexError):
        pass
    return Test("inside", code=src)


def _jsonable(v):
    if isinstance(v, (tuple, list)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (set, frozenset)):
        return sorted(_jsonable(x) for x in v)
    return v


def extract_program(reply: str) -> str:
    """The last fenced code block of a reply (```python, ```py or a bare ```), else the whole reply."""
    blocks = re.findall(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", reply, flags=re.S)
    return blocks[-1] if blocks else reply


_CALL_HARNESS = """

import json as _rlhf_json, sys as _rlhf_sys
_rlhf_value = {call}
_rlhf_sys.stdout.write("\\n__RLHF_RESULT__" + _rlhf_json.dumps(_rlhf_value, default=repr) + "\\n")
"""
_ARGS_HARNESS = """

import json as _rlhf_json, sys as _rlhf_sys
_rlhf_value = {fn}(*_rlhf_json.loads({args!r}))
_rlhf_sys.stdout.write("\\n__RLHF_RESULT__" + _rlhf_json.dumps(_rlhf_value, default=repr) + "\\n")
"""


def _program_for(program: str, setup: str, t: Test) -> tuple[str, str]:
    """(source, stdin) of one test's run."""
    body = (setup + "\n" if setup else "") + program
    if t.kind == "stdin":
        return body, str(t.input)
    if t.kind == "call" and t.fn_name:
        return body + _ARGS_HARNESS.format(fn=t.fn_name, args=json.dumps(t.input)), ""
    if t.kind == "call":
        return body + _CALL_HARNESS.format(call=t.input), ""
    return body + "\n\n" + t.code + "\nprint(" + repr(_INSIDE_MARK + _nonce(t)) + ")\n", ""


_INSIDE_MARK = "__RLHF_PASSED__"


def _nonce(t: Test) -> str:
    """A per-test mark an inside test prints after its assert: a program that exits early with status 0
    (``sys.exit(0)``, ``os._exit(0)``) does not pass (one that reads its own source can still forge it)."""
    import hashlib

    return hashlib.sha256(("rlhf-inside:" + t.code).encode()).hexdigest()[:16] + _SALT


_SALT = __import__("secrets").token_hex(8)  # per process: not guessable from the test alone


def _normalize(text: str) -> list[str]:
    lines = [ln.rstrip() for ln in str(text).replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def verdict(t: Test, result) -> str:
    """One of ``REASONS`` for a test's sandbox result."""
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
        return "passed" if _normalize(result.stdout) == _normalize(t.expected) else "wrong_answer"
    marker = result.stdout.rfind("\n__RLHF_RESULT__")
    if marker < 0:
        return "wrong_answer"
    try:
        got = json.loads(result.stdout[marker + len("\n__RLHF_RESULT__"):].strip())
    except ValueError:
        return "wrong_answer"
    want = _jsonable(t.expected)
    if isinstance(want, list) and len(want) == 1 and not isinstance(got, list):  # APPS wraps call outputs
        want = want[0]
    return "passed" if got == want else "wrong_answer"


# ----------------------------------------------------------------------------------------------- the reward
def grade(replies, labels, cfg: CodeRewardConfig | None = None):
    """(rewards, per-reply verdict lists) for ``replies`` against their ``labels``' tests; every test of every
    reply is one sandboxed run, ``cfg.code_sandbox_workers`` at a time."""
    from rlhf.sandbox.core import SandboxConfig

    cfg = cfg or _config
    box = SandboxConfig(timeout_s=cfg.code_timeout_s, memory_mb=cfg.code_memory_mb,
                        allow_weaker=cfg.code_allow_weaker)
    runner = _runner(cfg)
    jobs, verdicts = [], [[] for _ in replies]
    for i, (reply, label) in enumerate(zip(replies, labels)):
        tests, setup = parse_tests(label)
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
    rewards, verdicts = grade(responses, labels)
    flat = [x for v in verdicts for x in v]
    n = max(len(flat), 1)
    extra = {f"code_{r}": sum(x == r for x in flat) / n for r in REASONS}
    inside = sum(t.kind == "inside" for lab in labels for t in parse_tests(lab)[0])
    extra["code_tests_in_sandbox"] = float(inside)
    extra["code_runs"] = float(len(flat))  # the sandboxed runs of this call (one per test of each reply)
    return {"rewards": rewards, "scores": rewards, "extra_logs": extra}
