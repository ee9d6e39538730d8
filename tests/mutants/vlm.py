"""Planted bugs of the vision-language path's data parallelism (docs/vlm.md): the tower stepped on one rank's
gradients, its gradient scaled by the layout, its gradient lost, and every rank given the same batch (which would
hide the first). The test is the GRPO job at DP 2 with different images per rank against a one-rank job on both
ranks' samples (tests/ppo/test_vlm_dp.py)."""
from tests.mutants import Mutant

DP = "tests/ppo/test_vlm_dp.py::test_vision_tower_at_dp2_with_different_images_equals_one_rank"

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
]
