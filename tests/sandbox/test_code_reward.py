"""The code reward (``--reward_fn code``, rlhf.sandbox.code_reward) on the formats it reads, each checked against a
hand-made verdict; the SandboxFusion client against a server of the same API (rlhf.sandbox.fusion; no SandboxFusion
service can be started here: its runtimes are container images), which must give the local sandbox's verdicts; and
the reward in a real PPO job (launch/ppo.py) with dynamic filtering and partial rollouts."""
from __future__ import annotations

import json
import os
import threading

import pytest

from rlhf.sandbox import probe
from rlhf.sandbox.code_reward import CodeRewardConfig, code_reward, extract_program, grade, parse_tests

if any(probe().values()):
    msg = "sandbox layers missing: " + "; ".join(f"{k}: {v}" for k, v in probe().items() if v)
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true: {msg}", pytrace=False)
    pytest.skip(msg, allow_module_level=True)

APPS_STDIN = json.dumps({"inputs": ["1 2\n", "10 -3\n"], "outputs": ["3\n", "7\n"]})
APPS_CALL = json.dumps({"input_output": json.dumps({"inputs": [[1, 2], [5, 6]], "outputs": [[3], [11]],
                                                    "fn_name": "add"})})
MBPP = json.dumps({"test_list": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0",
                                 "assert isinstance(add(2, 2), int)"], "test_setup_code": "import math"})
GOOD_STDIN = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
GOOD_FN = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."


def test_formats_and_verdicts():
    cases = [  # (reply, label, verdicts)
        (GOOD_STDIN, APPS_STDIN, ["passed", "passed"]),
        ("print(3)", APPS_STDIN, ["passed", "wrong_answer"]),
        (GOOD_FN, APPS_CALL, ["passed", "passed"]),
        (GOOD_FN, MBPP, ["passed", "passed", "passed"]),
        ("def add(a, b):\n    return a - b", MBPP, ["wrong_answer", "wrong_answer", "passed"]),
        ("def add(a, b) return a + b", MBPP, ["compile_error"] * 3),
        ("def add(a, b):\n    raise ValueError", APPS_CALL, ["runtime_error"] * 2),
        ("import time\ndef add(a, b):\n    time.sleep(30)", APPS_CALL, ["timeout"] * 2),
        ("import os\nos._exit(0)", MBPP, ["wrong_answer"] * 3),  # exiting early passes no test, inside ones too
        ("x = bytearray(8 << 30)", APPS_STDIN, ["memory"] * 2),
        ("", MBPP, ["no_code"] * 3),
    ]
    # 5 s (the flag's default): the limit counts the sandboxed interpreter's start, which took up to 3.2 s in a loaded
    # suite on the 2-core AMD EPYC (tests/sandbox/test_sandbox_attacks.py's CFG); the sleeping case times out all the same
    cfg = CodeRewardConfig(code_timeout_s=5.0, code_memory_mb=256, code_sandbox_workers=2)
    rewards, verdicts = grade([c[0] for c in cases], [c[1] for c in cases], cfg)
    assert verdicts == [c[2] for c in cases], verdicts
    assert rewards == [sum(v == "passed" for v in c[2]) / len(c[2]) for c in cases]
    all_pass, _ = grade([c[0] for c in cases[:5]], [c[1] for c in cases[:5]],
                        CodeRewardConfig(code_reward_mode="all_pass", code_timeout_s=5.0))
    assert all_pass == [1.0, 0.0, 1.0, 1.0, 0.0]


def test_call_tests_keep_the_expected_values_outside():
    tests, setup = parse_tests(MBPP)
    assert [t.kind for t in tests] == ["call", "call", "inside"] and setup == "import math"
    assert tests[0].input == "add(1, 2)" and tests[0].expected == 3
    assert extract_program("a ```py\nx = 1\n``` b ```python\ny = 2\n```") == "y = 2\n"
    assert extract_program("no fence at all") == "no fence at all"
    with pytest.raises(ValueError, match="same length"):
        parse_tests({"inputs": ["1"], "outputs": []})
    with pytest.raises(ValueError, match="APPS/TACO"):
        parse_tests({"question": "x"})


def test_reward_function_shape_and_counted_reasons():
    out = code_reward(["p", "p"], [GOOD_FN, "def add(a, b) return"], labels=[MBPP, MBPP])
    assert out["rewards"] == [1.0, 0.0] and out["scores"] == out["rewards"]
    logs = out["extra_logs"]
    assert logs["code_passed"] == pytest.approx(0.5) and logs["code_compile_error"] == pytest.approx(0.5)
    assert logs["code_tests_in_sandbox"] == 2.0 and sum(logs[f"code_{r}"] for r in ("passed", "wrong_answer",
                                                                               "runtime_error", "compile_error",
                                                                               "timeout", "memory", "output_limit",
                                                                               "no_code", "sandbox_refused")) == 1
    with pytest.raises(ValueError, match="--label_key"):
        code_reward(["p"], [GOOD_FN])


def test_sandboxfusion_client_gives_the_local_verdicts():
    """The client speaks SandboxFusion's run_code (verl's request shape) to a server of that API here; both sides
    agree with the local sandbox on ok, wrong, crash and timeout. Control: a client pointed at a closed port
    reports the service's absence, not a verdict of the program."""
    from rlhf.sandbox import SandboxConfig, run_program
    from rlhf.sandbox.fusion import FusionClient, make_server

    srv = make_server("127.0.0.1", 0)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        client = FusionClient(f"http://127.0.0.1:{srv.server_address[1]}/run_code")
        # 5 s where the program ends at once (room for a loaded machine's start, as above); 2 s for the sleeper
        for program, stdin, limit in (("print(input()[::-1])", "abc", 5.0), ("raise SystemExit(3)", "", 5.0),
                                      ("import time; time.sleep(30)", "", 2.0), ("print(", "", 5.0)):
            cfg = SandboxConfig(timeout_s=limit, memory_mb=256)
            remote, local = client.run(program, stdin, cfg), run_program(program, stdin, cfg)
            assert (remote.status, remote.exit_code, remote.stdout) == (local.status, local.exit_code,
                                                                       local.stdout), (program, remote, local)
            assert remote.isolation == [f"SandboxFusion {client.url}"]
        rewards, verdicts = grade([GOOD_FN, "def add(a, b): return 0"], [MBPP, MBPP],
                                  CodeRewardConfig(code_sandbox_url=client.url, code_timeout_s=10.0))
        # 10 s: these programs end at once; a 2 s limit timed one out while the other pytest worker loaded the machine
        assert rewards == pytest.approx([1.0, 2 / 3]) and verdicts[1] == ["wrong_answer", "passed", "passed"], \
            (rewards, verdicts)
    finally:
        srv.shutdown()
        srv.server_close()
    from helpers import free_port

    dead = FusionClient(f"http://127.0.0.1:{free_port()}/run_code", retries=1)
    r = dead.run("print(1)", "", SandboxConfig(timeout_s=1.0))
    assert r.status == "error" and r.exit_code is None and "did not answer" in r.reason, r
