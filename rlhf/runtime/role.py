"""One model role on the megatron stack: build, load, optimizer, scheduler, train step, forward, checkpoint state.

SFT, the reward model and each PPO role are a ``ModelRole``. The trainer loops only see
``engine.train_step(microbatches, loss_fn)`` and ``engine.forward(microbatches)``.

Losses follow megatron's per-token contract (``calculate_per_token_loss``): a loss function returns
``(loss_sum, n, {"name": [sum, n], ...})`` for its micro-batch, and megatron divides the gradients by the
total ``n`` over every micro-batch and DP rank. So the step's loss is the exact mean over the global batch,
whatever the micro-batch size, DP or PP layout.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from rlhf.compat.megatron import init_optimizer_state, step_if_finite, unshare_adam_steps
from rlhf.distributed.mesh import ParallelMesh
from rlhf.models.source import describe_source
from rlhf.models.lora import LoraConfig
from rlhf.models.pipeline import LossFn, ReadFn
from rlhf.models.spec import ModelSpec

log = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """Training stopped: too many non-finite updates in a row, or non-finite weights about to be saved."""


@dataclass
class OptimConfig:
    """Adam + warmup/decay schedule. ``total_steps`` is set by the trainer once the data size is known."""

    lr: float = 1e-5
    min_lr_ratio: float = 0.1
    """The schedule decays to ``lr * min_lr_ratio``."""
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.95)
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    warmup_ratio: float = 0.03
    scheduler: str = "cosine"
    """cosine | linear | constant (OpenRLHF's ``--lr_scheduler`` values ``cosine_with_min_lr``/``cosine``
    map to cosine)."""
    total_steps: int = 1
    use_distributed_optimizer: bool = False
    """ZeRO-1 style sharding of the optimizer states over DP (``--zero_stage >= 1``)."""
    aux_loss_coef: float = 0.0
    """(--aux_loss_coef) MoE models: megatron's load-balancing loss, per layer; 0 turns it off."""
    expert_bias_update_rate: float = 0.0
    """(--moe_router_bias_update_rate) MoE models with an expert-bias correction: megatron's update rate of the bias
    after each step (``rlhf.models.families``); 0 keeps it frozen."""
    max_skipped_steps: int = 3
    """(--max_skipped_steps) updates with a non-finite loss or grad norm are skipped; this many in a row stop the
    job."""

    def __post_init__(self) -> None:
        if self.max_skipped_steps < 1:
            raise ValueError(f"--max_skipped_steps must be >= 1, got {self.max_skipped_steps}")
        if self.aux_loss_coef < 0:
            raise ValueError(f"--aux_loss_coef must be >= 0, got {self.aux_loss_coef}")
        if not 0 <= self.expert_bias_update_rate < 1:
            raise ValueError(f"--moe_router_bias_update_rate must be in [0, 1), got {self.expert_bias_update_rate}")
        if self.lr <= 0:
            raise ValueError(f"--learning_rate must be > 0, got {self.lr}")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"--lr_warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        aliases = {"cosine_with_min_lr": "cosine", "cosine": "cosine", "linear": "linear", "constant": "constant",
                   "constant_with_warmup": "constant"}
        if self.scheduler not in aliases:
            raise ValueError(f"--lr_scheduler must be one of {sorted(aliases)}, got {self.scheduler!r}")
        self.scheduler = aliases[self.scheduler]


def moe_load_balancing_loss(mesh: ParallelMesh, microbatches: int) -> float:
    """megatron's load-balancing loss of the last step (before ``--aux_loss_coef``), summed over the layers and
    averaged over micro-batches and DP ranks (each EP rank routes its own tokens); clears megatron's tracker.
    Collective."""
    from megatron.core.transformer.moe import moe_utils

    entry = moe_utils.get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
    local = torch.zeros(1, dtype=torch.float64)
    if entry is not None:  # this stage's layers; TP ranks hold the same values
        local[0] = entry["values"].double().sum().cpu() / max(microbatches, 1)
    moe_utils.clear_aux_losses_tracker()
    dist.all_reduce(local)
    return local.item() / (mesh.tp * mesh.dp)


def _moe_training(optim: OptimConfig | None) -> dict:
    """``build_model``'s MoE training settings of a trained role's optimizer config (none for a frozen role)."""
    if optim is None:
        return {}
    return {"aux_loss_coef": optim.aux_loss_coef, "expert_bias_update_rate": optim.expert_bias_update_rate}


def _check_moe(spec: ModelSpec, mesh: ParallelMesh, name: str, *, trained: bool, lora: bool,
               bias_rate: float = 0.0) -> int:
    """The EP a model of this role is built at (the mesh's for an MoE model, 1 for a dense one); raises before any
    weight is read on what megatron-core 0.16.1 cannot train here. ``bias_rate`` (--moe_router_bias_update_rate) on a
    model without an expert-bias correction is logged as having no effect."""
    if bias_rate > 0 and not (spec.router or {}).get("expert_bias") and mesh.is_rank0:
        log.warning("%s: --moe_router_bias_update_rate %g has no effect: %s has no expert-bias correction", name,
                    bias_rate, spec.model_type)
    if not spec.num_experts:
        if mesh.ep > 1 and mesh.is_rank0:
            log.info("%s: a dense model; --expert_model_parallel_size %d applies to MoE models only", name, mesh.ep)
        return 1
    if lora:
        raise ValueError(f"{name}: --lora_rank with an MoE model ({spec.model_type}) is not supported")
    return mesh.ep


def _apply_lora(model, lora: LoraConfig, mesh: ParallelMesh, name: str) -> dict:
    """LoRA adapters on ``model`` (a value head stays trainable); logs and returns the counts."""
    from rlhf.models.lora import apply_lora

    heads = ("output_layer.weight",) if model.value_head and model.post_process else ()
    c = apply_lora(model, lora, tp=mesh.tp, tp_rank=mesh.tp_rank, trainable=heads)
    log.info("%s: LoRA r=%d alpha=%g on %s (%d linears here): %d trainable of %d parameters (%.3f%%) on "
             "this rank", name, lora.rank, lora.alpha, ",".join(lora.targets), c["modules"],
             c["trainable_params"], c["total_params"], 100.0 * c["trainable_params"] / c["total_params"])
    return c


def _set_vision_trainable(model, freeze: bool, mesh: ParallelMesh, name: str) -> None:
    """A trained vision-language model's tower (``visual.*``): trained, or frozen by --freeze_vision_tower."""
    tower = [p for n, p in model.named_parameters() if n.startswith("visual.")]
    for p in tower:
        p.requires_grad_(not freeze)
    if mesh.is_rank0:
        log.info("%s: vision tower (%d parameters on this rank) %s", name, sum(p.numel() for p in tower),
                 "frozen (--freeze_vision_tower)" if freeze else "trained, replicated over TP, data-parallel")

def _route_layers(model: torch.nn.Module, device: torch.device, fused_on: bool) -> None:
    """The device's kernels in the model's layers: on CUDA with the fused path, Liger's RMSNorm and the weight
    gradients into main_grad where their parts are on (rlhf.models.fused); on CPU the GEMM of this CPU
    (rlhf.compat.onednn: oneDNN's, not MKL's generic one on AMD)."""
    from rlhf.models import fused

    if fused_on and device.type == "cuda" and fused.part_on("norm"):
        fused.fuse_norms(model)
    if fused_on and device.type == "cuda" and fused.part_on("wgrad"):
        from rlhf.compat.main_grad import use_main_grad_linears

        use_main_grad_linears(model, device)
    if device.type == "cpu":
        from rlhf.compat.onednn import use_onednn_linears

        use_onednn_linears(model)


class ModelRole:
    """A (possibly trainable) megatron model for one role, at this rank's TP/PP position."""

    def __init__(self, mesh: ParallelMesh, ckpt_dir: str, *, optim: OptimConfig | None = None,
                 value_head: bool | None = None, bf16: bool = False, recompute: bool = False,
                 name: str = "model", lora: LoraConfig | None = None, transformer_impl: str | None = None,
                 routing_replay: bool = False, freeze_vision: bool = False):
        from rlhf.models.checkpoint_io import load_model
        from rlhf.models.gpt import build_model, resolve_transformer_impl, te_available

        self.mesh, self.name, self.bf16 = mesh, name, bf16
        self.source = describe_source(ckpt_dir)
        self.spec: ModelSpec = self.source["spec"]
        self.padded_vocab = int(self.source["padded_vocab"])
        if lora is not None and te_available():
            log.info("%s: LoRA wraps megatron's local linears: the local layer spec runs instead of TE's", name)
        # --transformer_impl (None: TE where it imports on CUDA); checkpoints are the same under either spec
        self.transformer_impl = resolve_transformer_impl(transformer_impl, lora=lora is not None, spec=self.spec)
        ep = _check_moe(self.spec, mesh, name, trained=optim is not None, lora=lora is not None,
                        bias_rate=optim.expert_bias_update_rate if optim is not None else 0.0)
        model = build_model(self.spec, tp=mesh.tp, pp=mesh.pp, pp_rank=mesh.pp_rank, value_head=value_head,
                            params_dtype=torch.float32, padded_vocab=self.padded_vocab, recompute=recompute,
                            init_weights=False, use_te=self.transformer_impl == "transformer_engine", ep=ep,
                            **_moe_training(optim),
                            routing_replay=routing_replay and bool(self.spec.num_experts))
        self.value_head = model.value_head
        if value_head and not self.spec.is_seq_cls:
            _seeded_score_init(model, self.spec)
        if self.source["kind"] == "megatron":
            load_model(model, os.path.join(ckpt_dir, "model"))
        else:  # an HF folder: every rank reads only its own shard of each tensor
            from rlhf.models.convert import fill_from_hf

            fill_from_hf(model, ckpt_dir, self.spec, self.padded_vocab, tp=mesh.tp, pp=mesh.pp,
                         tp_rank=mesh.tp_rank, pp_rank=mesh.pp_rank, skip_head=value_head and not self.spec.is_seq_cls,
                         ep_rank=mesh.ep_rank if ep > 1 else 0, ep=ep)
        if value_head and not self.spec.is_seq_cls:
            log.info("%s: %s is a causal LM; its score head starts from a seeded random init", name, ckpt_dir)
        self.lora = lora
        if lora is not None:  # after the base weights are in: adapters start at B = 0 (the base model)
            self.lora_counts = _apply_lora(model, lora, mesh, name)
        if self.spec.vision is not None and optim is not None:  # a vision-language model (rlhf.models.vlm)
            _set_vision_trainable(model, freeze_vision, mesh, name)
        # The device rule: on the rank's device before Float16Module / DDP wrap it (megatron allocates the grad
        # buffers, masks and token counts there). Weights are read on the host, one rank's shard at a time.
        model.to(mesh.device)
        from rlhf.models import fused

        # --use_liger_kernel (rlhf.models.fused): the Triton SwiGLU and RoPE, SFT's fused head; Liger's RMSNorm opt-in
        self.fused = fused.enabled(mesh.device, use_te=self.transformer_impl == "transformer_engine")
        _route_layers(model, mesh.device, self.fused)
        self.model = model  # the bare LlamaGPT
        self.module: torch.nn.Module = model
        self.config = model.config
        self.config.calculate_per_token_loss = True
        if bf16:
            from megatron.core.transformer.module import Float16Module

            self.config.bf16 = True
            self.config.pipeline_dtype = torch.bfloat16  # activations between PP stages are bf16 (the p2p buffers)
            self.module = Float16Module(self.config, model)
        self.optimizer = self.scheduler = None
        self.ddp = None
        self.steps = 0
        """Applied optimizer updates (the scheduler's count); skipped ones are ``skipped_steps``."""
        self.skipped_steps = self.consecutive_skips = 0
        self.ckpt_prefix = ""
        """Prefix of this engine's keys in a dist checkpoint; several roles in one checkpoint need distinct ones."""
        if optim is not None:
            self._setup_training(optim)
        else:
            for p in self.model.parameters():
                p.requires_grad_(False)
            self.module.eval()
            params = list(self.model.parameters())
            log.info("%s: frozen, weights in %s (%.1f MB on this rank)", name,
                     str(params[0].dtype).replace("torch.", "") if params else "-",
                     sum(p.numel() * p.element_size() for p in params) / 2**20)

    # ----------------------------------------------------------------------------------------------- training
    def _setup_training(self, optim: OptimConfig) -> None:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        from rlhf.models.ddp import wrap_ddp

        self.optim_cfg = optim
        self.ddp = wrap_ddp(self.module, use_distributed_optimizer=optim.use_distributed_optimizer)
        self.module = self.ddp
        ocfg = OptimizerConfig(optimizer="adam", lr=optim.lr, min_lr=optim.lr * optim.min_lr_ratio,
                               weight_decay=optim.weight_decay, adam_beta1=optim.adam_betas[0],
                               adam_beta2=optim.adam_betas[1], adam_eps=optim.adam_eps, clip_grad=optim.clip_grad,
                               bf16=self.bf16, params_dtype=torch.float32,
                               use_distributed_optimizer=optim.use_distributed_optimizer)
        self.optimizer = get_megatron_optimizer(ocfg, [self.ddp], use_gloo_process_groups=False)
        from rlhf.compat.megatron import fuse_cpu_adam, host_groups_for_distributed_optimizer

        host_groups_for_distributed_optimizer(self.optimizer)
        if fuse_cpu_adam(self.optimizer) and self.mesh.is_rank0:
            log.info("%s: Adam runs torch's fused CPU kernel (megatron found no TE or apex FusedAdam)", self.name)
        total = max(1, optim.total_steps)
        warmup = int(math.ceil(optim.warmup_ratio * total))
        style = {"cosine": "cosine", "linear": "linear", "constant": "constant"}[optim.scheduler]
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if warmup else optim.lr, max_lr=optim.lr,
            min_lr=optim.lr * (optim.min_lr_ratio if style != "constant" else 1.0), lr_warmup_steps=warmup,
            lr_decay_steps=total, lr_decay_style=style, start_wd=optim.weight_decay, end_wd=optim.weight_decay,
            wd_incr_steps=total, wd_incr_style="constant")

    def train_step(self, microbatches: Sequence[dict], loss_fn: LossFn, metric_keys: Sequence[str],
                   output: str = "head") -> dict[str, float]:
        """One optimizer step over this rank's micro-batches. Returns metrics averaged over the global batch
        (identical on every rank): each ``metric_keys`` entry, plus ``grad_norm`` and ``lr``."""
        from rlhf.distributed.faults import fault_point
        from rlhf.models.pipeline import run_microbatches

        assert self.optimizer is not None, f"{self.name} is frozen"
        self.module.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        track_aux = bool(self.spec.num_experts) and self.optim_cfg.aux_loss_coef > 0
        if track_aux:  # the tracker holds this step's values only (forwards in eval mode add none)
            from megatron.core.transformer.moe import moe_utils

            moe_utils.clear_aux_losses_tracker()
        outs = run_microbatches(self.module, microbatches, loss_fn=loss_fn, output=output,
                                device=self.mesh.device)
        fault_point("update")
        metrics, counts = self.reduce_metrics(outs, metric_keys, with_counts=True)  # the same on every rank
        if track_aux:
            metrics["moe_load_balancing_loss"] = moe_load_balancing_loss(self.mesh, len(microbatches))
        loss_key = metric_keys[0]
        if counts[loss_key] == 0:  # nothing to learn from (its loss is 0 / 0): not a divergence
            grad_norm = 0.0
            self.skip(f"no {loss_key} token in the step (every micro-batch's loss mask is empty)",
                      advice="Check the data: every sample of these steps has an empty loss mask")
        else:
            stepped, grad_norm, bad = step_if_finite(self.optimizer, metrics[loss_key], loss_key)
            if stepped:
                self.scheduler.step(increment=1)
                self.steps += 1
                self.consecutive_skips = 0
            else:
                self.skip(f"non-finite {bad}")
        metrics["grad_norm"] = grad_norm
        metrics["skipped_steps"] = float(self.skipped_steps)
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        return metrics

    def skip(self, why: str, advice: str = "Lower the learning rate or check the data") -> None:
        """Count an update that was not applied (``why``: e.g. ``non-finite loss=nan``); after
        ``--max_skipped_steps`` in a row, stop the job (``TrainingDiverged``). Called on every rank alike (the
        inputs are global)."""
        self.skipped_steps += 1
        self.consecutive_skips += 1
        limit = self.optim_cfg.max_skipped_steps
        log.warning("%s: update %d skipped: %s (%d in a row, %d in all; --max_skipped_steps %d)",
                    self.name, self.steps + 1, why, self.consecutive_skips, self.skipped_steps, limit)
        if self.consecutive_skips >= limit:
            raise TrainingDiverged(f"{self.name}: {self.consecutive_skips} updates in a row skipped at update "
                                   f"{self.steps + 1}: {why} (--max_skipped_steps {limit}); nothing "
                                   f"non-finite was saved. {advice}")

    def forward(self, microbatches: Sequence[dict], output: str = "head", loss_fn: LossFn | None = None,
                read: ReadFn | None = None) -> list[dict[str, Any]]:
        """Forward only. With ``loss_fn`` (evaluation): its metrics per micro-batch; else ``{"output": tensor}``
        per micro-batch, the model's output or ``read(batch, output)`` of it. Both on the last pipeline stage only
        (empty elsewhere)."""
        from rlhf.models.pipeline import run_microbatches

        self.module.eval()
        with torch.no_grad():
            return run_microbatches(self.module, microbatches, loss_fn=loss_fn, forward_only=True, output=output,
                                    device=self.mesh.device, read=read)

    def reduce_metrics(self, outs: list[dict], keys: Sequence[str], with_counts: bool = False):
        """Each metric is ``[sum, count]`` per micro-batch: total sums / total counts over micro-batches, DP
        ranks and (from the last stage) pipeline stages (NaN where the total count is 0); a metric whose name ends
        in ``_max`` is ``[value, _]``, reduced by its maximum. The same numbers on every rank. ``with_counts``:
        ``(metrics, total counts)``."""
        vec = torch.zeros(2 * len(keys), dtype=torch.float64)
        top = torch.full((len(keys),), float("-inf"), dtype=torch.float64)  # the "*_max" metrics
        if self.mesh.is_last_stage and self.mesh.tp_rank == 0 and self.mesh.cp_rank == 0:
            for o in outs:
                for i, k in enumerate(keys):
                    s, n = o[k]
                    if k.endswith("_max"):
                        top[i] = max(top[i].item(), float(s))
                        continue
                    vec[2 * i] += float(s)
                    vec[2 * i + 1] += float(n)
        dist.all_reduce(vec)  # one contribution per (DP rank) from the last stage's TP and CP rank 0
        if any(k.endswith("_max") for k in keys):  # the same keys on every rank: the same collectives
            dist.all_reduce(top, op=dist.ReduceOp.MAX)
        metrics = {k: top[i].item() if k.endswith("_max") else
                   (vec[2 * i] / vec[2 * i + 1]).item() if vec[2 * i + 1] > 0 else float("nan")
                   for i, k in enumerate(keys)}
        if with_counts:
            return metrics, {k: vec[2 * i + 1].item() for i, k in enumerate(keys)}
        return metrics

    # -------------------------------------------------------------------------------------------- checkpoint
    def sharded_state_dict(self, include_optimizer: bool = True, is_loading: bool = False) -> dict:
        model_sd = self.model.sharded_state_dict(prefix=self.ckpt_prefix)
        sd = {"model": model_sd}
        if include_optimizer and self.optimizer is not None:
            if is_loading:
                init_optimizer_state(self.optimizer)
            sd["optimizer"] = self.optimizer.sharded_state_dict(model_sd, is_loading=is_loading)
        return sd

    def export_sharded_state_dict(self) -> dict:
        """The model's sharded state dict for an HF export: adapters merged into their base weights."""
        if self.lora is None:
            return self.model.sharded_state_dict()
        from rlhf.models.lora import merged_sharded_state_dict

        return merged_sharded_state_dict(self.model)

    def check_finite(self, purpose: str) -> None:
        """Refuse (``TrainingDiverged``) to save or export non-finite weights: every rank checks its shard."""
        bad = next((n for n, p in self.model.named_parameters() if not bool(torch.isfinite(p).all())), None)
        flag = torch.tensor([0.0 if bad is None else 1.0])  # a host tensor: gloo in every job
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            raise TrainingDiverged(f"{self.name}: non-finite weights ({bad or 'on another rank'}): {purpose} "
                                   "refused, nothing was written")

    def trainer_state(self) -> dict[str, Any]:
        return {"steps": self.steps, "scheduler": self.scheduler.state_dict() if self.scheduler else None,
                "skipped_steps": self.skipped_steps, "consecutive_skips": self.consecutive_skips}

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))  # absent from checkpoints written before the guard
        self.consecutive_skips = int(state.get("consecutive_skips", 0))
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])

    def load_sharded(self, loaded: dict) -> None:
        model_sd = loaded["model"]
        if self.ckpt_prefix:
            n = len(self.ckpt_prefix)
            model_sd = {k[n:] if k.startswith(self.ckpt_prefix) else k: v for k, v in model_sd.items()}
        missing, unexpected = self.model.load_state_dict(model_sd, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"{self.name}: checkpoint does not match the model: missing {missing[:5]}, "
                               f"unexpected {unexpected[:5]}")
        if "optimizer" in loaded and self.optimizer is not None:
            self.optimizer.load_state_dict(loaded["optimizer"])
            unshare_adam_steps(self.optimizer)


def _seeded_score_init(model: torch.nn.Module, spec: ModelSpec) -> None:
    """A reward/critic model started from a causal LM gets a fresh score head, the same on every rank."""
    if model.post_process:
        g = torch.Generator().manual_seed(1234)
        with torch.no_grad():
            model.output_layer.weight.copy_(torch.randn(model.output_layer.weight.shape, generator=g)
                                            / spec.hidden_size ** 0.5)
