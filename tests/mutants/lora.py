"""Planted bugs of the LoRA adapter sync (``--lora_sync adapter``: ``rlhf.rollout.lora_sync``, the weight sync and
the vLLM engine's LoRA path): each caught by tests/ppo/test_weight_sync.py, test_partial_ppo.py or
test_rollout_config.py."""
from tests.mutants import Mutant

W = "tests/ppo/test_weight_sync.py::test_lora_adapter_sync"
TP2, PP2 = W + "[tp2]", W + "[pp2]"
JOB = "tests/ppo/test_partial_ppo.py::test_lora_actor_and_vllm_tp2[adapter]"
G = "rlhf/rollout/vllm_generator.py"
S = "rlhf/rollout/weight_sync.py"

MUTANTS = [
    Mutant("lora-adapter-not-served", G,
           find="        outs = self.llm.generate([self._request(p) for p in mine], params, use_tqdm=False,\n"
                "                                 lora_request=self.lora_request)",
           replace="        outs = self.llm.generate([self._request(p) for p in mine], params, use_tqdm=False)",
           claim="vLLM generates with the synced adapter version (its LoRARequest), not the bare base",
           tests=(TP2,)),
    Mutant("lora-partial-round-without-adapter", "rlhf/rollout/partial.py",
           find="params,\n                               lora_request=rollout.lora_request)",
           replace="params)",
           claim="a partial-rollout round continues and starts its requests under the current adapter",
           tests=(JOB,)),
    Mutant("lora-base-sent-merged", S,
           find="            self.merge = not adapter\n",
           replace="            self.merge = True\n",
           claim="an adapter-serving engine gets the unmerged base (vLLM adds the adapter on top: a merged base "
                 "would count it twice)",
           tests=(TP2,)),
    Mutant("lora-base-sent-every-time", S,
           find="        if not adapter or engine.needs_base:\n",
           replace="        if True:\n",
           claim="after the first sync only the adapters are sent",
           tests=(TP2, JOB)),
    Mutant("lora-cpu-sleep-frees-the-base", G,
           find="        self.release_on_cpu = cfg.enable_sleep_mode and not on_cuda and not self.lora_adapter\n",
           replace="        self.release_on_cpu = cfg.enable_sleep_mode and not on_cuda\n",
           claim="serving adapters, a sleep keeps the base, so the next sync can send the adapters alone",
           tests=(TP2,)),
    Mutant("lora-alpha-dropped", "rlhf/models/lora.py",
           find='"lora_alpha": cfg.alpha,',
           replace='"lora_alpha": cfg.rank,',
           claim="the adapter folder carries --lora_alpha, so vLLM scales B A by alpha / r as the trainer does",
           tests=(TP2,)),
    Mutant("lora-other-stages-adapters-missing", "rlhf/rollout/lora_sync.py",
           find="    if mesh.pp > 1:\n        parts: list = [None] * mesh.pp\n",
           replace="    if False:\n        parts: list = [None] * mesh.pp\n",
           claim="at PP > 1 every stage's adapters reach the engine",
           tests=(PP2,)),
    Mutant("lora-every-version-kept", "rlhf/rollout/lora_sync.py",
           find="        while len(self.versions) > self.keep:\n",
           replace="        while False:\n",
           claim="only the adapter versions within the staleness bound stay on disk",
           tests=(TP2,)),
    Mutant("lora-staleness-ignored", "rlhf/ppo/roles.py",
           find="        return partial.max_staleness + 1\n",
           replace="        return 1\n",
           claim="with partial rollouts the adapter versions kept cover --max_staleness",
           tests=("tests/ppo/test_rollout_config.py::test_adapter_versions_kept_cover_the_staleness",)),
]
