"""The megatron generator's decode cache: a prompt is fed once (the prefill), then each step feeds only the token
it drew, as vLLM does, instead of the whole sequence again.

``DecodeCache`` is megatron-core's ``StaticInferenceContext`` (each softmax-attention layer keeps its keys and values
in ``key_value_memory_dict``, written by megatron's own ``Attention._adjust_key_value_for_inference``; the rotary
table is read from ``sequence_len_offset``) plus ``recurrent``: each Gated DeltaNet layer's convolution window (the
last K - 1 inputs, ``(B, C, K - 1)``) and recurrent state (``(B, H, Dk, Dv)``, fp32), written by
``rlhf.models.hybrid``'s layer. megatron-core 0.16.1's own ``GatedDeltaNet`` raises for any inference context.

Where the cache is not wired the generator feeds whole sequences, named once in the log (``cache_refusal``).
"""
from __future__ import annotations

import functools

import torch


def cache_refusal(spec, config, cp: int) -> str | None:
    """Why the decode cache does not serve this model (None: it does)."""
    if spec.vision is not None:
        return "a vision-language model (its images and 3-D positions are fed with the whole sequence)"
    if spec.mla is not None:
        return "multi-latent attention (megatron's MLA cache is not wired here)"
    if spec.model_type == "gpt_oss":
        return "gpt_oss (its sink attention takes whole sequences)"
    if getattr(spec, "sliding_window", None):
        return "a sliding attention window"
    if getattr(config, "sequence_parallel", False):
        return "sequence parallelism (an MoE model at TP > 1)"
    if cp > 1:
        return "context parallelism"
    return None


@functools.cache
def _cache_class():
    """``DecodeCache``, built once (megatron is imported on first use). megatron-core 0.16.1's
    ``Attention._allocate_memory`` puts the KV cache on ``torch.cuda.current_device()``: patched here, once, to the
    layer's own device (the host, on a CPU machine)."""
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.transformer.attention import Attention

    def _allocate_memory(self, inference_max_sequence_length, batch_size, dim, dtype):
        device = next(self.parameters()).device
        return torch.empty(inference_max_sequence_length, batch_size, self.num_query_groups_per_partition, dim,
                           dtype=dtype, device=device)

    Attention._allocate_memory = _allocate_memory

    class DecodeCache(StaticInferenceContext):
        def __init__(self, batch: int, length: int):
            super().__init__(batch, length)
            self.recurrent: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def advance(self, fed: int) -> None:
            """After a forward that fed ``fed`` tokens per row."""
            self.sequence_len_offset += fed
            self.enable_decode_mode()

    return DecodeCache


def new_cache(batch: int, length: int):
    """A cache for ``batch`` rows of up to ``length`` tokens (prompt and reply)."""
    return _cache_class()(batch, length)
