"""Direct preference optimization (DPO, IPO, cDPO) on the shared trainer loop (rlhf/supervised/loop.py).

The policy is the trainer's engine, built as for SFT (so everything the trainer applies to its engine applies
here). The frozen reference and its per-step log-probs are ``rlhf.supervised.reference`` (shared with KTO).
"""
from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

import torch

from rlhf.algo.preference_losses import PREFERENCE_LOSSES
from rlhf.config.part import Part, flag
from rlhf.config.parts import KeysPart
from rlhf.supervised.reference import ReferencePart, ReferenceTask, sequence_logprobs

log = logging.getLogger("rlhf")


class DPOTask(ReferenceTask):
    name = "dpo"
    metric_keys = ("loss", "acc", "chosen_reward", "rejected_reward", "margin")

    def load_data(self, job, tokenizer):
        from rlhf.data.preference import build_dpo_dataset
        from rlhf.supervised.loop import load_split

        return load_split(job, tokenizer, build_dpo_dataset)

    def collate(self, samples: list, tokenizer) -> dict[str, torch.Tensor]:
        from rlhf.data import pad_token_id
        from rlhf.data.preference import collate_dpo

        return collate_dpo(samples, pad_token_id(tokenizer))

    def loss_fn(self, engine):
        from rlhf.models.context_parallel import reads_local_tokens

        cfg, beta = self.job.task["dpo"], self.job.task["reference"].beta
        loss, eps = PREFERENCE_LOSSES[cfg.loss_type], cfg.label_smoothing

        # The logits are read by this loss only, so their storage takes their gradient (see rlhf/supervised/sft.py).
        @reads_local_tokens  # sequence_logprobs reads the logits of a CP rank's own tokens
        def fn(batch: dict, logits: torch.Tensor):
            logps = sequence_logprobs(engine, batch, logits, inplace_backward=True)  # (2B,)
            ref = batch["ref_logps"]
            b = logps.shape[0] // 2
            return loss(logps[:b], logps[b:], ref[:b], ref[b:], beta=beta, label_smoothing=eps)

        return fn


@dataclass
class DPOPart(Part):
    """DPO's loss."""

    GROUP = "DPO"

    loss_type: str = flag(default="dpo", help="dpo | ipo | cdpo",
                          switches=((("--ipo",), "ipo", "compatibility (OpenRLHF): the same as --loss_type ipo"),))
    """(--loss_type, --ipo) dpo | ipo | cdpo"""
    label_smoothing: float = flag(type=float, default=0.0,
                                  help="cDPO: the probability that a preference label is flipped, in (0, 0.5)")
    """(--label_smoothing) cDPO: the probability that a preference label is flipped"""

    def check(self) -> None:
        if self.loss_type not in PREFERENCE_LOSSES:
            raise ValueError(f"--loss_type must be one of {', '.join(PREFERENCE_LOSSES)}, got {self.loss_type!r}")
        if self.loss_type == "cdpo":
            if not 0.0 < self.label_smoothing < 0.5:
                raise ValueError(f"--label_smoothing must be in (0, 0.5) for --loss_type cdpo, got "
                                 f"{self.label_smoothing}")
        elif self.label_smoothing != 0.0:
            raise ValueError(f"--label_smoothing {self.label_smoothing} applies to --loss_type cdpo only "
                             f"(got --loss_type {self.loss_type})")


TASK_PARTS = {"reference": ReferencePart, "dpo": DPOPart, "keys": KeysPart}
"""DPO's own parts of ``rlhf.config.job.SupervisedJob``"""


def add_args(p: argparse.ArgumentParser) -> None:
    from rlhf.config.job import add_common_args

    add_common_args(p, lr=5e-7, epochs=1)
    ReferencePart.add_args(p)
    DPOPart.add_args(p)
    KeysPart.add_args(p, pairs=True)


TASK = DPOTask
