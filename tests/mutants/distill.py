"""Planted bugs of on-policy distillation and the MoE load-balancing loss: a coefficient lost, the teacher scored
over rows the student cannot sample."""
from tests.mutants import Mutant

D = "tests/ppo/test_distill.py::"

MUTANTS = [
    Mutant("distill-coef-ignored", "rlhf/algo/distill.py",
           find='''    term = distill_coef * signal''', replace='''    term = 1.0 * signal''',
           claim="--distill_coef weighs the per-token reverse KL in the advantages",
           tests=(D + "test_signal_with_packed_dynamic_micro_batches_lora_and_half_the_weight",)),
    Mutant("distill-teacher-over-all-its-rows", "rlhf/models/outputs.py",
           find='''vocab_size=getattr(engine, "score_vocab", None) or engine.spec.vocab_size)''',
           replace='''vocab_size=engine.spec.vocab_size)''',
           claim="a teacher with a wider head is renormalised over the student's rows",
           tests=(D + "test_a_wider_teacher_is_scored_over_the_students_ids",)),
    Mutant("distill-moe-aux-loss-coef-ignored", "rlhf/runtime/role.py",
           find='''    return {"aux_loss_coef": optim.aux_loss_coef, "expert_bias_update_rate"''',
           replace='''    return {"aux_loss_coef": 0.0, "expert_bias_update_rate"''',
           claim="--aux_loss_coef turns megatron's load-balancing loss on at its value",
           tests=("tests/train/test_aux_loss_flag.py::test_aux_loss_coef_moves_the_routers",)),
]
