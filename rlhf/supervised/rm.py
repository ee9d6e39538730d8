"""Reward-model training: pairwise ``-log sigmoid(r_chosen - r_rejected - margin)`` on a scalar head."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rlhf.algo.losses import packed_sequence_rewards, pairwise_loss, sequence_rewards
from rlhf.config.part import Part, flag
from rlhf.config.parts import KeysPart


def rewards_of(batch: dict, values: torch.Tensor) -> torch.Tensor:
    """The reward of each row (2B,): the score at its last token, from a padded (2B, S) or a packed (1, T)
    (``--packing_samples``) micro-batch."""
    if "packed_seq_params" in batch:
        return packed_sequence_rewards(values, batch["cu_seqlens"])
    return sequence_rewards(values, batch["attention_mask"])


class RMTask:
    name = "rm"
    value_head = True
    metric_keys = ("loss", "acc", "reward_gap", "chosen_reward", "rejected_reward")
    output = "head"  # a value-head model's head returns (B, S) values

    def load_data(self, job, tokenizer):
        from rlhf.data import build_rm_dataset
        from rlhf.supervised.loop import load_split

        return load_split(job, tokenizer, build_rm_dataset)

    def collate(self, samples: list, tokenizer) -> dict[str, torch.Tensor]:
        from rlhf.data import collate_rm, pad_token_id

        return collate_rm(samples, pad_token_id(tokenizer))

    def loss_fn(self, engine):
        def fn(batch: dict, values: torch.Tensor):
            return pairwise_loss(rewards_of(batch, values), batch.get("margin"))

        return fn

    def evaluate(self, engine, batches: list[dict]) -> dict[str, float]:
        outs = engine.forward(batches, loss_fn=self.loss_fn(engine))
        m = engine.reduce_metrics(outs, self.metric_keys)
        return {"acc": m["acc"], "reward_gap": m["reward_gap"], "loss": m["loss"]}

    def after_export(self, job, mesh) -> None:
        """--export_format openrlhf: the exported folder rewritten in OpenRLHF's format (rank 0)."""
        if job.task["rm"].export_format == "openrlhf" and mesh.is_rank0:
            from rlhf.models.reward_format import to_openrlhf

            to_openrlhf(job.checkpoint.save_path)
        dist.barrier()

    def export_extra(self, engine, batches: list[dict]) -> dict[str, Any]:
        """Mean and std of the trained model's rewards over the training responses (chosen and rejected), for
        PPO's ``--normalize_reward``."""
        outs = engine.forward(batches)
        s = torch.zeros(3, dtype=torch.float64)
        if engine.mesh.is_last_stage and engine.mesh.tp_rank == 0 and engine.mesh.cp_rank == 0:
            for b, o in zip(batches, outs):
                r = rewards_of(b, o["output"].cpu()).double()  # b is the host batch: values come back
                s += torch.stack([r.sum(), (r * r).sum(), torch.tensor(float(r.numel()), dtype=torch.float64)])
        dist.all_reduce(s)
        mean = (s[0] / s[2]).item()
        std = max((s[1] / s[2]).item() - mean * mean, 0.0) ** 0.5
        return {"reward_mean": mean, "reward_std": std, "reward_stats_samples": int(s[2].item())}


@dataclass
class RMPart(Part):
    """The reward model's margin field and export format."""

    margin_key: str | None = flag(help="optional per-pair margin field", default=None)
    """(--margin_key) optional per-pair margin field"""
    export_format: str = flag(choices=["hf", "openrlhf"], help="hf: *ForSequenceClassification with score.weight; "
                                                               "openrlhf: OpenRLHF's reward-model folder "
                                                               "(value_head.weight, mean/std in config.json) for "
                                                               "OpenRLHF's --reward_pretrain", default="hf")
    """(--export_format) hf | openrlhf"""



TASK_PARTS = {"keys": KeysPart, "rm": RMPart}
"""RM's own parts of ``rlhf.config.job.SupervisedJob``"""


def add_args(p: argparse.ArgumentParser) -> None:
    from rlhf.config.job import add_common_args

    add_common_args(p, lr=9e-6, epochs=1)
    KeysPart.add_args(p, pairs=True)
    RMPart.add_args(p)


TASK = RMTask
