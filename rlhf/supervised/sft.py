"""Supervised fine-tuning: next-token loss on the response tokens only."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch

from rlhf.algo.losses import packed_sft_loss, sft_loss
from rlhf.supervised.conditional import ConditionalPart
from rlhf.config.part import Part, flag
from rlhf.config.parts import KeysPart


class SFTTask:
    name = "sft"
    value_head = False
    metric_keys = ("loss",)
    output = "head"

    conditional: dict | None = None  # --conditional: bucket edges etc., exported under config.json "rlhf"

    def validate(self, job) -> None:
        from rlhf.supervised.conditional import validate

        validate(job)

    def load_data(self, job, tokenizer):
        from rlhf.supervised.conditional import load_conditional_split
        from rlhf.data import build_sft_dataset
        from rlhf.supervised.loop import load_split

        if job.task["conditional"].conditional:
            train, evals, stats, self.conditional = load_conditional_split(job, tokenizer)
            return train, evals, stats
        return load_split(job, tokenizer, build_sft_dataset)

    def collate(self, samples: list, tokenizer) -> dict[str, torch.Tensor]:
        from rlhf.data import collate_sft, pad_token_id

        return collate_sft(samples, pad_token_id(tokenizer))

    def loss_fn(self, engine):
        from rlhf.models.context_parallel import current_layout, reads_local_tokens

        tp_group = engine.mesh.tp_group if engine.mesh.tp > 1 else None
        vocab = engine.spec.vocab_size
        if self.fused_head(engine):
            return fused_head_loss(engine, tp_group, vocab)

        # The logits are the model's output, read by this loss only (megatron's output layer does not save its
        # output for the backward), so the kernel may overwrite them with their gradient: no [B*S, V] buffer.
        # Under context parallelism the logits are this rank's tokens only (``cp``, the split).
        @reads_local_tokens
        def fn(batch: dict, logits: torch.Tensor):
            cp = current_layout()
            if "packed_seq_params" in batch:  # --packing_samples: logits (1, T, V_local)
                return packed_sft_loss(logits, batch["input_ids"], batch["loss_mask"],
                                       batch["packed_seq_params"].cu_seqlens_q, tp_group=tp_group,
                                       vocab_size=vocab, inplace_backward=True, cp=cp)
            return sft_loss(logits, batch["input_ids"], batch["loss_mask"], tp_group=tp_group, vocab_size=vocab,
                            inplace_backward=True, cp=cp)

        return fn

    def fused_head(self, engine) -> bool:
        """SFT's LM head fused with its loss (``rlhf.models.fused``): with the fused kernels on, outside context
        parallelism; the model then hands back its final hidden states (``output``)."""
        from rlhf.models.fused import part_on

        on = bool(getattr(engine, "fused", False)) and engine.mesh.cp == 1 and part_on("head")
        self.output = "hidden" if on else "head"
        return on

    def evaluate(self, engine, batches: list[dict]) -> dict[str, float]:
        loss_fn = self.loss_fn(engine)  # sets self.output: the head's output, or the hidden states for the fused head
        outs = engine.forward(batches, loss_fn=loss_fn, output=self.output)
        return {"loss": engine.reduce_metrics(outs, self.metric_keys)["loss"]}

    def export_extra(self, engine, batches: list[dict]) -> dict[str, Any]:
        return {"conditional": self.conditional} if self.conditional else {}


def fused_head_loss(engine, tp_group, vocab: int):
    """SFT's loss from the final hidden states: the LM head runs on the scored positions only, fused with the
    cross entropy (``rlhf.models.fused.head_nll_sum``); the same sum and token count as ``sft_loss`` and
    ``packed_sft_loss`` (tests/train/test_fused_kernels.py compares them)."""
    from rlhf.algo.losses import packed_sft_targets
    from rlhf.models.fused import head_nll_sum

    weight = engine.model.output_weight()

    def fn(batch: dict, hidden: torch.Tensor):
        ids, loss_mask = batch["input_ids"], batch["loss_mask"]
        if "packed_seq_params" in batch:  # hidden (1, T, H)
            targets, mask = packed_sft_targets(ids, loss_mask, batch["packed_seq_params"].cu_seqlens_q)
            rows, tgt = hidden[0][mask], targets[mask]
        else:  # hidden (B, S, H): position t predicts token t + 1
            mask = loss_mask[:, 1:].bool()
            rows, tgt = hidden[:, :-1][mask], ids[:, 1:][mask]
        loss_sum = head_nll_sum(rows.to(weight.dtype), weight, tgt.long(), tp_group=tp_group, vocab_size=vocab)
        n = mask.sum().to(torch.int)
        return loss_sum, n, {"loss": [loss_sum.detach(), n.detach()]}

    return fn


@dataclass
class SFTPart(Part):
    """SFT's own switch."""

    pretrain_mode: bool = flag(action="store_true", help="continued pretraining (OpenRLHF's flag): the loss on every "
                                                         "token of --input_key's text", default=False)
    """(--pretrain_mode) continued pretraining: the loss on every token"""



TASK_PARTS = {"keys": KeysPart, "sft": SFTPart, "conditional": ConditionalPart}
"""SFT's own parts of ``rlhf.config.job.SupervisedJob``"""


def add_args(p: argparse.ArgumentParser) -> None:
    from rlhf.config.job import add_common_args

    add_common_args(p, lr=5e-6, epochs=2)
    KeysPart.add_args(p, pairs=False)
    SFTPart.add_args(p)
    ConditionalPart.add_args(p)


TASK = SFTTask
