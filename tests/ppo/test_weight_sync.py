"""Weight sync megatron -> vLLM (TP 2, in-process): after an update, vLLM's log-probs equal the trainer's."""
import json
import os

import pytest
from helpers import REPO, run_torchrun, tail, require

require("vllm")
WORKER = os.path.join(REPO, "tests/ppo/_sync_worker.py")


@pytest.mark.parametrize("tp,pp,actor,lora", [(2, 1, "actor", 0), (1, 2, "actor_tied", 0), (2, 1, "actor", 8)],
                         ids=["megatron_tp2", "megatron_pp2_tied_embeddings", "megatron_tp2_lora_merged"])
def test_weight_sync_after_update(ppo_setup, tp, pp, actor, lora):
    r = _run_sync(ppo_setup[actor], tp, pp, lora)
    assert r["synced"] <= 1e-4, r
    assert r["stale"] > 1e-2, r  # the check can fail: without a sync, vLLM serves the old weights
    assert r["resynced"] <= 1e-4, r
    assert r["version"] == [1.0, 2.0] and r["engine_version"] == 3
    rel = r["released"]  # CPU: sleep freed vLLM's packed weights; the next sync brought the same engine back
    assert rel["packed_before"] > 0 and rel["packed_alive_after_sleep"] == 0, rel
    assert rel["needs_sync"] and not rel["needs_sync_after"] and rel["generate_while_released"] == "raised", rel
    assert rel["after_release"] == r["resynced"], rel
    assert r["buckets"] > 1  # 0.25 MB buckets: the bucketed path is exercised
    if lora:  # only the adapters trained, and vLLM (which has no adapters) follows them: merged weights
        assert r["trainable"] == ["lora_A", "lora_B"], r


def _run_sync(actor: str, tp: int, pp: int, lora: int, *extra: str) -> dict:
    p = run_torchrun(WORKER, 2, ["--actor", actor, "--tp", str(tp), "--pp", str(pp), "--lora_rank", str(lora),
                                 *extra], timeout=600)
    assert p.returncode == 0, tail(p)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, tail(p)
    return json.loads(line[0][7:])


@pytest.mark.parametrize("pp", [1, 2], ids=["tp2", "pp2"])
def test_lora_adapter_sync(ppo_setup, pp):
    """--lora_sync adapter: vLLM (TP 2) gets the base once, then each update's adapters alone through its LoRA
    path. Its log-probs equal the trainer's after an update (and the stale engine's do not, so the check can fail);
    a sleep keeps the base; a base sent again under trained adapters is the unmerged one; the same engine given
    the merged weights instead samples the same tokens with log-probs within 1e-5."""
    r = _run_sync(ppo_setup["actor"], 3 - pp, pp, 8, "--lora_sync", "adapter")
    assert r["synced"] <= 1e-4 and r["stale"] > 1e-2 and r["resynced"] <= 1e-4, r
    rel, m = r["released"], r["merged"]
    base = m["bytes_synced"][0] - m["adapter_bytes"]
    assert m["bytes_synced"][1] == m["adapter_bytes"] == rel["bytes_after_sleep"] and base > 5 * m["adapter_bytes"], r
    assert not rel["needs_base"] and rel["after_release"] <= 1e-4, r
    assert rel["bytes_rebased"] == m["bytes_synced"][0] and rel["rebased"] <= 1e-4, r
    assert rel["folders"] == ["v4"] and m["lora_id"] == 4 and r["engine_version"] == 4, r  # one version kept
    assert m["lora_after_merged_load"] and m["same_tokens"] == 1.0 and m["max_logprob_diff"] <= 1e-5, m


@pytest.mark.parametrize("tp,pp,ep,actor", [(2, 1, 1, "qwen3_yarn_kv1"), (1, 2, 1, "llama3_rope"),
                                             (1, 1, 2, "mixtral")],
                         ids=["qwen3_yarn_one_kv_head_tp2", "llama3_rope_pp2", "mixtral_ep2"])
def test_weight_sync_of_newer_families(family_actors, tp, pp, ep, actor):
    """Qwen3's q/k norms, a KV head replicated over TP 2 (megatron and vLLM) and scaled RoPE (YaRN; Llama 3.1's)
    at positions past the original context, Mixtral's experts spread over 2 EP ranks into vLLM's MoE layers:
    vLLM's log-probs still equal the trainer's after each sync, and an update without a sync (stale weights) is
    seen, so each check can fail."""
    p = run_torchrun(WORKER, 2, ["--actor", family_actors[actor], "--tp", str(tp), "--pp", str(pp), "--ep", str(ep),
                                 "--prompt_len", "24"], timeout=600)
    assert p.returncode == 0, tail(p)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, tail(p)
    r = json.loads(line[0][7:])
    assert r["synced"] <= 1e-4 and r["resynced"] <= 1e-4 and r["stale"] > 1e-2, r
