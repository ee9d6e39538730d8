"""Run micro-batches through a (possibly pipelined) model with megatron's schedules.

The contract is megatron-core's per-token one: a loss function ``loss_fn(batch, output) -> (loss_sum,
num_tokens, metrics)`` plugs in without touching pipeline code. With ``calculate_per_token_loss`` (set by
``rlhf.runtime.role``) megatron does not divide by the number of micro-batches: it divides the gradients by the
step's total token count over every micro-batch and DP rank. ``output`` is whatever the last stage's
``model(...)`` returns: vocab-parallel logits (B, S, V_local), values (B, S), or hidden states (B, S, H).
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Sequence

import torch

from rlhf.distributed.device import to_device
from rlhf.models.vlm import VISION_KEYS

LossFn = Callable[[dict, torch.Tensor], tuple]
"""``loss_fn(batch, output)``, megatron's per-token contract: ``(loss_sum, num_tokens, {name: [sum, count]})``;
the schedule divides by the tokens of the whole step (``rlhf.runtime.role``)."""
ReadFn = Callable[[dict, torch.Tensor], torch.Tensor]
"""``read(batch, output) -> tensor``: what a forward without a loss keeps of each micro-batch's output."""


def _forward_step(loss_fn: LossFn | None, output: str, device: torch.device, data_iterator, model,
                  read: ReadFn | None = None, cp_stream: int | None = None):
    # The device rule: a micro-batch (collated on the host) goes to the model's device here, so the model, megatron's
    # masks and token counts, and the loss function all see one device.
    batch = to_device(next(data_iterator), device, non_blocking=True)
    # Batches are right-padded, so the causal mask alone is exact for every real token; ``attention_mask`` (B, S)
    # is the padding mask the losses use, not megatron's 4-D mask.
    from rlhf.models import context_parallel as cpm
    from rlhf.models.routing_replay import routing_for_forward

    # MoE routing replay or recording (rlhf.models.routing_replay), when the batch carries routing or a recorder
    with cpm.stream_length(cp_stream), routing_for_forward(model, batch) as watch_backward:
        vision = {k: batch[k] for k in VISION_KEYS if k in batch}  # a vision-language batch (rlhf.models.vlm)
        if batch.get("inference_context") is not None:  # the megatron generator's decode cache
            vision["inference_context"] = batch["inference_context"]
        out = model(batch["input_ids"], batch.get("position_ids"), batch.get("megatron_attention_mask"),
                    output=output, packed_seq_params=batch.get("packed_seq_params"), **vision)
        watch_backward(out)  # full recompute: its backward's routing (rlhf.models.routing_replay)
        # Under context parallelism the last stage's output holds this rank's tokens only: a loss or reader marked
        # ``reads_local_tokens`` reads them in place (the split in the context), any other gets whole sequences.
        layout = cpm.layout_for_batch(batch["input_ids"], batch.get("packed_seq_params"))
    fn = loss_fn if loss_fn is not None else read

    def loss_func(output_tensor):
        if layout is not None and not getattr(fn, "reads_local_tokens", False):
            output_tensor = cpm.whole_sequences(output_tensor, layout, fn)
        with cpm.use_layout(layout):
            if loss_fn is None:  # no loss: hand the output (or what ``read`` takes of it) back through megatron's store
                res = read(batch, output_tensor) if read is not None else output_tensor
                return torch.zeros((), device=output_tensor.device), {"output": res.detach()}
            return once_per_cp_group(loss_fn(batch, output_tensor))

    return out, loss_func


def once_per_cp_group(result: tuple) -> tuple:
    """With context parallelism every rank of a CP group computes the same loss on the gathered per-token results
    (rlhf.models.context_parallel), and its backward gives each rank the gradient of its own tokens; megatron then
    sums gradients and token counts over DP x CP. So the count is this micro-batch's on CP rank 0 and 0 on the
    others: the step's gradient is the plain one."""
    from rlhf.models.context_parallel import cp_group_of_job

    group = cp_group_of_job()
    if group is None or torch.distributed.get_rank(group) == 0:
        return result
    loss_sum, num_tokens, metrics = result
    return loss_sum, num_tokens * 0, metrics


def run_microbatches(model: torch.nn.Module, microbatches: Sequence[dict], *, loss_fn: LossFn | None = None,
                     forward_only: bool = False, output: str = "head",
                     device: torch.device | None = None, read: ReadFn | None = None) -> list[dict[str, Any]]:
    """Forward (and backward unless ``forward_only``) over ``microbatches``; each holds ``input_ids`` (B, S)
    and optionally ``attention_mask``/``position_ids``; every micro-batch must have the same shape when PP > 1.
    Each micro-batch is moved to ``device`` (default: the model's parameters' device) before its forward.

    Returns, on the last pipeline stage, one metrics dict per micro-batch (``{"output": ...}`` when
    ``loss_fn`` is None: the output, or ``read(batch, output)``); an empty list on other stages. How losses
    combine is the loss function's contract
    (``rlhf.runtime.role``: per-token sums and counts, so the step's loss is the mean over the global batch).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from rlhf.compat.megatron import fixed_seq_lengths

    if not microbatches:
        return []
    b, s = microbatches[0]["input_ids"].shape
    from rlhf.models.context_parallel import cp_group_of_job, packed_stream_length, padded_length

    cp_group, cp_stream = cp_group_of_job(), None
    if cp_group is not None:  # megatron's stage-to-stage shape is seq_length / CP: the padded split's
        cp = torch.distributed.get_world_size(cp_group)
        if microbatches[0].get("packed_seq_params") is not None:
            s = max(packed_stream_length(mb["packed_seq_params"].cu_seqlens_q, cp) for mb in microbatches)
            from megatron.core import parallel_state as ps

            cp_stream = s if ps.get_pipeline_model_parallel_world_size() > 1 else None
        else:
            s = padded_length(s, cp)
    if model.config.sequence_parallel:  # the stages exchange this rank's S_pad / TP positions
        from rlhf.models.sequence_parallel import padded_length as sp_padded

        s = sp_padded(s, model.config.tensor_model_parallel_size)
    fixed_seq_lengths(model)
    fb = get_forward_backward_func()
    device = device if device is not None else next(model.parameters()).device
    return fb(forward_step_func=partial(_forward_step, loss_fn, output, device, read=read, cp_stream=cp_stream),
              data_iterator=iter(microbatches),
              model=[model], num_microbatches=len(microbatches), seq_length=s, micro_batch_size=b,
              forward_only=forward_only or loss_fn is None)


def gather_vocab_parallel(logits: torch.Tensor) -> torch.Tensor:
    """All-gather vocab-parallel logits (..., V_local) over the TP group into (..., V_padded). No grad."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(tp)]
    torch.distributed.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)
