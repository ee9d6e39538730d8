"""Planted bugs of the vision-language path's data parallelism (docs/vlm.md): the tower stepped on one rank's
gradients, its gradient scaled by the layout, its gradient lost, and every rank given the same batch (which would
hide the first). The test is the GRPO job at DP 2 with different images per rank against a one-rank job on both
ranks' samples (tests/ppo/test_vlm_dp.py). Qwen3.5's form: the interleaved rotary taken as sectioned, its export
under the language model's plain names, the DeltaNet's TP sections not undone by the weight gather (the 2-rank
equivalence and export job, tests/models/test_vlm_qwen3_5.py). Qwen3-VL's deepstack: not added, added one layer
late, its features detached (the same job on the tiny Qwen3-VL). Sequence parallelism (the MoE form at TP 2): the
tower's gradient summed over TP on top, the padding taken as image tokens."""
from tests.mutants import Mutant

DP = "tests/ppo/test_vlm_dp.py::test_vision_tower_at_dp2_with_different_images_equals_one_rank"
Q35 = "tests/models/test_vlm_qwen3_5.py::test_qwen3_5_vl_equals_transformers_grads_and_export[qwen3_5]"
Q3VL = "tests/models/test_vlm_qwen3_5.py::test_qwen3_5_vl_equals_transformers_grads_and_export[qwen3_vl]"

MUTANTS = [
    Mutant("vlm-tower-outside-ddp", "rlhf/runtime/role.py",
           find='''        self.ddp = wrap_ddp(self.module, use_distributed_optimizer=optim.use_distributed_optimizer)''',
           replace='''        tower = [p for n, p in self.model.named_parameters() if n.startswith("visual.") and p.requires_grad]
        for p in tower:  # out of DDP's buffers: the optimizer steps them on this rank's own .grad
            p.requires_grad_(False)
        self.ddp = wrap_ddp(self.module, use_distributed_optimizer=optim.use_distributed_optimizer)
        for p in tower:
            p.requires_grad_(True)''',
           claim="the vision tower's gradients are all-reduced over data parallelism with the language model's",
           tests=(DP,)),
    Mutant("vlm-tower-grad-averaged-over-dp", "rlhf/runtime/role.py",
           find='''        p.requires_grad_(not freeze)''',
           replace='''        p.requires_grad_(not freeze)
        if not freeze:  # averaged over the DP ranks on top of the loss's global per-token mean
            p.register_hook(lambda g: g / mesh.dp)''',
           claim="the vision tower's gradient is the global per-token mean's, whatever the DP size",
           tests=(DP,)),
    Mutant("vlm-tower-features-detached", "rlhf/models/vlm.py",
           find='''            return out.pooler_output''', replace='''            return out.pooler_output.detach()''',
           claim="the vision tower is trained unless --freeze_vision_tower (its features carry the loss's gradient)",
           tests=(DP,)),
    Mutant("vlm-every-rank-the-same-batch", "rlhf/ppo/stages.py",
           find='''local=samples[mesh.dp_rank * per:(mesh.dp_rank + 1) * per]''', replace='''local=samples[:per]''',
           claim="each data-parallel rank trains on its own share of the rollout (different prompts and images)",
           tests=(DP,)),
    Mutant("vlm-qwen3_5-rotary-sectioned", "rlhf/models/vlm.py",
           find='''    for axis in (1, 2):
        idx = slice(axis, 3 * int(section[axis]), 3)
        out[..., idx] = freqs[axis, ..., idx]''',
           replace='''    start = int(section[0])
    for axis in (1, 2):  # Qwen2.5-VL's blocks
        idx = slice(start, start + int(section[axis]))
        out[..., idx] = freqs[axis, ..., idx]
        start += int(section[axis])''',
           claim="Qwen3.5's multimodal rotary interleaves time, height and width over the frequencies",
           tests=(Q35,)),
    Mutant("vlm-qwen3_5-export-plain-names", "rlhf/models/vlm.py",
           find='''    if spec.vision is None or spec.model_type == "qwen2_5_vl":
        return name''', replace='''    return name''',
           claim="a Qwen3.5 export names the language model model.language_model.* and the tower model.visual.*",
           tests=(Q35,)),
    Mutant("vlm-weight-gather-deltanet-sections-dropped", "rlhf/rollout/weight_sync.py",
           find='''full_from_tp_shards(p.name, shards, p.partition_dim, self.spec)''',
           replace='''full_from_tp_shards(p.name, shards, p.partition_dim)''',
           claim="the weight gather (HF export, weight sync) rebuilds a DeltaNet's in_proj / conv1d from TP shards",
           tests=(Q35,)),
    Mutant("vlm-qwen3_vl-deepstack-not-added", "rlhf/models/vlm.py",
           find='''    if not features:
        yield
        return''', replace='''    if True:
        yield
        return''',
           claim="Qwen3-VL's deepstack features are added to the first decoder layers' outputs",
           tests=(Q3VL,)),
    Mutant("vlm-qwen3_vl-deepstack-one-layer-late", "rlhf/models/vlm.py",
           find="decoder.layers[j].register_forward_hook", replace="decoder.layers[j + 1].register_forward_hook",
           claim="deepstack feature j goes into decoder layer j's output (transformers' layer_idx)",
           tests=(Q3VL,)),
    Mutant("vlm-qwen3_vl-deepstack-detached", "rlhf/models/vlm.py",
           find="adds.append(z.masked_scatter(mask.unsqueeze(-1), f)",
           replace="adds.append(z.masked_scatter(mask.unsqueeze(-1), f.detach())",
           claim="the deepstack mergers of Qwen3-VL's tower train (their features carry the loss's gradient)",
           tests=(Q3VL,)),
    Mutant("vlm-sp-tower-grads-summed-over-tp", "rlhf/models/vlm.py",
           find="""                self.visual = vision_tower(spec, config.params_dtype)
""", replace="""                self.visual = vision_tower(spec, config.params_dtype)
                for p in self.visual.parameters():  # summed over TP by finalize_model_grads
                    p.sequence_parallel = bool(config.sequence_parallel)
""",
           claim="under sequence parallelism each TP rank's tower already gets the whole sequence's gradient",
           tests=(Q35.replace("[qwen3_5]", "[qwen3_5_moe]"),)),
    Mutant("vlm-sp-padding-is-image", "rlhf/models/vlm.py",
           find="image_mask = torch.cat([image_mask, image_mask.new_zeros(B, pad)], dim=1)",
           replace="image_mask = torch.cat([image_mask, image_mask.new_ones(B, pad)], dim=1)",
           claim="the sequence-parallel padding of a vision batch takes no image features",
           tests=(Q35.replace("[qwen3_5]", "[qwen3_5_moe]"),)),
]
