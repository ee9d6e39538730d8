"""How the graders that code datasets were made for read a prompt's tests and compare a program's output with the
expected one; the code reward (``rlhf.sandbox.code_reward``) runs the programs and grades here, on the host (the
expected outputs never enter the sandbox). One reader per form real datasets hold, and each form's own grader's
comparison. The peer files, read at these commits (the functions named below are theirs):

* verl (volcengine/verl at b178a3cd, the files last changed at eac4863a; Apache-2.0): PRIME's grader,
  ``verl/utils/reward_score/prime_code/testing_util.py`` (``run_test``, ``custom_compare_``,
  ``stripped_string_compare``, ``combined_int_check``) and its ``__init__.py`` (``compute_score``), the one verl
  runs on APPS, TACO, CodeContests and Codeforces records (``verl/utils/reward_score/__init__.py``).
* APPS (hendrycks/apps at 362aedc3; MIT): ``eval/testing_util.py`` (``run_test``, ``custom_compare_``), which
  verl's file copies, less its last two stdout checks (below).
* LiveCodeBench (LiveCodeBench/LiveCodeBench at 28fef95e; MIT): ``lcb_runner/evaluation/testing_util.py``
  (``grade_stdio``, ``grade_call_based``, ``get_stripped_lines``, ``convert_line_to_decimals``, ``import_string``)
  and the stored form, ``lcb_runner/benchmarks/code_generation.py`` (``Test``, ``CodeGenerationProblem``).

Forms (a label is a JSON value, or a string holding one):

* ``{"inputs": [...], "outputs": [...]}`` (APPS / TACO's ``input_output``; verl's ``reward_model.ground_truth``),
  bare or under ``"input_output"`` or ``"ground_truth"``: stdin tests, or with ``"fn_name"`` call tests whose input
  is the argument list (APPS) or a string of JSON lines, one an argument, with the output a JSON string (verl /
  PRIME, LiveCodeBench's ``get_evaluation_sample``). Graded as verl's ``run_test`` grades (rule ``apps``).
* LiveCodeBench's record (``public_test_cases``, ``private_test_cases``, ``metadata.func_name``) or a list of its
  ``{"input", "output", "testtype"}`` tests: graded as its ``grade_stdio`` / ``grade_call_based`` (rule ``lcb``).
* MBPP's ``{"test_list": [...], "test_setup_code": ...}``: ``assert <call> == <literal>`` is a call test compared
  with ``==`` as the assert would (rule ``mbpp``); any other assert runs inside, with the program.

A label that cannot be read is a ``ValueError`` saying what is wrong (``code_reward.grade`` adds which record)."""
from __future__ import annotations

import ast
import json
import math
from dataclasses import dataclass
from decimal import Decimal

# LiveCodeBench's import_string (testing_util.py), put before every program of an APPS or LiveCodeBench test as its
# grade_stdio / grade_call_based do; verl's run_test puts the same text (with a recursion limit of 6*10**5) first.
# Programs written for those graders use typing's List or math's gcd without importing them.
PRELUDE = ("from string import *\nfrom re import *\nfrom datetime import *\nfrom collections import *\n"
           "from heapq import *\nfrom bisect import *\nfrom copy import *\nfrom math import *\nfrom random import *\n"
           "from statistics import *\nfrom itertools import *\nfrom functools import *\nfrom operator import *\n"
           "from io import *\nfrom sys import *\nfrom json import *\nfrom builtins import *\nfrom typing import *\n"
           "import string\nimport re\nimport datetime\nimport collections\nimport heapq\nimport bisect\nimport copy\n"
           "import math\nimport random\nimport statistics\nimport itertools\nimport functools\nimport operator\n"
           "import io\nimport sys\nimport json\nsys.setrecursionlimit(50000)\n")
RULES = ("apps", "lcb", "mbpp")


@dataclass(frozen=True)
class Test:
    kind: str
    """stdin | call | inside"""
    input: object = None
    """stdin text; or the call's argument list; or, for ``call`` from an assert, the call's source"""
    expected: object = None
    """the expected stdout text, or the call's expected value (read: JSON strings already decoded)"""
    fn_name: str = ""
    code: str = ""
    """an ``inside`` test's source (run after the program)"""
    rule: str = "apps"
    """whose comparison grades it: ``apps`` (verl's run_test), ``lcb`` (LiveCodeBench's), ``mbpp`` (the assert)"""


# ----------------------------------------------------------------------------------------------- reading
def parse_tests(label) -> tuple[list[Test], str]:
    """(tests, setup code) from a label in one of the module's forms; ValueError saying what is wrong."""
    obj = _json(label, "the label") if isinstance(label, str) else label
    if isinstance(obj, str):  # JSON text stored as a JSON string
        obj = _json(obj, "the label's string")
    for wrapper in ("input_output", "ground_truth"):  # an APPS / TACO record; verl's reward_model field
        if isinstance(obj, dict) and wrapper in obj and "inputs" not in obj:
            inner = obj[wrapper]
            obj = _json(inner, repr(wrapper)) if isinstance(inner, str) else inner
    if isinstance(obj, list):
        return _lcb_tests(obj, None), ""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object (or LiveCodeBench's list of tests), got {type(obj).__name__}")
    if "public_test_cases" in obj or "private_test_cases" in obj:
        return _lcb_record(obj), ""
    if "inputs" in obj:
        return _apps(obj), ""
    if "test_list" in obj:
        return _mbpp(obj)
    raise ValueError(f"no tests in an object with keys {sorted(map(str, obj))[:8]}: expected APPS/TACO's "
                     "{inputs, outputs[, fn_name]} (bare, or under input_output or ground_truth), LiveCodeBench's "
                     "{public_test_cases, private_test_cases, metadata} or MBPP's {test_list}")


def _json(text: str, what: str):
    try:
        return json.loads(text)
    except ValueError as e:
        raise ValueError(f"{what} is not JSON ({e}): {text[:80]!r}") from None


def _text(v, what: str) -> str:
    """A stdin test's input or output: a string, or a list of lines (APPS's run_test joins them with newlines)."""
    if isinstance(v, str):
        return v
    if isinstance(v, list) and all(isinstance(x, str) for x in v):
        return "\n".join(v)
    raise ValueError(f"the {what} must be a string or a list of strings, got {type(v).__name__}: {str(v)[:60]}")


def _apps(obj: dict) -> list[Test]:
    ins, outs, fn = obj.get("inputs"), obj.get("outputs"), obj.get("fn_name")
    if not isinstance(ins, list) or not isinstance(outs, list) or len(ins) != len(outs):
        raise ValueError(f"'inputs' and 'outputs' must be lists of the same length, got {type(ins).__name__} of "
                         f"{len(ins) if isinstance(ins, list) else '-'}, {type(outs).__name__} of "
                         f"{len(outs) if isinstance(outs, list) else '-'}")
    if not ins:
        raise ValueError("no tests: 'inputs' is empty")
    if fn is not None and not (isinstance(fn, str) and fn.isidentifier()):
        raise ValueError(f"'fn_name' {fn!r} is not a function's name")
    tests = []
    for k, (i, o) in enumerate(zip(ins, outs)):
        try:
            tests.append(_apps_call(i, o, fn) if fn else Test("stdin", _text(i, "input"), _text(o, "output")))
        except ValueError as e:
            raise ValueError(f"test {k}: {e}") from None
    return tests


def _apps_call(i, o, fn: str) -> Test:
    if isinstance(i, str):  # verl / PRIME: a string of JSON lines, one an argument; its output a JSON string
        args, want = _json_lines(i), (_json(o, "the output") if isinstance(o, str) else o)
    elif isinstance(i, list):  # APPS / TACO: the argument list; its output the value (APPS wraps it: [value])
        args, want = i, o
    else:
        raise ValueError(f"a call's input must be its argument list or a string of JSON lines, got "
                         f"{type(i).__name__}")
    return Test("call", _int_keys_args(args), _int_keys_out(want), fn)


def _json_lines(text: str) -> list:
    """verl's run_test and LiveCodeBench's grade_call_based: ``[json.loads(line) for line in input.split("\\n")]``;
    an empty input is no argument, as verl's sandbox_fusion wrapper (``_execute_user_function``) reads it."""
    if not text.strip():
        return []
    out = []
    for n, line in enumerate(text.split("\n")):
        try:
            out.append(json.loads(line))
        except ValueError as e:
            raise ValueError(f"input line {n + 1} is not JSON ({e}): {line[:60]!r} (a call's input string holds "
                             "one JSON value a line, one an argument)") from None
    return out


def _int_keys_args(args: list) -> list:
    """run_test's "JSON forces dictionaries to have string keys; this undoes this (assuming a singleton list)"."""
    try:
        if isinstance(args[0], dict):
            return [{int(k): v for k, v in args[0].items()}]
    except Exception:  # noqa: BLE001 - the peer's bare except: keys that are no ints stay as they are
        pass
    return args


def _int_keys_out(want):
    try:
        if isinstance(want, dict):
            want = [{int(k): v for k, v in want.items()}]
    except Exception:  # noqa: BLE001
        pass
    try:
        if isinstance(want[0], dict):
            want = [{int(k): v for k, v in want[0].items()}]
    except Exception:  # noqa: BLE001
        pass
    return want


def _lcb_record(obj: dict) -> list[Test]:
    """CodeGenerationProblem's fields: the public and private tests (JSON, the private ones perhaps packed), and
    the function's name in ``metadata`` (get_evaluation_sample: call tests when it is set, else stdin)."""
    meta = obj.get("metadata") or {}
    meta = _json(meta, "'metadata'") if isinstance(meta, str) else meta
    if not isinstance(meta, dict):
        raise ValueError(f"'metadata' must be an object, got {type(meta).__name__}")
    cases = []
    for field in ("public_test_cases", "private_test_cases"):
        v = obj.get(field)
        if isinstance(v, str):
            v = _lcb_unpack(v, field)
        if v is not None and not isinstance(v, list):
            raise ValueError(f"{field!r} must be a list of tests, got {type(v).__name__}")
        cases += v or []
    return _lcb_tests(cases, meta.get("func_name"))


def _lcb_unpack(text: str, field: str):
    """JSON, or the packed form of code_generation_lite's private tests: base64 of zlib of a pickled JSON string,
    read with no globals allowed (a pickle that names any refuses: nothing of the label runs here)."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    import base64
    import io
    import pickle
    import zlib

    class _DataOnly(pickle.Unpickler):
        def find_class(self, module, name):
            raise pickle.UnpicklingError(f"it names {module}.{name}")

    try:
        inner = _DataOnly(io.BytesIO(zlib.decompress(base64.b64decode(text.encode(), validate=True)))).load()
    except Exception as e:  # noqa: BLE001 - binascii, zlib and pickle each raise their own
        raise ValueError(f"{field!r} is neither JSON nor LiveCodeBench's packed tests ({e}): {text[:60]!r}") from None
    if not isinstance(inner, str):
        raise ValueError(f"{field!r}: the packed tests hold {type(inner).__name__}, not a JSON string")
    return _json(inner, f"{field!r} (unpacked)")


def _lcb_tests(cases: list, fn) -> list[Test]:
    if fn is not None and not (isinstance(fn, str) and fn.isidentifier()):
        raise ValueError(f"'func_name' {fn!r} is not a function's name")
    if not cases:
        raise ValueError("no tests: the LiveCodeBench tests are empty")
    tests = []
    for k, c in enumerate(cases):
        if not isinstance(c, dict) or not {"input", "output", "testtype"} <= set(c):
            raise ValueError(f"test {k}: expected LiveCodeBench's {{input, output, testtype}}, got {str(c)[:80]}")
        if c["testtype"] not in ("stdin", "functional"):
            raise ValueError(f"test {k}: testtype {c['testtype']!r}, expected 'stdin' or 'functional'")
        if (c["testtype"] == "functional") != bool(fn):
            raise ValueError(f"test {k}: testtype {c['testtype']!r} with the function name {fn!r} (functional "
                             "tests need metadata.func_name: give LiveCodeBench's whole record)")
        if not isinstance(c["input"], str) or not isinstance(c["output"], str):
            raise ValueError(f"test {k}: its input and output must be strings")
        try:
            tests.append(Test("call", _json_lines(c["input"]), _json(c["output"], "the output"), fn, rule="lcb")
                         if fn else Test("stdin", c["input"], c["output"], rule="lcb"))
        except ValueError as e:
            raise ValueError(f"test {k}: {e}") from None
    return tests


def _mbpp(obj: dict) -> tuple[list[Test], str]:
    tl, setup = obj["test_list"], obj.get("test_setup_code") or ""
    if not isinstance(tl, list) or not tl or not all(isinstance(t, str) for t in tl):
        raise ValueError("'test_list' must be a non-empty list of assert statements")
    if not isinstance(setup, str):
        raise ValueError(f"'test_setup_code' must be a string, got {type(setup).__name__}")
    return [_assert_test(t) for t in tl], setup


def _assert_test(src: str) -> Test:
    """``assert <call> == <literal>`` -> a call test (expected kept outside); anything else runs inside."""
    try:
        node = ast.parse(src.strip()).body[0]
        if (isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare) and len(node.test.ops) == 1
                and isinstance(node.test.ops[0], ast.Eq) and isinstance(node.test.left, ast.Call)):
            expected = ast.literal_eval(node.test.comparators[0])
            return Test("call", ast.unparse(node.test.left), expected, rule="mbpp")
    except (SyntaxError, ValueError, IndexError, TypeError, MemoryError, RecursionError):
        pass
    return Test("inside", code=src, rule="mbpp")


# ----------------------------------------------------------------------------------------------- comparing
def stdout_matches(t: Test, stdout: str) -> bool:
    """A stdin test's stdout against its expected text, by its rule."""
    return (lcb_stdout_equal if t.rule == "lcb" else apps_stdout_equal)(stdout, t.expected)


def value_matches(t: Test, got) -> bool:
    """A call test's returned value (read back from its literal) against the expected one, by its rule."""
    try:
        if t.rule == "lcb":
            return lcb_call_equal(got, t.expected)
        if t.rule == "apps":
            return apps_call_equal(got, t.expected)
        return bool(got == t.expected)
    except RecursionError:
        return False


def apps_stdout_equal(stdout: str, expected: str) -> bool:
    """verl's run_test (prime_code testing_util.py) on a stdin test's output, its checks in its order: the whole
    text or its lines each stripped, equal after stripping both ends (custom_compare_); the lines against the
    expected text's non-empty lines, each stripped, then without the output's empty lines; one number a line,
    numerically as ``numpy.allclose`` (rtol 1e-5, atol 1e-8) when some line is not a plain digit string
    (combined_int_check). APPS's run_test (eval/testing_util.py) ends with two more checks, lines compared as sets
    of their tokens and as sets of numbers rounded to 3 places: order-blind (an unsorted line passes a sorting
    task), verl dropped them and so does this."""
    out = stdout.splitlines()
    whole = expected.strip()
    if "\n".join(out).strip() == whole or "\n".join(x.strip() for x in out).strip() == whole:
        return True
    want = [x.strip() for x in expected.split("\n") if x]
    if out == want:
        return True
    out = [x for x in out if x]
    if out == want:
        return True
    if len(out) != len(want) or all(a.isdigit() and b.isdigit() for a, b in zip(out, want)):
        return False
    try:
        return _allclose([float(x) for x in out], [float(x) for x in want])
    except ValueError:
        return False


def _allclose(a: list[float], b: list[float]) -> bool:
    """numpy.allclose(a, b) with its defaults: ``|a - b| <= 1e-8 + 1e-5 * |b|``; an infinity equals only itself,
    NaN nothing."""
    for x, y in zip(a, b):
        if math.isinf(x) or math.isinf(y):
            if x != y:
                return False
        elif not abs(x - y) <= 1e-8 + 1e-5 * abs(y):  # NaN: False
            return False
    return True


def lcb_stdout_equal(stdout: str, expected: str) -> bool:
    """LiveCodeBench's grade_stdio: both texts stripped, split in lines, each stripped (get_stripped_lines); as
    many lines; each line equal, or its tokens equal as Decimals (convert_line_to_decimals: exact, no tolerance)."""
    got = [x.strip() for x in stdout.strip().split("\n")]
    want = [x.strip() for x in expected.strip().split("\n")]
    if len(got) != len(want):
        return False
    for a, b in zip(got, want):
        if a == b:
            continue
        try:
            if [Decimal(x) for x in a.split()] != [Decimal(x) for x in b.split()]:
                return False
        except Exception:  # noqa: BLE001 - not numbers (the peer's bare except); a signalling NaN compared
            return False
    return True


def apps_call_equal(got, want) -> bool:
    """verl's (and APPS's) run_test on a call's value: a tuple as a list; equal to the expected value, or to its
    first element (APPS stores ``[value]``), or, a list of tuples, its lists equal to that first element."""
    if isinstance(got, tuple):
        got = list(got)
    ok = got == want
    if isinstance(want, list) and want:
        ok = ok or got == want[0]
    try:
        if isinstance(got[0], tuple):
            ok = ok or [list(x) for x in got] == want[0]
    except Exception:  # noqa: BLE001 - the peer's bare except
        pass
    return ok is True


def lcb_call_equal(got, want) -> bool:
    """LiveCodeBench's grade_call_based: a tuple as a list, then ``==`` with the expected JSON value."""
    if isinstance(got, tuple):
        got = list(got)
    return bool(got == want)
