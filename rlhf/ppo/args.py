"""``launch/ppo.py``'s configuration: the PPO parameter table users know from OpenRLHF / AIAK-RLHF as typed parts
(``PPOJobConfig``), built once from the parsed flags by ``validate`` and checked there before any model is loaded.
Each part checks its own values; ``validate`` checks them against each other, the world size and the model
configs. Each check raises ``ValueError`` naming the flag and its value."""
from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import Any

from rlhf.agents.flags import AgentPart
from rlhf.algo.policy_variants import PolicyVariantConfig
from rlhf.algo.rollout_correction import RolloutCorrectionConfig
from rlhf.data.vision import VisionPart
from rlhf.config.migration import PlacementPart
from rlhf.models.routing_replay import RouterReplayPart, check_router_replay
from rlhf.observability.mlflow_log import MlflowPart
from rlhf.config.part import Job
from rlhf.rollout.partial import PartialRolloutConfig, check_partial
from rlhf.config.parts import CheckpointPart, EnginePart, ParallelPart, TextPart
from rlhf.ppo.algo_args import AlgoPart, add_algo_args, check_algo
from rlhf.ppo.distill import DistillConfig, check_teacher
from rlhf.ppo.ema import EmaPart
from rlhf.ppo.evaluation import EvalConfig
from rlhf.ppo.parts import (GenerationPart, OffloadPart, PPOBatch, PPOLogging, PPOLora, PPOModels, PPOOptim,
                            PromptDataPart, RolloutPart)
from rlhf.ppo.ptx import PtxPart
from rlhf.rewards.judge import JudgePart, check_judge
from rlhf.rewards.sources import RewardConfig
from rlhf.sandbox.code_reward import CodeRewardConfig

log = logging.getLogger(__name__)


@dataclass
class PPOJobConfig(Job):
    """The PPO job: one part per concern, built once (``validate``) and handed to each component as the part it
    needs. A new flag goes to one part's ``add_args`` and fields, and to the component that reads it."""

    models: PPOModels
    distill: DistillConfig
    rewards: RewardConfig
    judge: JudgePart
    code: CodeRewardConfig
    prompts: PromptDataPart
    text: TextPart
    vision: VisionPart
    eval: EvalConfig
    batch: PPOBatch
    generation: GenerationPart
    agent: AgentPart
    partial: PartialRolloutConfig
    router_replay: RouterReplayPart
    optim: PPOOptim
    algo: AlgoPart
    correction: RolloutCorrectionConfig
    policy: PolicyVariantConfig
    ptx: PtxPart
    ema: EmaPart
    offload: OffloadPart
    rollout: RolloutPart
    placement: PlacementPart
    engine: EnginePart
    parallel: ParallelPart
    lora: PPOLora
    checkpoint: CheckpointPart
    logging: PPOLogging
    mlflow: MlflowPart


def add_args(p: argparse.ArgumentParser) -> None:
    """The parts' flags in the groups of ``--help``. ``rlhf.config.job.cli_main`` adds ``LauncherPart``'s, which it
    applies before the job is built (``apply_launcher_args``): no part of the job."""
    g = p.add_argument_group("models and data")
    PPOModels.add_args(g)
    DistillConfig.add_args(g)
    RewardConfig.add_args(g)
    JudgePart.add_args(g)
    CodeRewardConfig.add_args(g)
    PromptDataPart.add_args(g)
    TextPart.add_args(g)
    VisionPart.add_args(g)
    EvalConfig.add_args(g)
    g = p.add_argument_group("batching and generation")
    PPOBatch.add_args(g, micro_bs=8, epochs=1)
    GenerationPart.add_args(g)
    AgentPart.add_args(g)
    PartialRolloutConfig.add_args(g)
    RouterReplayPart.add_args(g)
    g = p.add_argument_group("optimisation")
    PPOOptim.add_args(g)
    add_algo_args(g)  # AlgoPart, RolloutCorrectionConfig, PtxPart, EmaPart
    PolicyVariantConfig.add_args(g)  # --policy_loss_type sapo / clip_cov / kl_cov's parameters
    g = p.add_argument_group("placement and memory")
    OffloadPart.add_args(g)
    RolloutPart.add_args(g)
    PlacementPart.add_args(g)  # OpenRLHF's Ray placement flags: checked, then every role is on every rank
    EnginePart.add_args(g)
    ParallelPart.add_args(g)
    PPOLora.add_args(p)  # --lora_rank etc.: the actor's adapters; --lora_export: the final actor export
    g = p.add_argument_group("running")
    CheckpointPart.add_args(g, what="actor")
    PPOLogging.add_args(g)
    MlflowPart.add_args(g)


@dataclass
class PPOSetup:
    """The job and what ``validate`` derives from it and the model configs (no weights read)."""

    job: PPOJobConfig
    """the configuration, built once from the flags"""
    dp: int
    """data-parallel size: world size / (TP x PP)"""
    engines: int
    """generation engines: world size / vLLM TP (the megatron fallback: one per DP rank)"""
    samples: int
    """samples per step, global: --rollout_batch_size x --n_samples_per_prompt"""
    sources: dict[str, Any]
    """``describe_source`` of each model flag: {"--pretrain": ..., "--critic_pretrain": ..., "--reward_pretrain":
    [one per reward model], "--teacher_pretrain": ... or None}"""
    vllm_tp_reason: str = ""
    """why ``--vllm_tensor_parallel_size`` has its value when the trainer chose it ("" when the user did)"""

    @property
    def rewards(self) -> RewardConfig:
        return self.job.rewards


def _check_policy_variant(job: PPOJobConfig) -> None:
    """verl's SAPO aggregates over sequences; Clip-Cov's and KL-Cov's covariance is over a micro-batch's tokens."""
    kind, mode = job.algo.policy_loss_type, job.algo.loss_agg_mode
    if kind == "sapo" and mode not in (None, "seq_mean_token_mean"):
        raise ValueError(f"--policy_loss_type sapo with --loss_agg_mode {mode}: verl's SAPO loss is a mean over "
                         "sequences of their token means (seq_mean_token_mean)")
    if kind in ("clip_cov", "kl_cov") and job.parallel.cp > 1:
        raise ValueError(f"--policy_loss_type {kind} with --context_parallel_size {job.parallel.cp}: its covariance "
                         "and token count are over a micro-batch's tokens, which context parallelism splits")


def validate(args: argparse.Namespace, world_size: int) -> PPOSetup:
    """The job from the parsed flags (each part checks its own values), then the checks across parts, the world
    size and the model configs, before any process group or model. Fills what the flags leave open: --max_len,
    --vllm_tensor_parallel_size, the old log-probs' source."""
    from rlhf.distributed.mesh import validate_layout
    from rlhf.models.gpt import resolve_transformer_impl

    job = PPOJobConfig.from_args(args, derived={"rewards": {"require_source": False}})  # any source: _check_models
    par = job.parallel
    resolve_transformer_impl(job.engine.transformer_impl, lora=bool(job.lora.lora_rank), cp=par.cp)  # before any model
    dp = validate_layout(world_size, par.tp, par.pp, cp=par.cp)
    if par.cp > 1 and job.rollout.rollout_backend == "megatron":
        raise ValueError(f"--context_parallel_size {par.cp} with --rollout_backend megatron: the "
                         "megatron fallback generator decodes with a KV cache that is not split over CP ranks; "
                         "generate with vLLM (the default)")
    check_algo(job)
    _check_policy_variant(job)
    check_code_reward(job)
    from rlhf.agents.flags import check_agent_args, check_agent_fit

    check_agent_args(job)
    check_partial(job)
    from rlhf.ppo.ema import check_ema_args

    check_ema_args(job.ema, job.lora.lora_rank)
    if job.ptx.pretrain_data and (par.pp > 1 or job.engine.packing_samples):
        raise ValueError("--pretrain_data with --pipeline_model_parallel_size > 1 or --packing_samples is not "
                         "supported yet (the ptx micro-batches are padded and shaped apart from the experience's)")
    sources = _check_models(job)
    from rlhf.models.source import check_tokenizer_folder

    check_agent_fit(job.agent, sources["--pretrain"]["hf_config"])
    check_router_replay(job.router_replay, sources["--pretrain"]["spec"], backend=job.rollout.rollout_backend,
                        model=job.models.pretrain)
    check_tokenizer_folder(job.models.pretrain, "--pretrain")  # the prompts and replies are tokenized with it
    sources["--teacher_pretrain"] = check_teacher(job.distill, job.models.pretrain, par)  # its tokenizer: before loading
    check_vision_job(job, sources)
    from rlhf.models.hybrid import check_hybrid_job

    check_hybrid_job(sources["--pretrain"]["spec"], lora=bool(job.lora.lora_rank),
                     what=f"--pretrain {job.models.pretrain}")
    from rlhf.rollout.lora_sync import check_lora_sync
    from rlhf.rollout.vllm_generator import vllm_available

    backend = job.rollout.rollout_backend
    check_lora_sync(job.lora.lora_sync, lora_rank=job.lora.lora_rank, spec=sources["--pretrain"]["spec"],
                    backend=backend, use_vllm=backend == "vllm" or (backend == "auto" and vllm_available()))
    why = resolve_vllm_tp(job.rollout, sources["--pretrain"]["spec"], world_size, job.engine.bf16)
    engines = _check_batch_sizes(job, world_size, dp)
    job.algo.old_logprobs_source, job.algo.old_logprobs_reason = old_logprobs_source(job.namespace())
    return PPOSetup(job=job, dp=dp, engines=engines, samples=job.batch.samples, sources=sources,
                    vllm_tp_reason=why)


def check_vision_job(job: PPOJobConfig, sources: dict) -> None:
    """A vision-language actor (``rlhf.models.vlm``): what its path runs, before any model. Refused by name: the
    layouts ``check_vlm_layout`` refuses, a critic or reward model on it (no value head on a VLM yet: group
    estimators and rule rewards), partial rollouts and the one-step-off mode (a continued request would need its
    images re-attached), agents, a distillation teacher. Either generator takes the images: vLLM, or the megatron
    one (``rlhf.rollout.megatron_generator``: the tower in every forward), the one Qwen3.5's form runs with."""
    spec = sources["--pretrain"]["spec"]
    for flag, src in (("--reward_pretrain", sources.get("--reward_pretrain")),
                      ("--critic_pretrain", sources.get("--critic_pretrain")),
                      ("--teacher_pretrain", sources.get("--teacher_pretrain"))):
        for s in src if isinstance(src, list) else [src]:
            if isinstance(s, dict) and s.get("spec") is not None and s["spec"].vision is not None:
                raise ValueError(f"{flag}: a vision-language model ({s['spec'].model_type}) as {flag[2:]} is not "
                                 "supported; only the actor (--pretrain) may be one")
    if spec.vision is None:
        return
    from rlhf.algo.advantages import get_estimator
    from rlhf.models.vlm import check_vlm_layout

    what = f"--pretrain {job.models.pretrain}"
    par = job.parallel
    check_vlm_layout(spec, tp=par.tp, pp=par.pp, cp=par.cp, packing=job.engine.packing_samples,
                     lora=bool(job.lora.lora_rank), what=what)
    refused = [(get_estimator(job.algo.advantage_estimator).needs_critic,
                f"--advantage_estimator {job.algo.advantage_estimator} trains a critic, and a vision-language model "
                "has no value head here: use group_norm (GRPO), rloo, reinforce_baseline or dr_grpo"),
               (job.partial.partial_rollout or job.partial.async_one_step_off,
                "--partial_rollout / --async_one_step_off: a carried sample's continued request does not re-attach "
                "its images yet"),
               (bool(job.agent.agent_func_path), "--agent_func_path: multi-turn agents take text prompts only"),
               (bool(job.distill.teacher_pretrain), "--teacher_pretrain: distillation of a vision-language actor is "
                                                     "not wired")]
    for bad, why in refused:
        if bad:
            raise ValueError(f"{what} is a vision-language model ({spec.model_type}): {why}")


def resolve_vllm_tp(rollout, spec, world_size: int, bf16: bool | None = None) -> str:
    """Sets ``--vllm_tensor_parallel_size`` when it was not given (from ``--vllm_num_engines`` when that is, else
    ``choose_tensor_parallel_size``); returns why, for the log ("" when the user chose). ``rollout``: the
    ``RolloutPart`` (or a parsed command line, which has --bf16 too)."""
    if rollout.vllm_tensor_parallel_size is not None:
        return ""
    if rollout.vllm_num_engines is not None:
        if rollout.vllm_num_engines < 1 or world_size % rollout.vllm_num_engines:
            raise ValueError(f"--vllm_num_engines {rollout.vllm_num_engines} must divide the world size {world_size}")
        rollout.vllm_tensor_parallel_size = world_size // rollout.vllm_num_engines
        return f"world size {world_size} / --vllm_num_engines {rollout.vllm_num_engines}"
    import torch

    from rlhf.distributed.env import local_world_size
    from rlhf.rollout.types import choose_tensor_parallel_size

    bf16 = getattr(rollout, "bf16", False) if bf16 is None else bf16
    cuda = torch.cuda.is_available()
    tp, why = choose_tensor_parallel_size(
        spec, world_size, min(local_world_size(), world_size), cuda=cuda,
        device_bytes=torch.cuda.get_device_properties(0).total_memory if cuda else 0,
        dtype_bytes=2 if bf16 else 4, gpu_memory_utilization=rollout.vllm_gpu_memory_utilization)
    rollout.vllm_tensor_parallel_size = tp
    return why


def _check_batch_sizes(job: PPOJobConfig, world_size: int, dp: int) -> int:
    """The batch flags against each other and the layout; returns the number of generation engines."""
    b, tp = job.batch, job.rollout.vllm_tensor_parallel_size
    engines = (world_size // tp if job.rollout.rollout_backend != "megatron" else dp)
    samples = b.samples
    checks = [
        (b.rollout_batch_size % max(engines, 1) == 0,
         f"--rollout_batch_size {b.rollout_batch_size} must be divisible by the number of generation engines "
         f"{engines} (world size {world_size} / --vllm_tensor_parallel_size {tp})"),
        (samples % dp == 0, f"--rollout_batch_size x --n_samples_per_prompt = {samples} must be divisible by the "
                            f"data-parallel size {dp}"),
        ((samples // dp) % b.micro_rollout_batch_size == 0,
         f"--micro_rollout_batch_size {b.micro_rollout_batch_size} must divide the samples per data-parallel rank "
         f"({samples} / dp {dp} = {samples // dp})"),
        (samples % b.train_batch_size == 0,
         f"--train_batch_size {b.train_batch_size} must divide --rollout_batch_size x --n_samples_per_prompt "
         f"= {samples}"),
        (b.train_batch_size % (b.micro_train_batch_size * dp) == 0,
         f"--train_batch_size {b.train_batch_size} is not divisible by --micro_train_batch_size "
         f"{b.micro_train_batch_size} x data-parallel size {dp}"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ValueError(msg)
    return engines


def check_code_reward(job: PPOJobConfig) -> None:
    """``--reward_fn code``: the prompts' tests (--label_key) and a sandbox with every isolation layer (or
    --code_allow_weaker, or a SandboxFusion service), before any model; then the reward takes these settings."""
    from rlhf.sandbox import code_reward

    if job.rewards.reward_fn != "code":
        return
    if not job.prompts.label_key:
        raise ValueError("--reward_fn code runs each reply against its prompt's tests: pass --label_key (the prompt "
                         "field that holds them: APPS/TACO's {inputs, outputs} or MBPP's {test_list})")
    if not job.code.code_sandbox_url:
        from rlhf.sandbox import probe

        missing = {k: v for k, v in probe().items() if v}
        if missing and (not job.code.code_allow_weaker or "namespaces" in missing):
            raise ValueError("--reward_fn code: this machine's sandbox lacks "
                             + "; ".join(f"{k}: {v}" for k, v in missing.items())
                             + ("" if "namespaces" in missing else " (--code_allow_weaker runs without it)"))
    code_reward.configure(job.code)


def _check_models(job: PPOJobConfig) -> dict[str, Any]:
    """Every model flag's config: the reward models, the actor, the critic (when the estimator needs one)."""
    from rlhf.algo.advantages import get_estimator
    from rlhf.models.source import describe_source
    from rlhf.models.spec import check_parallel_fit

    algo, rewards, par = job.algo, job.rewards, job.parallel
    needs_critic = get_estimator(algo.advantage_estimator).needs_critic
    if not (job.distill.teacher_pretrain and job.distill.task_reward_coef == 0):  # pure distillation needs none
        rewards.require_any()
    critic = job.models.critic_pretrain or (rewards.paths[0] if rewards.paths else None)
    if needs_critic and critic is None:
        what = (f"--reward_fn {rewards.reward_fn}" if rewards.reward_fn else f"--remote_rm_url {rewards.remote_rm_url}"
                if rewards.remote_rm_url else "an LLM judge" if rewards.judge is not None
                else "pure distillation (--task_reward_coef 0)")
        raise ValueError(f"{what} without --reward_pretrain: the critic of --advantage_estimator "
                         f"{algo.advantage_estimator} needs --critic_pretrain")
    sources = {"--reward_pretrain": rewards.validate_models(par.tp, par.pp),
               "--judge_pretrain": check_judge(job.judge, par.tp, par.pp)}
    for flag, path in (("--pretrain", job.models.pretrain), ("--critic_pretrain", critic if needs_critic else None)):
        if path is None:
            continue
        try:
            src = describe_source(path)
        except ValueError as e:
            raise ValueError(f"{flag} {path}: {e}") from None
        check_parallel_fit(src["spec"], par.tp, par.pp, src["padded_vocab"])
        from rlhf.models.context_parallel import check_cp_flags

        check_cp_flags(par.cp, src["spec"], flag)
        sources[flag] = src
    return sources


def log_compat(engine: EnginePart, dp: int, cuda: bool) -> None:
    """Resolves --zero_stage (``engine``: the job's ``EnginePart``) and logs what the compatibility flags map to."""
    from rlhf.config.job import log_compat_mappings

    log_compat_mappings(engine, dp, cuda)
    log.info("--colocate_all: actor, critic, reference, reward and vLLM share every rank (one SPMD job)")


def old_logprobs_source(args: argparse.Namespace) -> tuple[str, str]:
    """Where PPO's old log-probs come from, and why: ``rollout`` (--use_rollout_logprobs: the generator's),
    ``update`` (one on-policy update per batch: the update's own forward, detached; no actor forward in
    make_experience) or ``forward`` (the actor's forward in make_experience)."""
    from rlhf.algo.advantages import get_estimator

    if args.use_rollout_logprobs:
        return "rollout", "--use_rollout_logprobs"
    one_update = args.max_epochs == 1 and args.train_batch_size == args.rollout_batch_size * args.n_samples_per_prompt
    from rlhf.algo.kl import kl_in_loss

    estimator = get_estimator(args.advantage_estimator)
    kl_in_reward = not kl_in_loss(estimator, args.use_kl_loss) and args.init_kl_coef > 0
    if args.old_logprobs_forward == "always":
        return "forward", "--old_logprobs_forward always"
    if getattr(args, "rollout_rs", None) or getattr(args, "rollout_is", None):
        return "forward", "--rollout_rs / --rollout_is act when the experience is made, before the advantages and " \
                          "the critic, as verl applies them (its decoupled mode): they need the old log-probs first"
    if getattr(args, "teacher_pretrain", None):
        return "forward", "--teacher_pretrain: the distillation signal compares the student's forward with the " \
                          "teacher's, on the same kernels"
    if not one_update:
        return "forward", "each batch gets several updates (--max_epochs or --train_batch_size)"
    if kl_in_reward:
        return "forward", f"the KL penalty is in the reward (--advantage_estimator {args.advantage_estimator}, " \
                          f"--init_kl_coef {args.init_kl_coef:g}) and needs them before the update"
    return "update", "one on-policy update per batch: the update's own forward, detached"

