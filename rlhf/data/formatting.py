"""Check one raw record and turn it into token ids: SFT samples, RM pairs and PPO prompts.

Prompt and response are tokenized *separately* and concatenated, ``ids = tok(prompt) + tok(response) + [eos]``,
so the response-only loss mask is exact: it covers precisely ``tok(response) + [eos]``, with no BPE merge across
the boundary to shift it by a token (what a model sees at generation time is the same split: prompt ids, then
the tokens it produced). The prompt gets the tokenizer's special tokens (e.g. a BOS) unless a chat template
rendered it, since chat templates write their own; the response never does. EOS is appended unless the response
already ends with it.

Text rules:
- ``--apply_chat_template``: a field is a string (a prompt becomes one user message, a response one assistant
  message) or a list of ``{"role", "content"}`` messages. ``prompt = template(prompt_msgs,
  add_generation_prompt=True)``; ``response = template(prompt_msgs + response_msgs)[len(prompt):]``, which needs
  the template to render the prompt as a prefix of the whole conversation (it is checked).
- otherwise fields must be strings; ``prompt = input_template.format(prompt)`` when ``--input_template`` is set.
"""
from __future__ import annotations

from dataclasses import dataclass
from numbers import Real
from typing import TYPE_CHECKING, Any

import torch

from rlhf.data.config import DataConfig
from rlhf.data.sources import Record

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Messages = list[dict[str, Any]]


@dataclass
class SFTSample:
    """``input_ids`` (S,) int32 = prompt + response + eos; ``loss_mask`` (S,) bool, True on response tokens."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    prompt_len: int
    origin: str
    mm: dict | None = None
    """a vision-language sample's images: ``pixel_values`` (P, D), ``image_grid_thw`` (I, 3) (rlhf.data.vision)"""


@dataclass
class RMSample:
    """``chosen_ids`` (Sc,) / ``rejected_ids`` (Sr,) int32, each prompt + response + eos."""

    chosen_ids: torch.Tensor
    rejected_ids: torch.Tensor
    margin: float | None
    origin: str


@dataclass
class PromptSample:
    """``prompt_ids`` (S,) int32 after left truncation; ``prompt`` is the rendered text before truncation."""

    prompt_ids: torch.Tensor
    prompt: str
    label: Any
    origin: str
    mm: dict | None = None
    """a vision-language prompt's images as the trainer takes them (``pixel_values``, ``image_grid_thw``); its
    placeholders in ``prompt_ids`` are expanded (rlhf.data.vision)"""
    images: list | None = None
    """the same images as RGB PIL images, for the generator"""


# ---------------------------------------------------------------------------------------------- record checks
def _field_problem(data: dict[str, Any], key: str, chat: bool, vision: bool = False) -> str | None:
    """Why ``data[key]`` cannot be used as a text field, or None. ``vision``: message content may be a list of
    image and text items (``rlhf.data.vision``)."""
    if key not in data:
        return f"missing key {key!r}"
    v = data[key]
    if v is None:
        return f"key {key!r} is empty (null)"
    if isinstance(v, str):
        return f"key {key!r} is empty or blank" if not v.strip() else None
    if isinstance(v, (list, tuple)):
        if not chat:
            return f"key {key!r} holds a list of messages; pass --apply_chat_template to format it"
        if not v:
            return f"key {key!r} is an empty list of messages"
        for i, m in enumerate(v, 1):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
                return f"key {key!r}: message {i} is not a {{'role': ..., 'content': ...}} object"
            if vision and isinstance(m["content"], list) and m["content"]:
                from rlhf.data.vision import content_problem

                problem = content_problem(m["content"])
                if problem:
                    return f"key {key!r}: message {i}: {problem}"
                continue
            if not isinstance(m["content"], str) or not m["content"].strip():
                return f"key {key!r}: message {i} has empty content"
        return None
    return f"key {key!r} must be a string or a list of messages, got {type(v).__name__}"


def _conversation_problem(data: dict[str, Any], key: str) -> str | None:
    """A field that holds a whole conversation: messages whose last one, from the assistant, is the response."""
    v = data[key]
    if not isinstance(v, (list, tuple)):
        return f"key {key!r} must be a list of messages (a conversation ending with the assistant's reply)"
    if v[-1].get("role") != "assistant":
        return f"key {key!r}: the last message must have role 'assistant', got {v[-1].get('role')!r}"
    return None


def record_problem(record: Record, task: str, cfg: DataConfig) -> str | None:
    """Why ``record`` cannot be a sample of ``task`` ("sft", "rm" or "prompt"), or None. Cheap: no tokenizer."""
    if record.error is not None:
        return record.error
    d, chat = record.data, cfg.apply_chat_template
    if task == "sft" and cfg.pretrain_mode:
        problem = _field_problem(d, cfg.input_key, False)
        return problem or (None if isinstance(d[cfg.input_key], str) else
                           f"key {cfg.input_key!r} must be a text string with --pretrain_mode")
    if task == "sft":
        keys = [cfg.input_key] + ([cfg.output_key] if cfg.output_key else [])
    elif task == "rm":
        keys = ([cfg.prompt_key] if cfg.prompt_key else []) + [cfg.chosen_key, cfg.rejected_key]
    elif task == "prompt":
        keys = [cfg.input_key]
    else:
        raise AssertionError(f"unknown task {task!r}")
    for k in keys:
        problem = _field_problem(d, k, chat, cfg.vision is not None)
        if problem:
            return problem
    if cfg.vision is not None:  # the images: present, readable, one per placeholder (opened once, here)
        import os

        from rlhf.data.vision import images_problem

        problem = images_problem(d, keys, cfg.vision, os.path.dirname(os.path.abspath(record.path)))
        if problem:
            return problem
    if task == "sft" and not cfg.output_key:
        return _conversation_problem(d, cfg.input_key)
    if task == "rm" and not cfg.prompt_key and chat:
        return _conversation_problem(d, cfg.chosen_key) or _conversation_problem(d, cfg.rejected_key)
    if task == "rm" and cfg.margin_key:
        m = d.get(cfg.margin_key)
        if cfg.margin_key not in d:
            return f"missing key {cfg.margin_key!r}"
        if isinstance(m, bool) or not isinstance(m, Real):
            return f"key {cfg.margin_key!r} must be a number, got {type(m).__name__}"
    if task == "prompt" and cfg.label_key:
        if d.get(cfg.label_key) is None:
            return f"missing key {cfg.label_key!r}" if cfg.label_key not in d else f"key {cfg.label_key!r} is null"
    return None


# -------------------------------------------------------------------------------------------------- rendering
def _messages(v: str | Messages, role: str) -> Messages:
    return [{"role": role, "content": v}] if isinstance(v, str) else list(v)


def _chat(tokenizer: PreTrainedTokenizerBase, messages: Messages, add_generation_prompt: bool) -> str:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"--apply_chat_template: the tokenizer {tokenizer.name_or_path!r} has no chat_template")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def render_prompt(prompt: str | Messages, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> str:
    """The prompt text as the model sees it before generating (chat template with generation prompt, or template)."""
    if cfg.apply_chat_template:
        return _chat(tokenizer, _messages(prompt, "user"), add_generation_prompt=True)
    return cfg.input_template.format(prompt) if cfg.input_template else prompt


def render_pair(prompt: str | Messages | None, response: str | Messages, cfg: DataConfig,
                tokenizer: PreTrainedTokenizerBase, where: str) -> tuple[str, str]:
    """``(prompt_text, response_text)``. ``prompt=None``: ``response`` is a whole text / conversation (RM, SFT)."""
    if not cfg.apply_chat_template:
        return ("" if prompt is None else render_prompt(prompt, cfg, tokenizer)), response
    if prompt is None:  # a conversation: everything before the last message is the prompt
        prompt, response = list(response[:-1]), [response[-1]]
    p_msgs = _messages(prompt, "user")
    prompt_text = _chat(tokenizer, p_msgs, add_generation_prompt=True) if p_msgs else ""
    full = _chat(tokenizer, p_msgs + _messages(response, "assistant"), add_generation_prompt=False)
    if not full.startswith(prompt_text):
        raise ValueError(f"{where}: the chat template of {tokenizer.name_or_path!r} does not render the prompt "
                         f"(add_generation_prompt=True) as a prefix of prompt + response, so the response tokens "
                         f"cannot be located: {prompt_text[-80:]!r} vs {full[:len(prompt_text)][-80:]!r}")
    return prompt_text, full[len(prompt_text):]


# ------------------------------------------------------------------------------------------------ tokenizing
def _ids(tokenizer: PreTrainedTokenizerBase, text: str, special: bool) -> list[int]:
    # an empty prompt (RM without --prompt_key) still gets the tokenizer's BOS, if it adds one
    return list(tokenizer.encode(text, add_special_tokens=special))


def tokenize_pair(prompt_text: str, response_text: str, cfg: DataConfig,
                  tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], int]:
    """``(prompt_ids + response_ids + [eos], len(prompt_ids))`` (see the module docstring)."""
    eos = tokenizer.eos_token_id
    p = _ids(tokenizer, prompt_text, special=not cfg.apply_chat_template)
    r = _ids(tokenizer, response_text, special=False)
    if not r or r[-1] != eos:
        r.append(eos)
    return p + r, len(p)


def sft_sample(record: Record, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> tuple[SFTSample, bool]:
    """The full-length sample of a checked record and whether it is longer than ``cfg.max_len``."""
    d = record.data
    if cfg.pretrain_mode:  # the whole text is the target (the tokenizer's BOS, if any, is the "prompt")
        pt, rt = "", d[cfg.input_key]
    elif cfg.output_key:
        pt, rt = render_pair(_vision_items(d[cfg.input_key], cfg), d[cfg.output_key], cfg, tokenizer, record.where)
    else:
        pt, rt = render_pair(None, _vision_items(d[cfg.input_key], cfg), cfg, tokenizer, record.where)
    mm = None
    if cfg.vision is not None:
        import os

        from rlhf.data import vision as V

        if not cfg.apply_chat_template:
            pt = V.replace_placeholders(pt)
        mm = V.process(V.cached_images(d, cfg.vision, os.path.dirname(os.path.abspath(record.path))), cfg.vision)
    ids, plen = tokenize_pair(pt, rt, cfg, tokenizer)
    if cfg.vision is not None:  # the images are in the prompt: expand their placeholders there
        prompt_ids = V.expand_placeholders(ids[:plen], mm, cfg.vision, record.where)
        ids, plen = prompt_ids + ids[plen:], len(prompt_ids)
    mask = torch.zeros(len(ids), dtype=torch.bool)
    mask[plen:] = True
    return (SFTSample(torch.tensor(ids, dtype=torch.int32), mask, plen, record.where, mm),
            len(ids) > cfg.max_len)


def _vision_items(v, cfg: DataConfig):
    """With images and a chat template: ``<image>`` placeholders as image content items."""
    if cfg.vision is None or not cfg.apply_chat_template:
        return v
    from rlhf.data.vision import with_image_items

    return with_image_items(v)


def rm_sides(record: Record, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> list[tuple[list[int], int]]:
    """``[(chosen_ids, prompt_len), (rejected_ids, prompt_len)]`` of a checked record, untruncated."""
    d = record.data
    prompt = d[cfg.prompt_key] if cfg.prompt_key else None
    return [tokenize_pair(*render_pair(prompt, d[k], cfg, tokenizer, record.where), cfg, tokenizer)
            for k in (cfg.chosen_key, cfg.rejected_key)]


def prompt_sample(record: Record, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> tuple[PromptSample, bool]:
    """A PPO prompt, left-truncated to ``cfg.prompt_max_len`` tokens, and whether it was truncated.

    Left truncation keeps the end of the prompt (the question and the generation prompt); a leading BOS is kept.
    """
    mm = images = None
    if cfg.vision is not None:
        text, ids, mm, images = _vision_prompt(record, cfg, tokenizer)
    else:
        text = render_prompt(record.data[cfg.input_key], cfg, tokenizer)
        ids = _ids(tokenizer, text, special=not cfg.apply_chat_template)
    truncated = len(ids) > cfg.prompt_max_len
    if truncated and mm is not None:
        raise ValueError(f"{record.where}: the prompt with its images is {len(ids)} tokens, more than "
                         f"--prompt_max_len {cfg.prompt_max_len} (an image cannot be cut): raise --prompt_max_len "
                         "or lower --max_pixels")
    if truncated:
        bos = tokenizer.bos_token_id
        head = ids[:1] if bos is not None and ids[0] == bos else []
        ids = head + ids[len(ids) - (cfg.prompt_max_len - len(head)):]
    label = record.data.get(cfg.label_key) if cfg.label_key else None
    return PromptSample(torch.tensor(ids, dtype=torch.int32), text, label, record.where, mm, images), truncated


def _vision_prompt(record: Record, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase):
    """(text, ids with each image's placeholders expanded, the processed images, the PIL images) of a prompt of a
    vision-language model (``rlhf.data.vision``)."""
    import os

    from rlhf.data import vision as V

    images = V.cached_images(record.data, cfg.vision, os.path.dirname(os.path.abspath(record.path)))
    raw = record.data[cfg.input_key]
    if cfg.apply_chat_template:
        text = render_prompt(V.with_image_items(raw), cfg, tokenizer)
    else:
        text = V.replace_placeholders(render_prompt(raw, cfg, tokenizer))
    mm = V.process(images, cfg.vision)
    ids = V.expand_placeholders(_ids(tokenizer, text, special=not cfg.apply_chat_template), mm, cfg.vision,
                                record.where)
    return text, ids, mm, images or None
