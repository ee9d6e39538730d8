"""The pretraining (ptx) loss of PPO-ptx (InstructGPT; OpenRLHF's ``--pretrain_data``/``--ptx_coef``, DeepSpeed-Chat's
``--unsupervised_dataset_name``/``--unsup_coef``): each actor optimizer step also takes one
``--micro_train_batch_size`` micro-batch per update micro-batch of plain text from ``--pretrain_data``
(``--pretrain_input_key``), and the step's loss is ``policy_mean + ptx_coef * next-token NLL mean``
(``rlhf.algo.ptx_loss.make_ptx_combined_loss``). Its sampler is checkpointed with the run."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlhf.config.part import Part, flag


@dataclass
class PtxPart(Part):
    """PPO-ptx: the plain texts whose next-token loss joins each actor step."""

    pretrain_data: str | None = flag("--pretrain_data", "--unsupervised_dataset_name",
                                     help="PPO-ptx: plain texts whose next-token loss joins each actor step (files, "
                                          "folders, cached Hub names); DeepSpeed-Chat's --unsupervised_dataset_name",
                                     default=None)
    """(--pretrain_data, --unsupervised_dataset_name) None: no ptx loss"""
    pretrain_input_key: str = flag(help="--pretrain_data: the text field", default="text")
    """(--pretrain_input_key) the text field"""
    pretrain_max_len: int | None = flag(type=int, help="--pretrain_data: longer texts keep their start (default "
                                                       "--prompt_max_len + --generate_max_len)", default=None)
    """(--pretrain_max_len) default --prompt_max_len + --generate_max_len"""
    ptx_coef: float = flag("--ptx_coef", "--unsup_coef", type=float,
                           help="weight of the ptx loss (OpenRLHF's --ptx_coef; DeepSpeed-Chat's --unsup_coef)",
                           default=0.05)
    """(--ptx_coef, --unsup_coef) weight of the ptx loss"""


    def check(self) -> None:
        if not self.pretrain_data:
            return
        from rlhf.config.job import check_paths_exist

        check_paths_exist("--pretrain_data", self.pretrain_data)
        if self.ptx_coef < 0:
            raise ValueError(f"--ptx_coef must be >= 0, got {self.ptx_coef}")


def load_ptx_samples(job, tokenizer) -> list:
    """The --pretrain_data texts as SFT samples in pretrain mode, before any model loads (``job``: the
    ``PPOJobConfig``; its ptx, generation, text, batch and engine parts are read)."""
    from rlhf.data import DataConfig, build_sft_dataset

    ptx, gen = job.ptx, job.generation
    cfg = DataConfig(dataset=ptx.pretrain_data, input_key=ptx.pretrain_input_key, output_key=None,
                     pretrain_mode=True, max_len=ptx.pretrain_max_len or gen.prompt_max_len + gen.generate_max_len,
                     seed=job.engine.seed, skip_bad_samples=job.text.skip_bad_samples)
    try:
        samples, _ = build_sft_dataset(cfg, tokenizer)
    except ValueError as e:
        raise ValueError(str(e).replace("--input_key", "--pretrain_input_key")
                         .replace("--dataset", "--pretrain_data")) from None
    if len(samples) < job.batch.train_batch_size:
        raise ValueError(f"--pretrain_data {ptx.pretrain_data}: {len(samples)} texts, fewer than one "
                         f"--train_batch_size {job.batch.train_batch_size}")
    return samples


class PtxData:
    def __init__(self, ptx: PtxPart, batch, seed: int, samples: list, pad_id: int, mesh, actor):
        """``batch``: the job's batch part (one ptx micro-batch of --micro_train_batch_size per update
        micro-batch); ``seed``: --seed."""
        from rlhf.data import BatchConfig, DistributedBatchSampler

        self.samples, self.pad_id, self.mesh, self.actor = samples, pad_id, mesh, actor
        self.coef = float(ptx.ptx_coef)
        self.sampler = DistributedBatchSampler(len(samples), BatchConfig(batch.train_batch_size,
                                                                         batch.micro_train_batch_size, mesh.dp,
                                                                         mesh.dp_rank), seed=seed + 1)

    def next_microbatches(self) -> list[dict]:
        from rlhf.data import collate_sft

        return [collate_sft([self.samples[i] for i in idx], self.pad_id) for idx in self.sampler.next_step()]

    def logprobs(self, batch: dict, hidden: torch.Tensor) -> torch.Tensor:
        from rlhf.models.outputs import next_token_logprobs_from_hidden

        return next_token_logprobs_from_hidden(self.actor, batch, hidden)

    def combined_loss(self, actor_loss, policy_mbs: list[dict], ptx_mbs: list[dict], metric_keys: tuple):
        """The step's loss over ``policy_mbs + ptx_mbs``, with the token counts of the whole step (all DP ranks)."""
        from rlhf.algo.ptx_loss import make_ptx_combined_loss

        counts = torch.tensor([float(sum(int(mb["action_mask"].sum()) for mb in policy_mbs)),
                               float(sum(int(mb["loss_mask"][:, 1:].sum()) for mb in ptx_mbs))],
                              dtype=torch.float64)
        if self.mesh.dp > 1:
            dist.all_reduce(counts, group=self.mesh.dp_group)
        from rlhf.models.context_parallel import reads_local_tokens

        # both halves read a CP rank's own tokens (the actor's loss is marked so; next_token_logprobs_from_hidden)
        loss = make_ptx_combined_loss(actor_loss, self.logprobs, ptx_coef=self.coef, n_policy=counts[0].item(),
                                      n_ptx=counts[1].item(), metric_keys=metric_keys)
        return reads_local_tokens(loss) if getattr(actor_loss, "reads_local_tokens", False) else loss
