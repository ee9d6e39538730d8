"""Third-party warnings that say nothing about this trainer's run: dropped, and said once in its own words.

vLLM 0.32.0 logs ``VLLM_EXPECTED`` at every engine start on every rank (CPU, in-process, eager); megatron-core
0.16.1 warns ``MEGATRON_EXPECTED`` at import in every process without Transformer Engine and Apex (every CPU
machine), six times a rank. A demo run's logs held about 40 such lines, one of them alarming ("may cause the engine
to crash or produce incorrect outputs") about a setting made on purpose. Each is matched exactly (vLLM: the start
of its format string; megatron: its message, from its modules) and dropped; what a vLLM one means is logged once per
process on rank 0 (``rlhf.compat.quiet``), megatron's in the layer-spec line (``rlhf.models.gpt.layer_spec``). Every
other warning passes.
"""
from __future__ import annotations

import logging
import os
import warnings

log = logging.getLogger(__name__)

_EAGER = ("the engine runs eagerly (--vllm_enforce_eager, the default: compiling costs 17-22 s a start on CPU): no "
          "torch.compile, no CUDA graphs")
_TRITON = "vLLM's CPU build runs its V1 model runner (Triton, which V2 needs, has no CPU backend here)"
VLLM_EXPECTED: dict[str, str] = {
    "%s is not found in LD_PRELOAD. ": "vLLM's CPU worker advises preloading tcmalloc and Intel's OpenMP runtime "
                                       "for speed; the trainer runs with the system allocator and torch's OpenMP",
    "The global random seed is set to %d. Since": "vLLM reseeds the process's torch RNG when it runs in-process; "
                                                  "the trainer's engine restores the RNG state around its "
                                                  "construction (rlhf.compat.vllm.keep_torch_rng)",
    "Model Runner V2 requires Triton": _TRITON,
    "Triton is not installed. triton-cpu": _TRITON,
    "Triton is installed, but doesn't include CPU backend": _TRITON,
    "Reset SSM cache type to float32": "vLLM's CPU platform keeps state-space caches (Mamba, Gated DeltaNet) in "
                                       "fp32 whatever the model; attention-only models have none",
    "Enforce eager set, disabling torch.compile": _EAGER,
    "Inductor compilation was disabled by user settings": _EAGER,
    "This model does not officially support disabling chunked prefill": (
        "chunked prefill is off on CPU on purpose (vLLM 0.32.0 cannot rewind a CPU generator after a partial "
        "prefill: rlhf.rollout.vllm_generator.vllm_memory_kwargs); prompts are prefilled whole, and every step "
        "logs how far vLLM's log-probs are from the trainer's (rollout_logprob_drift_max)"),
    "CPU backend doesn't allow to use `torch.set_num_threads`": "vLLM's CPU worker replaced torch.set_num_threads "
                                                                "for the rest of the process: later calls keep the "
                                                                "threads it bound",
}
"""The start of vLLM's format string -> what it means for this trainer."""
VLLM_LOGGERS = ("vllm.v1.worker.cpu_worker", "vllm.config.vllm", "vllm.engine.arg_utils", "vllm.platforms.cpu",
                "vllm.triton_utils.importing")
"""The loggers (vLLM's modules) that log them: the filter sits on each, since vLLM re-creates its handlers when an
engine configures logging."""

MEGATRON_EXPECTED = (r"Apex is not installed\. Falling back to Torch Norm",
                     r"Transformer Engine and Apex are not installed\. Falling back to ")
"""megatron-core's import-time fallbacks (``UserWarning``): its local layers, torch's norms and optimizers run."""


class ExpectedWarnings(logging.Filter):
    """On a handler: drops the warnings of ``expected`` (counted in ``dropped``), logs each meaning once."""

    def __init__(self, expected: dict[str, str], source: str = "vLLM") -> None:
        super().__init__()
        self.expected, self.source = expected, source
        self.dropped: dict[str, int] = {}
        self._said: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING or not isinstance(record.msg, str):
            return True
        for prefix, meaning in self.expected.items():
            if record.msg.startswith(prefix):
                self.dropped[prefix] = self.dropped.get(prefix, 0) + 1
                if meaning not in self._said:
                    self._said.add(meaning)
                    if os.environ.get("RANK", "0") == "0":
                        log.info("%s: %s (its warning %r... is not shown)", self.source, meaning, prefix.strip())
                return False
        return True


_VLLM_FILTER: ExpectedWarnings | None = None


def quiet_vllm() -> ExpectedWarnings:
    """Put the filter on the loggers of ``VLLM_LOGGERS`` (once per process; before an engine starts)."""
    global _VLLM_FILTER
    if _VLLM_FILTER is None:
        # its kernel scan reads every module global, torch.distributed.reduce_op too, which warns that it is deprecated
        warnings.filterwarnings("ignore", message=r"`torch\.distributed\.reduce_op` is deprecated",
                                category=FutureWarning, module=r"vllm\.triton_utils\.dispatcher")
        _VLLM_FILTER = ExpectedWarnings(VLLM_EXPECTED)
        for name in VLLM_LOGGERS:
            logging.getLogger(name).addFilter(_VLLM_FILTER)
    return _VLLM_FILTER


def quiet_megatron() -> None:
    """Ignore megatron-core's fallback warnings (``MEGATRON_EXPECTED``); cheap, before megatron is imported."""
    for message in MEGATRON_EXPECTED:
        warnings.filterwarnings("ignore", message=message, category=UserWarning, module=r"megatron\.")
