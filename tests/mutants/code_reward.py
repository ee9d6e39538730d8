"""Planted bugs of the code reward's grading (rlhf/sandbox/code_reward.py, rlhf/sandbox/graders.py): each breaks one
claim of grading as the peers' graders do (verl's prime_code run_test, APPS's and LiveCodeBench's testing_util), or
of reading every label or naming it. The tests named are tests/sandbox/test_graders.py's: the table of cases (run in
the sandbox, against the peers' verdicts), the random outputs and values (no sandbox) and the unreadable labels."""
from tests.mutants import Mutant

G = "tests/sandbox/test_graders.py::"
TABLE = G + "test_the_table_of_cases_grades_as_the_peers"
RANDOM_STDOUT = G + "test_the_comparisons_equal_the_peers_on_random_outputs"
RANDOM_VALUES = G + "test_call_values_cross_the_sandbox_and_compare_as_the_peers"
UNREADABLE = G + "test_a_label_that_cannot_be_read_is_an_error_naming_its_record"
INPUTS = G + "test_call_inputs_are_read_as_the_peers_read_them"

MUTANTS = [
    Mutant("code_reward-no-numeric-tolerance", "rlhf/sandbox/graders.py",
           find='''        elif not abs(x - y) <= 1e-8 + 1e-5 * abs(y):  # NaN: False''',
           replace='''        elif not x == y:''',
           claim="a number printed with other digits passes within numpy.allclose's tolerance, as verl's run_test",
           tests=(TABLE, RANDOM_STDOUT)),
    Mutant("code_reward-no-integer-guard", "rlhf/sandbox/graders.py",
           find='''    if len(out) != len(want) or all(a.isdigit() and b.isdigit() for a, b in zip(out, want)):''',
           replace='''    if len(out) != len(want):''',
           claim="lines of plain digits are not compared as numbers (verl's combined_int_check): 05 is not 5",
           tests=(TABLE, RANDOM_STDOUT)),
    Mutant("code_reward-no-whitespace-rule", "rlhf/sandbox/graders.py",
           find='''    if "\\n".join(out).strip() == whole or "\\n".join(x.strip() for x in out).strip() == whole:''',
           replace='''    if "\\n".join(out) == expected:''',
           claim="spaces around lines and blank lines around the text do not count (verl's custom_compare_)",
           tests=(TABLE, RANDOM_STDOUT)),
    Mutant("code_reward-blank-lines-count", "rlhf/sandbox/graders.py",
           find='''    out = [x for x in out if x]
''',
           replace='''    out = list(out)
''',
           claim="empty output lines between lines do not count (verl's run_test filters them)",
           tests=(TABLE, RANDOM_STDOUT)),
    Mutant("code_reward-apps-order-blind", "rlhf/sandbox/graders.py",
           find='''        return _allclose([float(x) for x in out], [float(x) for x in want])
    except ValueError:
        return False''',
           replace='''        return _allclose([float(x) for x in out], [float(x) for x in want])
    except ValueError:
        return {frozenset(x.split()) for x in out} == {frozenset(x.split()) for x in want}''',
           claim="tokens out of order stay wrong (APPS's set checks, which verl dropped, are not followed)",
           tests=(TABLE, RANDOM_STDOUT)),
    Mutant("code_reward-lcb-stdout-with-tolerance", "rlhf/sandbox/graders.py",
           find='''    return (lcb_stdout_equal if t.rule == "lcb" else apps_stdout_equal)(stdout, t.expected)''',
           replace='''    return apps_stdout_equal(stdout, t.expected)''',
           claim="LiveCodeBench stdin tests are graded by its grade_stdio (exact Decimals, no tolerance)",
           tests=(TABLE, RANDOM_STDOUT)),
    Mutant("code_reward-json-lines-as-one-string", "rlhf/sandbox/graders.py",
           find='''        args, want = _json_lines(i), (_json(o, "the output") if isinstance(o, str) else o)''',
           replace='''        args, want = [i], o''',
           claim="a call input string holds JSON lines, one an argument, its output a JSON string (verl / PRIME)",
           tests=(TABLE, RANDOM_VALUES, INPUTS)),
    Mutant("code_reward-lcb-functional-one-string", "rlhf/sandbox/graders.py",
           find='''            tests.append(Test("call", _json_lines(c["input"]), _json(c["output"], "the output"), fn, rule="lcb")''',
           replace='''            tests.append(Test("call", [c["input"]], _json(c["output"], "the output"), fn, rule="lcb")''',
           claim="a LiveCodeBench functional test's input is JSON lines, one an argument (grade_call_based)",
           tests=(TABLE, INPUTS)),
    Mutant("code_reward-lcb-functional-unwraps", "rlhf/sandbox/graders.py",
           find='''        if t.rule == "lcb":
            return lcb_call_equal(got, t.expected)''',
           replace='''        if t.rule == "lcb":
            return apps_call_equal(got, t.expected)''',
           claim="a LiveCodeBench functional value is compared with == (no APPS [value] unwrapping)",
           tests=(TABLE, RANDOM_VALUES)),
    Mutant("code_reward-no-int-keys", "rlhf/sandbox/graders.py",
           find='''    return Test("call", _int_keys_args(args), _int_keys_out(want), fn)''',
           replace='''    return Test("call", _int_keys_args(args), want, fn)''',
           claim="an expected dict's JSON string keys are made ints, as APPS's and verl's run_test do",
           tests=(TABLE, RANDOM_VALUES, INPUTS)),
    Mutant("code_reward-tuples-cross-as-lists", "rlhf/sandbox/code_reward.py",
           find='''        return "(" + "".join(_rlhf_lit(x) + ", " for x in v) + ")"''',
           replace='''        return "[" + ", ".join(map(_rlhf_lit, v)) + "]"''',
           claim="a returned tuple reaches the host as a tuple (MBPP's assert and LiveCodeBench tell it from a list)",
           tests=(TABLE, RANDOM_VALUES)),
    Mutant("code_reward-no-class-solution", "rlhf/sandbox/code_reward.py",
           find='''        fn = f"Solution().{t.fn_name}" if "class Solution" in program else t.fn_name''',
           replace='''        fn = t.fn_name''',
           claim="a call test's function is the method of the program's class Solution when it has one",
           tests=(TABLE,)),
    Mutant("code_reward-no-prelude", "rlhf/sandbox/code_reward.py",
           find='''(PRELUDE + "\\n" if t.rule in ("apps", "lcb") else "")''',
           replace='''""''',
           claim="APPS and LiveCodeBench programs run after the imports their graders put first (typing's List)",
           tests=(TABLE, G + "test_the_prelude_is_the_peers_imports")),
    Mutant("code_reward-unreadable-label-is-zero", "rlhf/sandbox/code_reward.py",
           find='''        raise ValueError(f"--reward_fn code: the tests of {who} cannot be read: {e}; its label: {_cut(label)!r}") \\
            from None''',
           replace='''        return [], ""''',
           claim="a label that cannot be read stops the step with an error naming its record, never a silent 0",
           tests=(UNREADABLE,)),
    Mutant("code_reward-empty-tests-read", "rlhf/sandbox/graders.py",
           find='''    if not ins:
        raise ValueError("no tests: 'inputs' is empty")''',
           replace='''    if not ins:
        return []''',
           claim="a label with no tests is an error, not a reward of 0",
           tests=(UNREADABLE,)),
    Mutant("code_reward-expected-in-the-sandbox", "rlhf/sandbox/code_reward.py",
           find='''        return body + _LITERAL + _CALL.format(call=call), ""''',
           replace='''        return body + _LITERAL + _CALL.format(call=call) + "#" + repr(t.expected), ""''',
           claim="a call test's expected value never enters the sandbox",
           tests=(G + "test_expected_outputs_never_enter_the_sandbox",)),
]
