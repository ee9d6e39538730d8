"""Pre-flight memory planner for the colocated PPO schedule (``tools/plan_memory.py`` is its command line):
``model_bytes`` counts each role's bytes, ``schedule`` lays them out per phase and advises."""
from rlhf.planner.model_bytes import (GiB, LAYER_IMPLS, SCHEDULE, PlanConfig, RoleState, VLLMMemory,
                                      activation_bytes, ddp_buffer_numel, head_bytes, layer_saved_bytes_per_token,
                                      layer_working_bytes_per_token, role_state, scores_buffer_bytes,
                                      stage_param_numels, vllm_memory)
from rlhf.planner.schedule import (Plan, PhasePlan, advise, candidate_changes, format_markdown, format_plan,
                                   max_vllm_utilization, plan)

__all__ = ["GiB", "LAYER_IMPLS", "SCHEDULE", "PlanConfig", "RoleState", "VLLMMemory", "activation_bytes",
           "ddp_buffer_numel", "head_bytes", "layer_saved_bytes_per_token", "layer_working_bytes_per_token",
           "role_state", "scores_buffer_bytes", "stage_param_numels", "vllm_memory", "Plan", "PhasePlan", "advise",
           "candidate_changes", "format_markdown", "format_plan", "max_vllm_utilization", "plan"]
