"""Partial rollouts (``rlhf.rollout.partial``, issue 44) in a real in-process vLLM engine, against vLLM's own
``LLM.generate``: with nothing stopped early the round is bit-identical to the synchronous generation (the K = 0
case); stopped once one group is whole, vLLM's abort leaves no request in the engine, the carried samples keep
exactly the prefix the full round had sampled, with version 0 on every token, and continue at version 1 to their
end. One engine start in a child process (about 10 s)."""
import json
import os

import pytest
from helpers import REPO, require, run_python, tail
from rlhf.distributed.env import free_port

require("vllm")
pytestmark = pytest.mark.timeout(300)
WORKER = os.path.join(REPO, "tests/ppo/_partial_worker.py")


@pytest.fixture(scope="module")
def result(ppo_setup):
    p = run_python([WORKER, ppo_setup["actor"]], timeout=240, VLLM_ENABLE_V1_MULTIPROCESSING="0",
                   PORT=str(free_port()))
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and line, tail(p)
    return json.loads(line[-1][len("RESULT "):])


def test_nothing_stopped_is_vllms_own_generation_bit_for_bit(result):
    full, ref = result["full"], result["ref"]
    assert [[s["ids"] for s in g] for g in full] == [[s["ids"] for s in g] for g in ref]
    assert [[s["lps"] for s in g] for g in full] == [[s["lps"] for s in g] for g in ref]
    assert all(s["done"] and s["v"] == [0] * len(s["ids"]) for g in full for s in g)
    assert result["counts"][0]["aborted"] == 0
    # Negative control: the same round with each group seeded as the next prompt is not vLLM's generation.
    assert [[s["ids"] for s in g] for g in result["shifted"]] != [[s["ids"] for s in g] for g in ref]


def test_stopped_round_carries_the_sampled_prefix_and_continues(result):
    full, stopped, resumed = result["full"], result["stopped"], result["resumed"]
    whole = [all(s["done"] for s in g) for g in stopped]
    assert sum(whole) >= 1, "the round stopped before one group was whole"
    aborted = result["counts"][1]["aborted"]
    assert aborted >= 1, "nothing was aborted: the test's lengths no longer leave a tail"
    assert aborted == sum(not s["done"] for g in stopped for s in g)
    assert result["unfinished_after_abort"] == 0, "vLLM still holds the aborted requests"
    for gs, gf in zip(stopped, full):
        for s, f in zip(gs, gf):
            assert s["ids"] == f["ids"][:len(s["ids"])] and s["lps"] == f["lps"][:len(s["lps"])]
            assert s["v"] == [0] * len(s["ids"])
            if s["done"]:
                assert s["ids"] == f["ids"]
    # Continued at version 1: every sample ends; the carried prefix and its version stay, new tokens are version 1.
    for gs, gr in zip(stopped, resumed):
        for s, r in zip(gs, gr):
            assert r["done"] and r["ids"][:len(s["ids"])] == s["ids"] and r["lps"][:len(s["lps"])] == s["lps"]
            assert r["v"] == s["v"] + [1] * (len(r["ids"]) - len(s["ids"]))
            assert len(r["ids"]) == len(r["lps"]) <= 24
    assert any(1 in r["v"] for g in resumed for r in g)
