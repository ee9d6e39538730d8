"""Datasets for SFT, reward-model and PPO-prompt training.

    cfg = DataConfig.from_args(args)
    samples, stats = build_sft_dataset(cfg, tokenizer)          # or build_rm_dataset / build_prompt_dataset
    sampler = DistributedBatchSampler(len(samples), BatchConfig(args.train_batch_size, args.micro_train_batch_size,
                                                                dp_size, dp_rank), seed=args.seed)
    for micro_batches in sampler:
        batches = [collate_sft([samples[i] for i in mb], pad_token_id(tokenizer)) for mb in micro_batches]

Modules: ``sources`` (file readers), ``mixing`` (``--dataset_probs``), ``formatting`` (templates, tokens, masks),
``build`` (the pipeline and its counts), ``sampler`` (resumable DP batches), ``collate`` (padding).
transformers is never imported here: the tokenizer is passed in.
"""
from rlhf.data.build import DataStats, build_prompt_dataset, build_rm_dataset, build_sft_dataset, load_records
from rlhf.data.collate import collate_prompts, collate_rm, collate_sft, pad_token_id
from rlhf.data.config import DataConfig
from rlhf.data.formatting import PromptSample, RMSample, SFTSample
from rlhf.data.sampler import BatchConfig, DistributedBatchSampler
from rlhf.data.sources import DatasetSpec, Record, parse_dataset_flag, read_source

__all__ = ["BatchConfig", "DataConfig", "DataStats", "DatasetSpec", "DistributedBatchSampler", "PromptSample",
           "RMSample", "Record", "SFTSample", "build_prompt_dataset", "build_rm_dataset", "build_sft_dataset",
           "collate_prompts", "collate_rm", "collate_sft", "load_records", "pad_token_id", "parse_dataset_flag",
           "read_source"]
