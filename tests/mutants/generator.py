"""Planted bugs of the vLLM generator's weight reload: its "Failed to load weights" warnings dropped where a layer
did own a weight, or not checked after a sync; and of the start-up warnings that mean nothing here
(rlhf/compat/quiet.py): shown after all, or dropped beyond the expected ones. The megatron generator with images
(Qwen3.5's vision form, tests/ppo/test_vlm_jobs.py): the images not fed, the sequence's 3-D positions not fed, the
images not handed on with the sample to the trainer. Its decode cache (tests/ppo/test_decode_cache.py): off, the
prompt not prefilled, a DeltaNet layer's recurrent state or convolution window not carried between steps; its
batches of prompts of one length: one generator for all, lengths mixed, an MoE actor at EP > 1 batched."""
from tests.mutants import Mutant

_T = "tests/ppo/test_engine_weights.py::"
_DC = "tests/ppo/test_decode_cache.py::test_cached_decode_equals_transformers_and_whole_sequences"
_TOG = "tests/ppo/test_decode_cache.py::test_prompts_of_one_length_are_drawn_together_as_alone"
_BATCHED = "tests/ppo/test_decode_cache.py::test_which_prompts_are_batched"
_VLM = "tests/ppo/test_vlm_jobs.py::test_grpo_with_images_from_the_megatron_generator[qwen3_5]"
MUTANTS = [
    Mutant("generator-untied-head-silenced", "rlhf/compat/vllm.py",
           find="elif all(owners[id(p)] != name for p in own):", replace="elif True:",
           claim="only a layer with nothing of its own to load (tied, or buffers only) has its reload warning dropped",
           tests=(_T + "test_a_reload_warning_is_dropped_only_where_nothing_was_to_load",
                  _T + "test_engine_weights_equal_trainer_after_sync[untied_fp32_engine_tp2_tp_local]")),
    Mutant("generator-every-reload-warning-dropped", "rlhf/compat/vllm.py",
           find="if record.msg == RELOAD_WARNING and record.args and record.args[0] in self.classes:",
           replace="if record.msg == RELOAD_WARNING:",
           claim="a layer that missed its tensor in a sync still warns",
           tests=(_T + "test_a_reload_warning_is_dropped_only_where_nothing_was_to_load",
                  _T + "test_engine_weights_equal_trainer_after_sync[tied_bf16_engine_dp2_vllm_tp2]")),
    Mutant("generator-reload-not-checked", "rlhf/rollout/vllm_generator.py",
           find="        if quiet - set(now):\n", replace="        if False:\n",
           claim="a sync after which a silenced layer owns a weight again fails by name",
           tests=(_T + "test_a_reload_warning_is_dropped_only_where_nothing_was_to_load",)),
    Mutant("generator-quiet-filter-not-installed", "rlhf/compat/quiet.py",
           find="            logging.getLogger(name).addFilter(_VLLM_FILTER)\n", replace="            pass\n",
           claim="vLLM's start-up warnings that mean nothing here are not shown in a job's log, each said once",
           tests=("tests/ppo/test_ppo_e2e.py::test_reward_rises_and_vllm_matches_trainer",)),
    Mutant("generator-quiet-every-warning-dropped", "rlhf/compat/quiet.py",
           find="            if record.msg.startswith(prefix):\n", replace="            if True:\n",
           claim="only the expected vLLM warnings are dropped; any other passes",
           tests=("tests/test_compat.py::test_vllms_expected_warnings_are_dropped_and_said_once",)),
    Mutant("generator-quiet-megatron-not-installed", "rlhf/compat/quiet.py",
           find="        warnings.filterwarnings(\"ignore\", message=message, category=UserWarning, module=r\"megatron\\.\")\n",
           replace="        pass\n",
           claim="megatron-core's Transformer Engine / Apex fallback warnings are not shown once rlhf is imported",
           tests=("tests/test_compat.py::test_megatrons_fallback_warnings_are_not_shown",)),
    Mutant("generator-megatron-images-not-fed", "rlhf/rollout/megatron_generator.py",
           find="mb.update(vision_entries([mm] * ids.shape[0], ids) if mm is not None else {})", replace="",
           claim="the megatron generator feeds a prompt's images through the tower in its forwards",
           tests=(_VLM,)),
    Mutant("generator-megatron-plain-positions", "rlhf/rollout/megatron_generator.py",
           find="mb.update(vision_entries([mm] * ids.shape[0], ids) if mm is not None else {})",
           replace="mb.update({k: v for k, v in (vision_entries([mm] * ids.shape[0], ids) if mm is not None else {})"
                   ".items() if k != 'mrope_position_ids'})",
           claim="the megatron generator's forwards take the sequence's 3-D (multimodal rotary) positions",
           tests=(_VLM,)),
    Mutant("generator-megatron-sample-without-images", "rlhf/rollout/megatron_generator.py",
           find='ended, mm=getattr(prompt, "mm", None), routed_experts=routed)',
           replace="ended, routed_experts=routed)",
           claim="a sample the megatron generator drew from an image prompt carries its images to the trainer",
           tests=(_VLM,)),
    Mutant("generator-decode-cache-off", "rlhf/rollout/megatron_generator.py",
           find="    use_decode_cache = True\n", replace="    use_decode_cache = False\n",
           claim="the megatron generator feeds one token per forward after the prompt where the model allows",
           tests=(_DC + "[llama]",)),
    Mutant("generator-decode-cache-prompt-not-prefilled", "rlhf/rollout/megatron_generator.py",
           find="self._next_token(ids[:, cache.sequence_len_offset:]", replace="self._next_token(ids[:, -1:]",
           claim="the decode cache's first forward feeds the whole prompt",
           tests=(_DC + "[llama]",)),
    Mutant("generator-decode-cache-state-not-carried", "rlhf/models/hybrid.py",
           find="None if prev is None else prev[1])", replace="None)",
           claim="a Gated DeltaNet layer's recurrent state is carried from one decode step to the next",
           tests=(_DC + "[qwen3_next]",)),
    Mutant("generator-decode-cache-conv-window-not-carried", "rlhf/models/hybrid.py",
           find="if prev is None else prev[0], x], dim=-1)", replace="if True else prev[0], x], dim=-1)",
           claim="a Gated DeltaNet layer's convolution sees the K - 1 inputs before a decode step's token",
           tests=(_DC + "[qwen3_next]",)),
    Mutant("generator-batch-shares-one-generator", "rlhf/rollout/megatron_generator.py",
           find="        gen = gens[0] if len(gens) == 1 else gens  # several", replace="        gen = gens[0]  # several",
           claim="prompts batched together each draw their replies from their own generator, as if alone",
           tests=(_TOG + "[llama]",)),
    Mutant("generator-batch-mixes-lengths", "rlhf/rollout/megatron_generator.py",
           find="                by_len.setdefault(len(p), []).append(i)", replace="                by_len.setdefault(0, []).append(i)",
           claim="only prompts of one length are batched together (no padding in the decode cache's shared offset)",
           tests=(_TOG + "[llama]", _BATCHED + "[1-0-want0]")),
    Mutant("generator-batch-moe-ep-batched", "rlhf/rollout/megatron_generator.py",
           find="        alone = self.mesh.ep > 1 and bool(self.actor.spec.num_experts)", replace="        alone = False",
           claim="an MoE actor at EP > 1 samples each prompt alone, so its EP ranks feed the same number of batches",
           tests=(_BATCHED + "[2-4-want3]",)),
]
