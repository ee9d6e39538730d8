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


def test_continuation_is_conditioned_on_the_prefix(result, ppo_setup):
    """Every token of every resumed sample, carried prefix and continuation, has the log-prob transformers gives it
    after the prompt and all the tokens before it (fp32: vLLM and transformers agree to a few 1e-6): a continuation
    that restarted from the prompt alone (the prefix dropped from the request) would keep the prefix and its
    log-probs, but its new tokens' log-probs would be those of another context."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ppo_setup["actor"], dtype=torch.float32).eval()
    worst, continued = 0.0, 0
    for prompt, gs, gr in zip(result["prompts"], result["stopped"], result["resumed"]):
        for s, r in zip(gs, gr):
            ids = torch.tensor([prompt + r["ids"]])
            with torch.no_grad():
                lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)  # (S, V), temperature 1
            want = lp[len(prompt) - 1: -1].gather(1, ids[0, len(prompt):, None]).squeeze(1)
            worst = max(worst, (want - torch.tensor(r["lps"])).abs().max().item())
            continued += len(r["ids"]) > len(s["ids"]) > 0
    assert continued >= 1, "no sample was continued from a prefix"
    assert worst < 1e-4, worst
