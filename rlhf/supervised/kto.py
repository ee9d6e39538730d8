"""KTO (Kahneman-Tversky optimization) on unpaired desirable / undesirable samples, on the shared trainer loop.

The reference and its per-step log-probs work as for DPO (rlhf/supervised/reference.py). KTO's reference point, the KL
estimate, is computed per micro-batch: each micro-batch also carries its mismatched pairs (prompt ``b`` with the
completion of sample ``b + 1``, rlhf/data/preference.py::collate_kto); the policy's and the reference's log-probs
of those rows give ``mean(logp - ref_logp)``, clamped at 0 and detached (TRL and OpenRLHF do the same over their
micro-batch). In training the estimate is averaged over the data-parallel ranks' micro-batches of the same
index, as TRL (a gather over processes) and OpenRLHF (an all-reduce) do, so DP2 sees the reference point of
the global micro-batch; evaluation keeps each rank's own estimate, since ranks may hold unequal numbers of eval
micro-batches. The extra rows double a step's forward.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from functools import partial

import torch

from rlhf.algo.preference_losses import kto_kl_estimate, kto_loss
from rlhf.config.part import Part, flag
from rlhf.config.parts import KeysPart
from rlhf.supervised.reference import ReferencePart, ReferenceTask, sequence_logprobs


class KTOTask(ReferenceTask):
    name = "kto"
    metric_keys = ("loss", "acc", "chosen_reward", "rejected_reward", "kl")

    def validate(self, job) -> None:
        """Against the batch (``KTOPart.check`` checked the labels and weights)."""
        super().validate(job)
        mbs = job.batch.micro_train_batch_size
        if mbs < 2:
            raise ValueError(f"--micro_train_batch_size must be >= 2 for KTO (its KL estimate pairs each prompt "
                             f"with another sample's completion in the micro-batch), got {mbs}")

    def load_data(self, job, tokenizer):
        from rlhf.data.preference import build_kto_dataset
        from rlhf.supervised.loop import load_split

        self.max_len = job.batch.max_len
        return load_split(job, tokenizer, partial(build_kto_dataset, label_key=job.task["kto"].label_key))

    def collate(self, samples: list, tokenizer) -> dict[str, torch.Tensor]:
        from rlhf.data import pad_token_id
        from rlhf.data.preference import collate_kto

        return collate_kto(samples, pad_token_id(tokenizer), self.max_len)

    def loss_fn(self, engine):
        from rlhf.models.context_parallel import reads_local_tokens

        a = self.job.task["kto"]
        kw = dict(beta=self.job.task["reference"].beta, desirable_weight=a.desirable_loss_weight,
                  undesirable_weight=a.undesirable_loss_weight)

        @reads_local_tokens  # sequence_logprobs reads the logits of a CP rank's own tokens
        def fn(batch: dict, logits: torch.Tensor):
            logps = sequence_logprobs(engine, batch, logits, inplace_backward=True)  # (2B,): samples, KL rows
            ref = batch["ref_logps"]
            b = logps.shape[0] // 2
            group = None if self._evaluating or engine.mesh.dp == 1 else engine.mesh.dp_group
            kl = kto_kl_estimate(logps[b:].detach(), ref[b:], group=group)
            loss_sum, n, m = kto_loss(logps[:b], ref[:b], batch["labels"], kl, **kw)
            labels = batch["labels"]
            r = (logps[:b] - ref[:b]).detach()
            m["acc"] = [torch.where(labels, r > 0, r < 0).float().sum(), n]  # sign of the implicit reward right
            return loss_sum, n, m

        return fn

    _evaluating = False

    def evaluate(self, engine, batches: list[dict]) -> dict[str, float]:
        self._evaluating = True
        try:
            m = super().evaluate(engine, batches)
        finally:
            self._evaluating = False
        m["margin"] = m["chosen_reward"] - m["rejected_reward"]
        return m


@dataclass
class KTOPart(Part):
    """KTO's labels and loss weights."""

    GROUP = "KTO"

    label_key: str = flag(default="label", help="boolean (or 0/1) field: is the completion desirable")
    """(--label_key) boolean (or 0/1) field: is the completion desirable"""
    desirable_loss_weight: float = flag(type=float, default=1.0)
    """(--desirable_loss_weight)"""
    undesirable_loss_weight: float = flag(type=float, default=1.0)
    """(--undesirable_loss_weight)"""

    def check(self) -> None:
        if not self.label_key:
            raise ValueError("--label_key must name the field that marks a sample desirable (true/1) or not")
        for flag in ("desirable_loss_weight", "undesirable_loss_weight"):
            if getattr(self, flag) <= 0:
                raise ValueError(f"--{flag} must be > 0, got {getattr(self, flag)}")


TASK_PARTS = {"reference": ReferencePart, "kto": KTOPart, "keys": KeysPart}
"""KTO's own parts of ``rlhf.config.job.SupervisedJob``"""


def add_args(p: argparse.ArgumentParser) -> None:
    from rlhf.config.job import add_common_args

    add_common_args(p, lr=5e-7, epochs=1)
    ReferencePart.add_args(p)
    KTOPart.add_args(p)
    KeysPart.add_args(p, pairs=False)


TASK = KTOTask
