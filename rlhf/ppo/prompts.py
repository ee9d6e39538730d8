"""The prompts a PPO run generates from (``--prompt_data``), for training and for the held-out evaluation
(``rlhf.ppo.evaluation``, which re-words the flags once more)."""
from __future__ import annotations

import argparse
import logging

log = logging.getLogger("rlhf")


def load_prompts(args: argparse.Namespace, tokenizer) -> tuple[list, dict]:
    """Prompts from --prompt_data; the data layer's errors are re-worded with the PPO flag names. A
    vision-language actor's prompts carry their images (``rlhf.data.vision``)."""
    from rlhf.data import DataConfig, build_prompt_dataset
    from rlhf.data.vision import VisionPart, vision_data
    from rlhf.models.source import describe_source

    spec = describe_source(args.pretrain)["spec"]
    vision = vision_data(spec, args.pretrain, VisionPart(**{k: getattr(args, k) for k in (
        "image_key", "max_images_per_prompt", "min_pixels", "max_pixels", "freeze_vision_tower")}))
    try:
        cfg = DataConfig.from_args(args, dataset=args.prompt_data, dataset_probs=args.prompt_data_probs,
                                   output_key=None, max_len=args.prompt_max_len + args.generate_max_len,
                                   vision=vision)
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
