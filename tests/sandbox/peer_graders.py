"""The peers' graders, written out from their source (not from ours) for the tests that check the code reward's
verdicts against theirs (tests/sandbox/test_graders.py). Each function is the peer's own code block, its names and
order kept, with its debug prints left out, ``continue`` / ``return results, ...`` turned into the verdict
(``True`` only where the peer appends ``True``) and the program's run replaced by its output (a stdin test's
captured stdout) or by a call of the function (a call test: the programs are this suite's own, run in this process
as the peers run them). What else changed is said where it is.

* verl (volcengine/verl at b178a3cd, 2026-01-29; the file last changed at eac4863a), Apache-2.0, Copyright 2024
  PRIME team and/or its affiliates: ``verl/utils/reward_score/prime_code/testing_util.py`` (``run_test``,
  ``custom_compare_``, ``stripped_string_compare``, ``only_int_check``, ``string_int_check``,
  ``combined_int_check``).
* APPS (hendrycks/apps at 362aedc3, 2024-06-19), MIT, Copyright (c) 2021 Dan Hendrycks: ``eval/testing_util.py``
  (``run_test``, ``custom_compare_``, ``stripped_string_compare``).
* LiveCodeBench (LiveCodeBench/LiveCodeBench at 28fef95e, 2025-07-15), MIT, Copyright (c) 2024 LiveCodeBench:
  ``lcb_runner/evaluation/testing_util.py`` (``import_string``, ``grade_stdio``, ``grade_call_based``,
  ``get_stripped_lines``, ``convert_line_to_decimals``, ``compile_code``, ``get_function``) and
  ``lcb_runner/benchmarks/code_generation.py`` (``CodeGenerationProblem.__post_init__``'s reading of the tests,
  ``get_evaluation_sample``).

The MIT notices: Permission is hereby granted, free of charge, to any person obtaining a copy of this software and
associated documentation files (the "Software"), to deal in the Software without restriction, including without
limitation the rights to use, copy, modify, merge, publish, distribute, sublicense, and/or sell copies of the
Software, and to permit persons to whom the Software is furnished to do so, subject to the following conditions:
The above copyright notice and this permission notice shall be included in all copies or substantial portions of
the Software. THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR IMPLIED, INCLUDING BUT NOT
LIMITED TO THE WARRANTIES OF MERCHANTABILITY, FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT
SHALL THE AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER LIABILITY, WHETHER IN AN ACTION OF
CONTRACT, TORT OR OTHERWISE, ARISING FROM, OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN
THE SOFTWARE."""
from __future__ import annotations

import base64
import json
import pickle
import zlib
from decimal import Decimal
from types import ModuleType

import numpy as np


# ------------------------------------------------------------------------------------------- verl (prime_code)
def only_int_check(val):
    return isinstance(val, int)


def string_int_check(val):
    return isinstance(val, str) and val.isdigit()


def combined_int_check(val):
    return only_int_check(val) or string_int_check(val)


def custom_compare_(output, ground_truth):  # verl's and APPS's are the same function
    if isinstance(output, list):
        output_1 = "\n".join(output)
        if stripped_string_compare(output_1, ground_truth):
            return True

    if isinstance(output, list):
        output_2 = [o.lstrip().rstrip() for o in output]
        output_2 = "\n".join(output_2)
        if stripped_string_compare(output_2, ground_truth):
            return True

    return False


def stripped_string_compare(s1, s2):
    s1 = s1.lstrip().rstrip()
    s2 = s2.lstrip().rstrip()
    return s1 == s2


def verl_stdin(captured: str, expected) -> bool:
    """verl run_test, the standard-input branch from ``if isinstance(in_outs["outputs"][index], list)`` (the
    expected list joined) to its verdict; ``captured`` is ``output[0]``, what Capturing read."""
    in_outs, index = {"outputs": [expected]}, 0
    if isinstance(in_outs["outputs"][index], list):
        in_outs["outputs"][index] = "\n".join(in_outs["outputs"][index])
    raw_true_output = captured
    output = raw_true_output.splitlines()
    if custom_compare_(output, in_outs["outputs"][index]):
        return True
    if isinstance(output, tuple):
        output = list(output)
    tmp_result = False
    try:
        tmp_result = output == [in_outs["outputs"][index]]
        if isinstance(in_outs["outputs"][index], list):
            tmp_result = tmp_result or (output == in_outs["outputs"][index])
            if isinstance(output[0], str):
                tmp_result = tmp_result or ([e.strip() for e in output] == in_outs["outputs"][index])
    except Exception:
        pass
    if tmp_result is True:
        return True
    # try one more time without \n
    if isinstance(in_outs["outputs"][index], list):
        for tmp_index, i in enumerate(in_outs["outputs"][index]):
            in_outs["outputs"][index][tmp_index] = i.split("\n")
            in_outs["outputs"][index][tmp_index] = [x.strip() for x in in_outs["outputs"][index][tmp_index] if x]
    else:
        in_outs["outputs"][index] = in_outs["outputs"][index].split("\n")
        in_outs["outputs"][index] = list(filter(len, in_outs["outputs"][index]))
        in_outs["outputs"][index] = list(map(lambda x: x.strip(), in_outs["outputs"][index]))
    try:
        tmp_result = output == [in_outs["outputs"][index]]
        if isinstance(in_outs["outputs"][index], list):
            tmp_result = tmp_result or (output == in_outs["outputs"][index])
    except Exception:
        pass
    if tmp_result is True:
        return True
    # try by converting the output into a split up list too
    if isinstance(output, list):
        output = list(filter(len, output))
    try:
        tmp_result = output == [in_outs["outputs"][index]]
        if isinstance(in_outs["outputs"][index], list):
            tmp_result = tmp_result or (output == in_outs["outputs"][index])
    except Exception:
        pass
    try:
        all_ints = all(
            combined_int_check(e1) and combined_int_check(e2)
            for e1, e2 in zip(output, in_outs["outputs"][index], strict=True)
        )
        if not all_ints:
            output_float = [float(e) for e in output]
            gt_float = [float(e) for e in in_outs["outputs"][index]]
            tmp_result = tmp_result or (
                (len(output_float) == len(gt_float)) and np.allclose(output_float, gt_float)
            )
    except Exception:
        pass
    try:
        if isinstance(output[0], list):
            all_ints = all(
                combined_int_check(e1) and combined_int_check(e2)
                for e1, e2 in zip(output[0], in_outs["outputs"][index], strict=True)
            )
            if not all_ints:
                output_float = [float(e) for e in output[0]]
                gt_float = [float(e) for e in in_outs["outputs"][index][0]]
                tmp_result = tmp_result or (
                    (len(output_float) == len(gt_float)) and np.allclose(output_float, gt_float)
                )
    except Exception:
        pass
    if tmp_result is True:
        return True
    # try by converting the stuff into split up list
    if isinstance(in_outs["outputs"][index], list):
        for tmp_index, i in enumerate(in_outs["outputs"][index]):
            in_outs["outputs"][index][tmp_index] = set(i.split())
    else:
        in_outs["outputs"][index] = set(in_outs["outputs"][index].split())
    try:
        tmp_result = output == in_outs["outputs"][index]
    except Exception:
        return False  # the peer's ``continue``: no verdict appended, the test not passed
    return tmp_result is True  # what follows in the peer converts ``output`` and appends ``tmp_result`` unchanged


VERL_SOL = ("from string import *\nfrom re import *\nfrom datetime import *\nfrom collections import *\n"
            "from heapq import *\nfrom bisect import *\nfrom copy import *\nfrom math import *\n"
            "from random import *\nfrom statistics import *\nfrom itertools import *\nfrom functools import *\n"
            "from operator import *\nfrom io import *\nfrom sys import *\nfrom json import *\n"
            "from builtins import *\nfrom typing import *\nimport string\nimport re\nimport datetime\n"
            "import collections\nimport heapq\nimport bisect\nimport copy\nimport math\nimport random\n"
            "import statistics\nimport itertools\nimport functools\nimport operator\nimport io\nimport sys\n"
            "import json\n")
"""run_test's ``sol``, less its ``sys.setrecursionlimit(6*10**5)`` (not to change this test process's)."""


def _module(sol: str, test: str):
    """RuntimeModule.from_string("tmp_sol", "", sol) (pyext), then ``tmp = tmp_sol if "class Solution" not in
    test else tmp_sol.Solution()``."""
    tmp_sol = ModuleType("tmp_sol", "")
    exec(sol, tmp_sol.__dict__)  # noqa: S102 - this suite's own programs, as the peers run them
    return tmp_sol if "class Solution" not in test else tmp_sol.Solution()


def verl_call(test: str, fn_name: str, inputs: str, output: str) -> bool:
    """verl run_test, the call-based branch, for one test: the program compiled after ``sol``, the method got, the
    input's JSON lines and the output's JSON read, the dict keys made ints, the call and its checks."""
    method = getattr(_module(VERL_SOL + test, test), fn_name)
    in_outs, index = {"inputs": [inputs], "outputs": [output]}, 0
    inputs = [json.loads(line) for line in inputs.split("\n")]
    in_outs["outputs"][index] = json.loads(in_outs["outputs"][index])
    return _apps_call_checks(method, inputs, in_outs, index)


def _apps_call_checks(method, inputs, in_outs, index) -> bool:
    """The part verl's run_test and APPS's share (APPS's ``except: True`` written ``except Exception: pass``)."""
    # JSON forces dictionaries to have string keys; this undoes this (assuming a singleton list)
    try:
        if isinstance(inputs[0], dict):
            inputs = [{int(k): v for k, v in inputs[0].items()}]
    except Exception:
        pass
    try:
        if isinstance(in_outs["outputs"][index], dict):
            in_outs["outputs"][index] = [{int(k): v for k, v in in_outs["outputs"][index].items()}]
    except Exception:
        pass
    try:
        if isinstance(in_outs["outputs"][index][0], dict):
            in_outs["outputs"][index] = [{int(k): v for k, v in in_outs["outputs"][index][0].items()}]
    except Exception:
        pass
    try:
        output = method(*inputs)
        # ground truth sequences are not tuples
        if isinstance(output, tuple):
            output = list(output)
        tmp_result = output == in_outs["outputs"][index]
        if isinstance(in_outs["outputs"][index], list) and in_outs["outputs"][index]:
            tmp_result = tmp_result or (output == in_outs["outputs"][index][0])
        # ground truth sequences are not tuples
        try:
            if isinstance(output[0], tuple):
                tmp_result = tmp_result or ([list(x) for x in output] == in_outs["outputs"][index][0])
        except Exception:
            pass
    except Exception:
        return False  # results.append(-1)
    return tmp_result is True


# ------------------------------------------------------------------------------------------------------ APPS
APPS_SOL = ("import sys\nimport time\nimport itertools\nfrom itertools import accumulate, product, permutations, "
            "combinations\nimport collections\nfrom collections import Counter, OrderedDict, deque, defaultdict, "
            "ChainMap\nfrom functools import lru_cache\nimport math\nfrom math import sqrt, sin, cos, tan, ceil, "
            "fabs, floor, gcd, exp, log, log2\nimport fractions\nfrom typing import List, Tuple\nimport numpy as np\n"
            "import random\nimport heapq\nfrom heapq import *\n")


def apps_call(test: str, fn_name: str, inputs: list, output) -> bool:
    """APPS run_test, the call-based branch, for one test (its inputs the argument list, as stored)."""
    method = getattr(_module(APPS_SOL + test, test), fn_name)
    return _apps_call_checks(method, inputs, {"inputs": [inputs], "outputs": [output]}, 0)


def apps_stdin(captured: str, expected) -> bool:
    """APPS run_test, the standard-input branch after the run; its Capturing extends the list with the captured
    text's ``splitlines()``. Its checks 1-4 are verl's (less verl's integer guard); then checks 5 and 6."""
    in_outs, index = {"outputs": [expected]}, 0
    if isinstance(in_outs['outputs'][index], list):
        in_outs['outputs'][index] = "\n".join(in_outs['outputs'][index])
    output = captured.splitlines()
    if custom_compare_(output, in_outs['outputs'][index]):
        return True
    if isinstance(output, tuple):
        output = list(output)
    tmp_result = False
    try:
        tmp_result = (output == [in_outs["outputs"][index]])
        if isinstance(in_outs["outputs"][index], list):
            tmp_result = tmp_result or (output == in_outs["outputs"][index])
            if isinstance(output[0], str):
                tmp_result = tmp_result or ([e.strip() for e in output] == in_outs["outputs"][index])
    except Exception:
        pass
    if tmp_result == True:  # noqa: E712 - the peer's
        return True
    if isinstance(in_outs["outputs"][index], list):
        for tmp_index, i in enumerate(in_outs["outputs"][index]):
            in_outs["outputs"][index][tmp_index] = i.split("\n")
            in_outs["outputs"][index][tmp_index] = [x.strip() for x in in_outs["outputs"][index][tmp_index] if x]
    else:
        in_outs["outputs"][index] = in_outs["outputs"][index].split("\n")
        in_outs["outputs"][index] = list(filter(len, in_outs["outputs"][index]))
        in_outs["outputs"][index] = list(map(lambda x: x.strip(), in_outs["outputs"][index]))
    try:
        tmp_result = (output == [in_outs["outputs"][index]])
        if isinstance(in_outs["outputs"][index], list):
            tmp_result = tmp_result or (output == in_outs["outputs"][index])
    except Exception:
        pass
    if tmp_result == True:  # noqa: E712
        return True
    if isinstance(output, list):
        output = list(filter(len, output))
    if tmp_result == True:  # noqa: E712
        return True
    try:
        tmp_result = (output == [in_outs["outputs"][index]])
        if isinstance(in_outs["outputs"][index], list):
            tmp_result = tmp_result or (output == in_outs["outputs"][index])
    except Exception:
        pass
    try:
        output_float = [float(e) for e in output]
        gt_float = [float(e) for e in in_outs['outputs'][index]]
        tmp_result = tmp_result or ((len(output_float) == len(gt_float)) and np.allclose(output_float, gt_float))
    except Exception:
        pass
    try:
        if isinstance(output[0], list):
            output_float = [float(e) for e in output[0]]
            gt_float = [float(e) for e in in_outs['outputs'][index][0]]
            tmp_result = tmp_result or ((len(output_float) == len(gt_float)) and np.allclose(output_float, gt_float))
    except Exception:
        pass
    if tmp_result == True:  # noqa: E712
        return True
    if isinstance(in_outs["outputs"][index], list):
        for tmp_index, i in enumerate(in_outs["outputs"][index]):
            in_outs["outputs"][index][tmp_index] = set(i.split())
    else:
        in_outs["outputs"][index] = set(in_outs["outputs"][index].split())
    try:
        tmp_result = (output == in_outs["outputs"][index])
    except Exception:
        return False  # continue
    if tmp_result == True:  # noqa: E712
        return True
    if isinstance(output, list):
        for tmp_index, i in enumerate(output):
            output[tmp_index] = i.split()
        output = list(filter(len, output))
        for tmp_index, i in enumerate(output):
            output[tmp_index] = set(i)
    else:
        output = output.split()
        output = list(filter(len, output))
        output = set(output)
    try:
        tmp_result = (set(frozenset(s) for s in output) == set(frozenset(s) for s in in_outs["outputs"][index]))
    except Exception:
        pass
    # if they are all numbers, round so that similar numbers are treated as identical
    try:
        tmp_result = tmp_result or (set(frozenset(round(float(t), 3) for t in s) for s in output) ==
                                    set(frozenset(round(float(t), 3) for t in s) for s in in_outs["outputs"][index]))
    except Exception:
        pass
    return tmp_result == True  # noqa: E712


# --------------------------------------------------------------------------------------------- LiveCodeBench
import_string = VERL_SOL  # LiveCodeBench's import_string is verl's sol with sys.setrecursionlimit(50000), left out


def convert_line_to_decimals(line: str) -> tuple[bool, list[Decimal]]:
    try:
        decimal_line = [Decimal(elem) for elem in line.split()]
    except:  # noqa: E722 - the peer's
        return False, []
    return True, decimal_line


def get_stripped_lines(val: str):
    ## you don't want empty lines to add empty list after splitlines!
    val = val.strip()

    return [val_line.strip() for val_line in val.split("\n")]


def lcb_stdin(prediction: str, gt_out: str) -> bool:
    """grade_stdio, from ``stripped_prediction_lines = ...`` to its verdict for one test (an exception there ends
    run_test with -4: not passed)."""
    try:
        stripped_prediction_lines = get_stripped_lines(prediction)
        stripped_gt_out_lines = get_stripped_lines(gt_out)
        if len(stripped_prediction_lines) != len(stripped_gt_out_lines):
            return False
        for stripped_prediction_line, stripped_gt_out_line in zip(stripped_prediction_lines, stripped_gt_out_lines):
            ## CASE 1: exact match
            if stripped_prediction_line == stripped_gt_out_line:
                continue
            ## CASE 2: element-wise comparision
            success, decimal_prediction_line = convert_line_to_decimals(stripped_prediction_line)
            if not success:
                return False
            success, decimal_gtout_line = convert_line_to_decimals(stripped_gt_out_line)
            if not success:
                return False
            if decimal_prediction_line == decimal_gtout_line:
                continue
            return False
        return True
    except Exception:
        return False


def lcb_call(code: str, fn_name: str, inputs: str, output: str) -> bool:
    """grade_call_based for one test: compile_code (``Solution()`` when "class Solution" in the code), get_function,
    the input's JSON lines and the output's JSON, the call, a tuple as a list, ``==``."""
    code = import_string + "\n\n" + code
    method = getattr(_module(code, code), fn_name)
    gt_inp = [json.loads(line) for line in inputs.split("\n")]
    gt_out = json.loads(output)
    try:
        prediction = method(*gt_inp)
        # don't penalize model if it produces tuples instead of lists
        # ground truth sequences are not tuples
        if isinstance(prediction, tuple):
            prediction = list(prediction)
        tmp_result = prediction == gt_out
    except Exception:
        return False  # -4, runtime error
    return bool(tmp_result)


def lcb_evaluation_sample(record: dict) -> dict:
    """CodeGenerationProblem.__post_init__'s reading of the tests (the private ones JSON, else base64 of zlib of a
    pickle: this suite's own data here) and get_evaluation_sample's ``input_output``, as an object."""
    public_test_cases = json.loads(record["public_test_cases"])
    try:
        private_test_cases = json.loads(record["private_test_cases"])
    except Exception:
        private_test_cases = json.loads(pickle.loads(zlib.decompress(
            base64.b64decode(record["private_test_cases"].encode("utf-8")))))
    metadata = json.loads(record["metadata"])
    tests = public_test_cases + private_test_cases
    return {"inputs": [t["input"] for t in tests], "outputs": [t["output"] for t in tests],
            "fn_name": metadata.get("func_name", None)}
