"""OpenRLHF's current command lines (its dotted flags of 2026: ``--actor.adam.lr``, ``--rollout.batch_size``,
``--ckpt.save_steps``, ...; openrlhf/cli/train_{sft,rm,dpo,ppo_ray}.py at 3c3be6234e0c) on every entry point here.

``translate(argv, entry)`` rewrites each dotted flag the entry point's own parser does not know into ours (one
table, ``TABLE``; docs/openrlhf_flags.md prints it), before argparse: a flag with a meaning here becomes ours, one
without a meaning in one colocated SPMD job (Ray placement beyond the whole job, DeepSpeed-only knobs) is accepted
with one log line when it changes nothing, and refused by name (``ValueError``) when it would change what runs.
Flags that the parsers declare themselves (e.g. ``--actor.eps_clip_low_high``, ``--train.agent_func_path``) are
left to them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Flag:
    """One OpenRLHF flag: ``ours`` (our flag, same values), ``arity`` (0: a switch, 1, 2 or '*': values taken),
    ``ignore`` (accepted, changes nothing here: why) or ``refuse`` (why not, and what to use)."""

    ours: str | None = None
    arity: int | str = 1
    ignore: str | None = None
    refuse: str | None = None
    value_map: tuple = ()
    """``(value, [our tokens])`` pairs for flags whose value picks different flags here (``--ds.param_dtype``)"""
    other: str | None = None
    """why the values outside ``value_map`` are refused (default: only those have a counterpart here)"""
    pair: tuple = ()
    """two values that become two of our flags, one each (``--algo.advantage.is_correction_threshold LOW HIGH``)"""
    differs: str | None = None
    """what a flag translated into ours does differently from OpenRLHF: logged at start (one line) and in the docs"""


def to(ours: str, arity: int | str = 1, differs: str | None = None) -> Flag:
    return Flag(ours=ours, arity=arity, differs=differs)


def ignore(why: str, arity: int | str = 1) -> Flag:
    return Flag(ignore=why, arity=arity)


def refuse(why: str, arity: int | str = 1) -> Flag:
    return Flag(refuse=why, arity=arity)


RAY = "Ray placement: every role is on every rank of the one job here"
MUON = ("Muon is not available (Adam only): megatron-core 0.16.1's own Muon (megatron/core/optimizer/muon.py) needs "
        "NVIDIA's emerging_optimizers, whose only release, 0.3.0, requires Python >= 3.12 (it imports "
        "typing.override; this environment runs 3.11) and has another API than megatron-core 0.16.1 calls "
        "(OrthogonalizedOptimizer(nesterov=...) and newton_schulz_tp(tp_mode=...) where muon.py passes use_nesterov= "
        "and mode=)")
"""Why --optim muon and the --muon.* flags are refused (tests/test_openrlhf_cli.py checks that it still holds)."""

COMMON: dict[str, Flag] = {
    "--ckpt.output_dir": to("--save_path"), "--ckpt.save_steps": to("--save_steps"),
    "--ckpt.path": to("--ckpt_path"), "--ckpt.max_num": to("--max_ckpt_num"),
    "--ckpt.load_enable": to("--load_checkpoint", 0),
    "--ckpt.save_hf": ignore("HF weights at each save: the final model is always exported in HF format here and "
                             "a checkpoint in between converts with tools/convert_megatron_to_hf.py; what is "
                             "trained is the same", 0),
    "--ckpt.disable_ds": ignore("it skips OpenRLHF's DeepSpeed checkpoints; there are none here (checkpoints are "
                                "megatron's distributed ones, written at --save_steps); what is trained is the same",
                                0),
    "--ckpt.max_mem": ignore("a disk budget for keeping old checkpoints; here they are pruned by count "
                             "(--max_ckpt_num); what is trained is the same"),
    "--ckpt.best_metric_key": refuse("keeping the best checkpoint by a metric is not supported; --max_ckpt_num keeps "
                                     "the latest"),
    "--ds.use_universal_ckpt": ignore("megatron's distributed checkpoints load at any layout already", 0),
    "--logger.logging_steps": to("--logging_steps"), "--logger.tensorboard_dir": to("--tensorboard"),
    "--logger.wandb.key": to("--use_wandb"), "--logger.wandb.org": to("--wandb_org"),
    "--logger.wandb.group": to("--wandb_group"), "--logger.wandb.project": to("--wandb_project"),
    "--logger.wandb.run_name": to("--wandb_run_name"),
    "--eval.steps": to("--eval_steps"), "--eval.dataset": to("--eval_dataset"),
    "--train.micro_batch_size": to("--micro_train_batch_size"), "--train.batch_size": to("--train_batch_size"),
    "--train.max_epochs": to("--max_epochs"), "--train.seed": to("--seed"),
    "--train.full_determinism_enable": ignore("on CPU a run is bit-reproducible already (a resumed run equals an "
                                              "uninterrupted one bit for bit, tests/ppo/test_ppo_e2e.py); on CUDA "
                                              "it is not honoured: the kernels run as chosen", 0),
    "--ds.zero_stage": to("--zero_stage"),
    "--ds.zpg": ignore("ZeRO++'s hierarchical partitioning, a DeepSpeed communication layout: the values computed "
                       "are the same"),
    "--ds.deepcompile": ignore("DeepSpeed's compiler: the values computed are the same", 0),
    "--ds.overlap_comm": ignore("DeepSpeed's overlap of communication and compute: the values computed are the "
                                "same", 0),
    "--ds.grad_accum_dtype": Flag(arity=1, value_map=(("fp32", []), ("float32", [])),
                                  other="gradients accumulate in fp32 here (megatron's main_grad buffers)"),
    "--ds.param_dtype": Flag(arity=1, value_map=(("bf16", ["--bf16"]), ("fp32", []), ("float32", []))),
    "--ds.attn_implementation": Flag(arity=1, value_map=(("flash_attention_2", ["--flash_attn"]),
                                                         ("flash_attention_3", ["--flash_attn"]), ("sdpa", []),
                                                         ("eager", []))),
    "--ds.experts_implementation": ignore("which HF kernel runs MoE experts: here megatron-core's expert layers "
                                          "compute the same function"),
    "--ds.use_liger_kernel": to("--use_liger_kernel", 0),
    "--ds.tensor_parallel_size": to("--tensor_model_parallel_size"),
    "--ds.ring_attn_size": to("--context_parallel_size"),
    "--ds.ring_attn_head_stride": ignore("ring attention's head stride: context parallelism here all-gathers the "
                                         "keys and values of the CP group (docs/context_parallel.md)"),
    "--ds.load_in_4bit": refuse("4-bit (QLoRA) base weights are not supported; train LoRA on bf16 weights", 0),
    "--ds.lora.rank": to("--lora_rank"), "--ds.lora.alpha": to("--lora_alpha"),
    "--ds.lora.target_modules": to("--target_modules", "*"), "--ds.lora.dropout": to("--lora_dropout"),
    "--ds.packing_samples": to("--packing_samples", 0),
    "--ds.adam_offload": ignore("DeepSpeed's CPU Adam: where the optimizer states live, not what they compute", 0),
    "--data.disable_fast_tokenizer": refuse("the slow tokenizer is not supported: transformers' default (the fast "
                                            "one where the folder has it) is loaded, and the two may split some "
                                            "texts differently; drop the flag", 0),
    "--data.dataloader_num_workers": ignore("loader processes: data are tokenized up front here, in the same "
                                           "order"),
    "--data.max_samples": to("--max_samples"), "--data.input_key": to("--input_key"),
    "--data.input_template": to("--input_template"), "--data.apply_chat_template": to("--apply_chat_template", 0),
    "--data.tokenizer_chat_template": refuse("a chat template given on the command line is not supported; put it in "
                                             "the tokenizer folder's tokenizer_config.json"),
    "--data.max_len": to("--max_len"), "--data.dataset": to("--dataset"),
    "--data.dataset_probs": to("--dataset_probs"),
    "--data.dataset_split": Flag(arity=1, value_map=(("train", []),)),
    "--eval.split": Flag(arity=1, value_map=(("train", []),)),
    "--model.model_name_or_path": to("--pretrain"), "--actor.model_name_or_path": to("--pretrain"),
    "--model.gradient_checkpointing_enable": to("--gradient_checkpointing", 0),
    "--actor.gradient_checkpointing_enable": to("--gradient_checkpointing", 0),
    "--model.gradient_checkpointing_reentrant": ignore("how activations are recomputed (--gradient_checkpointing: "
                                                       "megatron's own way); the values are the same", 0),
    "--actor.gradient_checkpointing_reentrant": ignore("how activations are recomputed (--gradient_checkpointing: "
                                                       "megatron's own way); the values are the same", 0),
    "--model.aux_loss_coef": to("--aux_loss_coef"),
    "--optim": Flag(arity=1, value_map=(("adam", []),), other=MUON),
    "--adam.lr": to("--learning_rate"), "--adam.betas": to("--adam_betas", 2), "--adam.weight_decay": to("--l2"),
    "--adam.eps": Flag(arity=1, value_map=(("1e-08", []), ("1e-8", []))),
    "--min_lr_ratio": Flag(arity=1, value_map=(("0.1", []),)),
    "--use_ms": refuse("ModelScope downloads are not supported; pass a local folder", 0),
}
for _k in ("lr", "momentum", "ns_steps"):
    COMMON[f"--muon.{_k}"] = refuse(MUON)
COMMON["--muon.nesterov"] = refuse(MUON, 0)
COMMON["--muon.no_nesterov"] = refuse(MUON, 0)

SFT = {**COMMON, "--data.output_key": to("--output_key"), "--model.pretrain_mode_enable": to("--pretrain_mode", 0),
       "--data.multiturn": refuse("multi-turn SFT loss on every assistant turn is not supported; use --output_key "
                                  "or --apply_chat_template with one reply", 0)}
PAIRS = {"--data.chosen_key": to("--chosen_key"), "--data.rejected_key": to("--rejected_key"),
         "--data.prompt_key": to("--prompt_key")}
RM = {**COMMON, **PAIRS,
      "--model.loss_type": Flag(arity=1, value_map=(("sigmoid", []),)),
      "--model.margin_loss_enable": refuse("use --margin_key with a per-pair margin field", 0),
      "--ds.value_head_prefix": Flag(arity=1, value_map=(("score", []),)),
      "--model.compute_fp32_loss": ignore("the loss is computed in fp32", 0)}
DPO = {**COMMON, **PAIRS, "--ref.model_name_or_path": to("--ref_pretrain"), "--ref.offload": to("--ref_offload", 0),
       "--model.beta": to("--beta"), "--model.ipo_enable": to("--ipo", 0),
       "--model.label_smoothing": to("--label_smoothing"),
       "--model.nll_loss_coef": Flag(arity=1, value_map=(("0", []), ("0.0", [])))}
PPO = {**COMMON,
       # vision-language models (openrlhf/cli/train_ppo_ray.py at 3c3be623; 0, its default, is text-only prompts
       # in both)
       "--data.image_key": to("--image_key"), "--data.max_images_per_prompt": to("--max_images_per_prompt"),
       "--actor.freeze_visual_encoder": to("--freeze_vision_tower", 0),
       "--actor.adam.lr": to("--actor_learning_rate"), "--critic.adam.lr": to("--critic_learning_rate"),
       "--actor.adam.betas": to("--adam_betas", 2), "--actor.adam.weight_decay": to("--l2"),
       "--actor.lr_scheduler": to("--lr_scheduler"), "--actor.lr_warmup_ratio": to("--lr_warmup_ratio"),
       "--actor.max_norm": to("--max_norm"), "--actor.aux_loss_coef": to("--aux_loss_coef"),
       "--critic.model_name_or_path": to("--critic_pretrain"), "--reward.model_name_or_path": to("--reward_pretrain"),
       "--reward.normalize_enable": to("--normalize_reward", 0),
       "--reward.clip_range": to("--reward_clip_range", 2),
       "--critic.value_clip": to("--value_clip"), "--critic.freezing_steps": Flag(arity=1, value_map=(("-1", []),)),
       "--critic.save_value_network": ignore("an HF copy of the critic at the end: here the critic is in every "
                                             "checkpoint (megatron format); what is trained is the same", 0),
       "--ref.offload": to("--ref_reward_offload", 0), "--reward.offload": to("--ref_reward_offload", 0),
       "--ds.enable_sleep": ignore("memory between phases: here offload is planned per phase "
                                   "(--ref_reward_offload, --adam_offload); the values are the same", 0),
       "--ds.adam_offload": to("--adam_offload", 0), "--ds.value_head_prefix": Flag(arity=1,
                                                                                   value_map=(("score", []),)),
       "--train.colocate_all": to("--colocate_all", 0),
       "--train.colocate_actor_ref": to("--colocate_actor_ref", 0),
       "--train.colocate_critic_reward": to("--colocate_critic_reward", 0),
       "--train.enable_ema": to("--enable_ema", 0), "--train.ema_beta": to("--ema_beta"),
       "--train.num_episodes": to("--num_episodes"),
       "--train.async_enable": to("--async_one_step_off", 0, differs=(
           "as in OpenRLHF each trained batch was generated whole, by the policy --max_staleness updates older "
           "(--train.async_queue_size, 1 by default); unlike OpenRLHF generation and training share the devices "
           "here, so nothing overlaps (the staleness without the speed-up), and those tokens are trained with "
           "--partial_rollout_correction (AReaL's decoupled loss by default) where OpenRLHF applies no correction "
           "without --algo.advantage.is_correction_enable; with --train.partial_rollout_enable: partial rollouts")),
       "--train.async_queue_size": to("--max_staleness", differs=(
           "OpenRLHF's batches generated ahead of training; here the weight updates a trained token may be old "
           "(the same number for whole batches; with partial rollouts a bound that waits for, never drops, "
           "a reply)")),
       "--train.partial_rollout_enable": to("--partial_rollout", 0, differs=(
           "OpenRLHF pauses vLLM over each weight update and its in-flight requests go on under the new weights "
           "(vLLM frees their KV and prefills again: pause_generation(mode='keep') with clear_cache=True); here a "
           "step stops generating once its groups are whole and the unfinished replies go on the next step, "
           "prefilled again under the new weights the same way; a trained token is at most --max_staleness "
           "updates old, which OpenRLHF bounds only by its queue, and carried tokens are trained with "
           "--partial_rollout_correction (AReaL's decoupled loss by default)")),
       "--vllm.num_engines": to("--vllm_num_engines"), "--vllm.tensor_parallel_size": to("--vllm_tensor_parallel_size"),
       "--vllm.gpu_memory_utilization": to("--vllm_gpu_memory_utilization"),
       "--vllm.enforce_eager": to("--vllm_enforce_eager", 0),
       "--vllm.enable_sleep": ignore("memory between rollouts: vLLM sleeps between them on CUDA already (and "
                                     "frees its weights on CPU)", 0),
       "--vllm.sync_backend": ignore("weights reach vLLM inside each process, without a transfer group"),
       "--vllm.sync_with_ray": ignore(RAY, 0),
       "--vllm.enable_prefix_caching": to("--vllm_enable_prefix_caching", 0),
       "--rollout.batch_size": to("--rollout_batch_size"), "--rollout.micro_batch_size": to("--micro_rollout_batch_size"),
       "--rollout.n_samples_per_prompt": to("--n_samples_per_prompt"), "--rollout.max_new_tokens": to("--generate_max_len"),
       "--rollout.temperature": to("--temperature"), "--rollout.top_p": to("--top_p"),
       "--rollout.max_tokens_per_gpu": ignore("how experience forwards are batched: they use "
                                              "--train.max_tokens_per_gpu here; the values are the same"),
       "--rollout.vllm_generate_batch_size": to("--vllm_generate_batch_size", differs=(
           "OpenRLHF runs every prompt of it to its end and serves the extra batches in later steps; here it is the "
           "groups in flight per step under --train.partial_rollout_enable (those not whole when the step's groups "
           "are continue the next step), and it is refused with --train.async_enable alone")),
       "--train.max_tokens_per_gpu": to("--max_tokens_per_gpu"),
       "--actor.eps_clip": to("--eps_clip"), "--actor.policy_loss_type": to("--policy_loss_type"),
       "--actor.entropy_coef": to("--entropy_coef"), "--actor.dual_clip": to("--dual_clip"),
       "--algo.advantage.lambd": to("--lambd"), "--algo.advantage.gamma": to("--gamma"),
       "--algo.advantage.estimator": to("--advantage_estimator"),
       "--algo.advantage.no_std_norm": to("--no_std_norm", 0),
       "--algo.advantage.is_correction_enable": to("--use_tis", 0),
       "--algo.advantage.is_correction_threshold": Flag(arity=2, pair=("--tis_floor", "--tis_cap")),
       "--algo.advantage.is_correction_type": Flag(arity=1, value_map=tuple(
           (t, ["--is_correction_type", t]) for t in ("tis", "icepop", "seq-mask-tis"))),
       "--algo.kl.init_coef": to("--init_kl_coef"), "--algo.kl.target": to("--kl_target"),
       "--algo.kl.horizon": to("--kl_horizon"), "--algo.kl.estimator": to("--kl_estimator"),
       "--algo.kl.use_loss": to("--use_kl_loss", 0),
       "--algo.dynamic_filtering_enable": to("--dynamic_filtering", 0),
       "--algo.dynamic_filtering_range": to("--dynamic_filtering_range", 2),
       "--reward.remote_url": to("--remote_rm_url"),
       "--reward.overlong_buffer_len": to("--overlong_buffer_len"),
       "--reward.overlong_penalty_factor": to("--overlong_penalty_factor"),
       "--reward.stop_properly_penalty_coef": to("--stop_properly_penalty_coef"),
       "--data.prompt_dataset": to("--prompt_data"), "--data.prompt_probs": to("--prompt_data_probs"),
       "--data.prompt_split": Flag(arity=1, value_map=(("train", []),)),
       "--data.label_key": to("--label_key"), "--train.dynamic_batch_enable": to("--use_dynamic_batch", 0),
       "--eval.temperature": to("--eval_temperature"), "--eval.n_samples_per_prompt": to("--eval_n_samples_per_prompt"),}
for _role in ("actor", "critic", "ref", "reward"):
    PPO[f"--{_role}.num_nodes"] = to(f"--{_role}_num_nodes")
    PPO[f"--{_role}.num_gpus_per_node"] = to(f"--{_role}_num_gpus_per_node")
for _role in ("actor", "critic"):
    PPO[f"--{_role}.optim"] = Flag(arity=1, value_map=(("adam", []),), other=MUON)
    PPO[f"--{_role}.adam.eps"] = Flag(arity=1, value_map=(("1e-08", []), ("1e-8", [])))
    PPO[f"--{_role}.min_lr_ratio"] = Flag(arity=1, value_map=(("0.1", []),))
    for _k in ("lr", "momentum", "ns_steps"):
        PPO[f"--{_role}.muon.{_k}"] = refuse(MUON)
    PPO[f"--{_role}.muon.nesterov"] = refuse(MUON, 0)
    PPO[f"--{_role}.muon.no_nesterov"] = refuse(MUON, 0)
CRITIC_OPTIM = {"adam.betas": ("--critic_adam_betas", ("0.9", "0.95")), "adam.weight_decay": ("--critic_l2", ("0",)),
                "lr_scheduler": ("--critic_lr_scheduler", ("cosine_with_min_lr",)),
                "lr_warmup_ratio": ("--critic_lr_warmup_ratio", ("0.03",)), "max_norm": ("--critic_max_norm", ("1.0",))}
"""OpenRLHF's ``--critic.<k>`` -> (our flag, OpenRLHF's default for it). The actor's ``--actor.<k>`` becomes the shared
flag here (``--adam_betas``, ...), which the critic follows unless its own is given: ``translate`` pins the critic to
OpenRLHF's default when only the actor's is on the command line, as in OpenRLHF."""
for _k, (_ours, _default) in CRITIC_OPTIM.items():
    PPO[f"--critic.{_k}"] = to(_ours, len(_default))
del PPO["--adam.lr"], PPO["--adam.betas"], PPO["--adam.weight_decay"], PPO["--model.model_name_or_path"]

TABLE = {"sft": SFT, "rm": RM, "dpo": DPO, "kto": {**DPO, "--data.label_key": to("--label_key")}, "ppo": PPO}
"""Entry point (``rlhf.<entry>``) -> OpenRLHF flag -> what it becomes. KTO takes DPO's names (OpenRLHF has no KTO
command at 3c3be6234e0c)."""


def without_effect(entry: str) -> list[str]:
    """``entry``'s OpenRLHF flags accepted with one log line and no effect, each followed by placeholder values of
    its arity: a command line whose translation is empty (tests/test_openrlhf_cli.py, tests/ppo/test_rlvr_options.py
    show that they change nothing)."""
    out: list[str] = []
    for flag, spec in TABLE[entry].items():
        if spec.ignore:
            out += [flag] + ["1"] * (1 if spec.arity == "*" else int(spec.arity))
    return out


def entry_name(module: str) -> str:
    """The translation table's name of the entry point whose flags ``module`` defines: ``rlhf.supervised.dpo`` ->
    dpo, ``rlhf.offline.rejection_sampling`` -> rejection_sampling, ``rlhf.ppo.args`` -> ppo."""
    parts = module.removeprefix("rlhf.").split(".")
    return parts[1] if parts[0] in ("supervised", "offline") and len(parts) > 1 else parts[0]


def translate(argv: list[str], entry: str, known: set[str]) -> list[str]:
    """``argv`` with OpenRLHF's dotted flags (not in ``known``, the parser's own option strings) rewritten into
    ours; ``--flag=value`` forms too. ValueError naming a refused flag, or a value that has no counterpart."""
    table = TABLE.get(entry, {})
    out: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        flag, eq, inline = tok.partition("=")
        spec = table.get(flag) if tok.startswith("--") and flag not in known else None
        if spec is None:
            out.append(tok)
            i += 1
            continue
        if spec.arity == "*":
            vals = [inline] if eq else []
            j = i + 1
            while j < len(argv) and not argv[j].startswith("--"):
                vals.append(argv[j])
                j += 1
        else:
            n = int(spec.arity)
            vals = ([inline] if eq else []) + argv[i + 1: i + 1 + n - (1 if eq else 0)]
            j = i + 1 + n - (1 if eq else 0)
            if len(vals) < n:
                raise ValueError(f"{flag} (OpenRLHF) expects {n} value(s)")
        i = j
        if spec.refuse:
            raise ValueError(f"{flag} (OpenRLHF): {spec.refuse}")
        if spec.ignore:
            log.info("%s (OpenRLHF) accepted, no effect here: %s", flag, spec.ignore)
            continue
        if spec.value_map:
            mapped = dict(spec.value_map)
            if vals[0] not in mapped:
                raise ValueError(f"{flag} {vals[0]} (OpenRLHF): " + (
                    spec.other or f"only {', '.join(mapped)} has a counterpart here"))
            out += mapped[vals[0]]
            continue
        if spec.pair:
            out += [tok for ours, v in zip(spec.pair, vals) for tok in (ours, v)]
            continue
        out += [spec.ours, ",".join(vals)] if spec.arity == "*" else [spec.ours, *vals]  # '*': our comma list
        if spec.differs:
            log.info("%s (OpenRLHF) -> %s, which differs: %s", flag, spec.ours, spec.differs)
    if entry == "ppo":
        out += _critic_keeps_openrlhf_defaults(argv) + _openrlhf_defaults(argv)
    return out


OPENRLHF_PPO_DEFAULTS = (
    (("--algo.kl.use_loss", "--use_kl_loss", "--no-use_kl_loss"), ("--no-use_kl_loss",),
     "the KL in the reward for every estimator"),
    (("--reward.clip_range", "--reward_clip_range"), ("--reward_clip_range", "-10", "10"), "rewards clipped to [-10, 10]"),
    (("--algo.advantage.is_correction_threshold", "--tis_floor", "--tis_cap"), ("--tis_floor", "0.5", "--tis_cap", "5.0"),
     "the importance weight of --algo.advantage.is_correction_enable bounded to [0.5, 5.0]"),
)
"""OpenRLHF's PPO defaults that differ from ours in what the flags above change: (the flags that set it, what
OpenRLHF does without them, as ours, why). An OpenRLHF command line (one naming the actor with
``--actor.model_name_or_path``) gets them unless it sets the value itself."""


def _openrlhf_defaults(argv: list[str]) -> list[str]:
    given = {tok.partition("=")[0] for tok in argv if tok.startswith("--")}
    if "--actor.model_name_or_path" not in given:
        return []
    out: list[str] = []
    for flags, ours, what in OPENRLHF_PPO_DEFAULTS:
        if not set(flags) & given:
            log.info("OpenRLHF's default without %s: %s (%s)", flags[0], what, " ".join(ours))
            out += list(ours)
    return out


def _critic_keeps_openrlhf_defaults(argv: list[str]) -> list[str]:
    """OpenRLHF's ``--actor.adam.betas`` (and weight decay, schedule, warmup, clipping) leaves its critic at the
    default; here it becomes the shared flag the critic follows, so the critic's own flag is set to OpenRLHF's
    default unless the command line gives ``--critic.<k>`` or ours."""
    given = {tok.partition("=")[0] for tok in argv if tok.startswith("--")}
    out: list[str] = []
    for k, (ours, default) in CRITIC_OPTIM.items():
        if f"--actor.{k}" in given and not {f"--critic.{k}", ours} & given:
            log.info("--actor.%s (OpenRLHF) sets the actor's only: the critic keeps OpenRLHF's default, %s %s", k,
                     ours, " ".join(default))
            out += [ours, *default]
    return out
