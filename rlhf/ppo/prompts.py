"""The prompts a PPO run generates from (``--prompt_data``), for training and for the held-out evaluation
(``rlhf.ppo.evaluation``, which re-words the flags once more)."""
from __future__ import annotations

import argparse
import logging

log = logging.getLogger("rlhf")


def load_prompts(args: argparse.Namespace, tokenizer) -> tuple[list, dict]:
    """Prompts from --prompt_data; the data layer's errors are re-worded with the PPO flag names."""
    from rlhf.data import DataConfig, build_prompt_dataset

    try:
        cfg = DataConfig.from_args(args, dataset=args.prompt_data, dataset_probs=args.prompt_data_probs,
                                   output_key=None, max_len=args.prompt_max_len + args.generate_max_len)
        prompts, stats = build_prompt_dataset(cfg, tokenizer)
    except ValueError as e:
        raise ValueError(str(e).replace("--dataset_probs", "--prompt_data_probs")
                         .replace("--dataset", "--prompt_data")) from None
    if not prompts:
        raise ValueError(f"--prompt_data {args.prompt_data}: no prompts")
    if stats.num_truncated:
        log.warning("%d prompts longer than --prompt_max_len %d were truncated (kept their last tokens)",
                    stats.num_truncated, args.prompt_max_len)
    return prompts, {"num_prompts": len(prompts), "num_truncated": stats.num_truncated}
