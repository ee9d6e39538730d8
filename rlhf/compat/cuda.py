"""Let megatron-core run on a CPU-only torch build.

megatron-core 0.16.1 assumes CUDA in a handful of places: ``torch.cuda.current_device()``
as a device argument, literal ``device="cuda"`` in the pipeline schedule, optimizer and grad clipping,
``Tensor.cuda()``, ``param.type() == 'torch.cuda.FloatTensor'`` checks, and the CUDA RNG state used by the
tensor-parallel RNG tracker.

The shim is scoped to megatron: every loaded ``megatron.core.*`` module gets its global name ``torch`` rebound
to a copy of the torch module in which

* the tensor factories map ``device="cuda"`` (or ``cuda:N``) to the CPU,
* ``torch.cuda`` is a small namespace whose ``current_device`` is the CPU, ``synchronize`` is a no-op and whose
  RNG functions drive the CPU generator.

So vLLM, transformers and our own code see the real torch and pay nothing (a process-wide
``TorchFunctionMode`` slowed vLLM generation by ~35%). Two patches cannot be scoped to modules: the
``'torch.cuda.FloatTensor'`` type checks run inside a narrow ``TorchFunctionMode`` entered only by the three
megatron functions that make them, and ``Tensor.cuda()`` returns the tensor itself: for every caller where torch
sees no GPU (on a CPU-only build it can only raise), for megatron's callers alone where a CUDA build sees one (a CPU
engine on a GPU host, e.g. the HF converter beside a training job: vLLM and our code keep the real ``.cuda()``).

Nothing here is installed when CUDA is available, unless this process trains on the CPU (``cpu_engine_requested``).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import types
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

log = logging.getLogger(__name__)

_INSTALLED = False
_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "zeros_like", "ones_like",
              "empty_like", "full_like", "as_tensor")


def _cpu_device(device: Any) -> Any:
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cpu")
    dev = torch.device(device)
    return torch.device("cpu") if dev.type == "cuda" else device


def _rewrite_device(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    return wrapper


class _HostStream:
    """``torch.cuda.Stream`` on the host: megatron's MoE alltoall dispatcher makes one for its device-to-host
    copies of the split sizes; on the CPU there is nothing to overlap."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, *args: Any, **kwargs: Any) -> types.SimpleNamespace:
        return _host_event()


def _host_event(*args: Any, **kwargs: Any) -> types.SimpleNamespace:
    return types.SimpleNamespace(record=lambda *a, **k: None, synchronize=lambda: None, wait=lambda *a, **k: None)


_HOST_STREAM = _HostStream()


def _make_cuda_namespace() -> types.SimpleNamespace:
    real = torch.cuda
    ns = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real) if not k.startswith("__")})
    ns.current_device = lambda: torch.device("cpu")
    ns.synchronize = lambda *a, **k: None
    ns.is_available = lambda: False
    ns.device_count = lambda: 0
    # The tensor-parallel RNG tracker keeps named "cuda" generator states; on the CPU they are CPU states.
    ns.get_rng_state = lambda device="cuda": torch.get_rng_state()
    ns.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    ns.manual_seed = lambda seed: torch.manual_seed(seed)
    ns.FloatTensor = torch.FloatTensor
    ns.empty_cache = lambda: None
    ns.memory_allocated = lambda *a, **k: 0
    ns.max_memory_allocated = lambda *a, **k: 0
    ns.reset_peak_memory_stats = lambda *a, **k: None
    ns.Stream, ns.current_stream, ns.Event = _HostStream, (lambda *a, **k: _HOST_STREAM), _host_event
    ns.stream = lambda *a, **k: contextlib.nullcontext()
    ns.nvtx = types.SimpleNamespace(range_push=lambda *a, **k: None, range_pop=lambda *a, **k: None,
                                    range=lambda *a, **k: contextlib.nullcontext())
    return ns


def _make_cpu_torch() -> types.ModuleType:
    mod = types.ModuleType("torch")
    mod.__dict__.update(torch.__dict__)
    for name in _FACTORIES:
        setattr(mod, name, _rewrite_device(getattr(torch, name)))
    mod.cuda = _make_cuda_namespace()
    return mod


class _CudaTypeNames(TorchFunctionMode):
    """Answer ``t.type()`` as a CUDA build would (``torch.FloatTensor`` -> ``torch.cuda.FloatTensor``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: A002 (torch's signature)
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        return func(*args, **kwargs)


def _with_cuda_type_names(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _CudaTypeNames():
            return fn(*args, **kwargs)

    wrapper.__rlhf_shimmed__ = True
    return wrapper


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _cpu_set_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _import_megatron_modules() -> None:
    # Import every megatron module that we drive, so that their globals can be rebound before first use.
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.dist_checkpointing.strategies.async_utils  # noqa: F401
    import megatron.core.dist_checkpointing.strategies.filesystem_async  # noqa: F401
    import megatron.core.dist_checkpointing.strategies.torch  # noqa: F401
    import megatron.core.distributed  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.optimizer.clip_grads  # noqa: F401
    import megatron.core.optimizer.distrib_optimizer  # noqa: F401
    import megatron.core.pipeline_parallel.schedules  # noqa: F401
    import megatron.core.tensor_parallel.random  # noqa: F401
    import megatron.core.transformer.moe.experts  # noqa: F401  (MoE: torch.cuda.current_device(), device="cuda")
    import megatron.core.transformer.moe.moe_layer  # noqa: F401
    import megatron.core.transformer.moe.moe_utils  # noqa: F401
    import megatron.core.transformer.moe.router  # noqa: F401
    import megatron.core.transformer.moe.token_dispatcher  # noqa: F401
    # Imported by the layer specs while a model is built, after the last rebind: a CPU engine on a GPU host would
    # find the real torch there (attention's KV-cache buffer is made on torch.cuda.current_device()).
    import megatron.core.fusions.fused_bias_dropout  # noqa: F401
    import megatron.core.post_training.modelopt.layers  # noqa: F401
    import megatron.core.transformer.attention  # noqa: F401
    import megatron.core.transformer.multi_latent_attention  # noqa: F401
    import megatron.core.ssm.gated_delta_net  # noqa: F401  (qwen3_next: its parameters on current_device())


# megatron-core 0.16.1: device="cuda" literals and torch.cuda calls in its modules (CPU-only torch).
def rebind_megatron_modules() -> int:
    """Point the global ``torch`` of every loaded megatron module at the CPU copy. Returns how many changed.

    Idempotent; call again after importing more megatron modules.
    """
    cpu_torch = _CPU_TORCH
    n = 0
    for name, mod in list(sys.modules.items()):
        if name.startswith("megatron.") and mod is not None and getattr(mod, "torch", None) is torch:
            mod.torch = cpu_torch
            n += 1
    return n


_CPU_TORCH: types.ModuleType | None = None


def cpu_engine_requested(device=None) -> bool:
    """This process trains on the CPU although torch may see a GPU: ``device`` is a CPU device, or
    ``RLHF_DEVICE=cpu``."""
    if device is not None and torch.device(device).type == "cpu":
        return True
    return os.environ.get("RLHF_DEVICE", "").strip().lower() == "cpu"


def install(device=None) -> bool:
    """Install the shim if this process trains on the CPU: no CUDA, or a CPU engine on a CUDA host (``device`` or
    ``RLHF_DEVICE=cpu``; megatron would otherwise allocate its buffers on the GPU). True when the shim is active."""
    global _INSTALLED, _CPU_TORCH
    if _INSTALLED:  # any later call (DDP's, without a device) rebinds what megatron imported since, on any host
        rebind_megatron_modules()
    if torch.cuda.is_available() and not cpu_engine_requested(device):
        return False
    if _INSTALLED:
        return True
    from rlhf.compat import check_versions

    check_versions(("megatron-core", "torch"))
    _CPU_TORCH = _make_cpu_torch()
    _import_megatron_modules()
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer
    from megatron.core.tensor_parallel import random as mrandom

    # megatron-core 0.16.1: the TP RNG tracker saves and restores the CUDA RNG state.
    mrandom._get_cuda_rng_state = _cpu_get_rng_state
    mrandom._set_cuda_rng_state = _cpu_set_rng_state
    # megatron-core 0.16.1: these three check param.type() == 'torch.cuda.FloatTensor'.
    optimizer.Float16OptimizerWithFloat16Params.__init__ = _with_cuda_type_names(
        optimizer.Float16OptimizerWithFloat16Params.__init__)
    build = distrib_optimizer.DistributedOptimizer.__dict__["_build_model_and_main_param_groups"]
    distrib_optimizer.DistributedOptimizer._build_model_and_main_param_groups = classmethod(
        _with_cuda_type_names(build.__func__))
    clip_grads.clip_grad_by_total_norm_fp32 = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    for mod_name, mod in list(sys.modules.items()):
        # Modules that imported the function by name before we wrapped it.
        if mod_name.startswith("megatron.") and mod is not None and \
                getattr(mod, "clip_grad_by_total_norm_fp32", None) is not None and \
                not getattr(mod.clip_grad_by_total_norm_fp32, "__rlhf_shimmed__", False):
            mod.clip_grad_by_total_norm_fp32 = clip_grads.clip_grad_by_total_norm_fp32
    # megatron-core 0.16.1 calls .cuda() on CPU tensors (tied embeddings at PP > 1, optimizer state restore).
    gpu_host = torch.version.cuda is not None and torch.cuda.is_available()
    torch.Tensor.cuda = _megatron_tensor_cuda(torch.Tensor.cuda) if gpu_host else _tensor_cuda_noop
    _host_split_sizes()
    n = rebind_megatron_modules()
    _INSTALLED = True
    log.info("CPU shim for megatron-core installed (%d modules rebound to a CPU torch namespace)", n)
    return True


# megatron-core 0.16.1: maybe_move_tensor_to_cpu turns only CUDA tensors into numpy (the alltoall split sizes).
def _host_split_sizes() -> None:
    """On the CPU the MoE alltoall dispatcher's split sizes stayed tensors, which ``all_to_all_single`` rejects
    (it wants a list of ints); convert host tensors as the CUDA path converts device ones."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu
    if getattr(original, "__rlhf_shimmed__", False):
        return

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy() if as_numpy else tensor
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    maybe_move_tensor_to_cpu.__rlhf_shimmed__ = True
    moe_utils.maybe_move_tensor_to_cpu = token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _tensor_cuda_noop(self: torch.Tensor, device: Any = None, non_blocking: bool = False,
                      memory_format: Any = None) -> torch.Tensor:
    return self


def _megatron_tensor_cuda(real: Callable) -> Callable:
    """``Tensor.cuda`` where CUDA is there: the identity for callers in megatron's modules (the CPU engine's
    tensors stay on the host), the real method for everyone else."""
    if getattr(real, "__rlhf_shimmed__", False):
        return real

    @functools.wraps(real)
    def cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if sys._getframe(1).f_globals.get("__name__", "").startswith("megatron."):
            return self
        return real(self, *args, **kwargs)

    cuda.__rlhf_shimmed__ = True
    return cuda


def is_installed() -> bool:
    return _INSTALLED
