"""Layouts of the seed systems' datasets, turned into our keys (``--dataset_format``; ``auto`` by dataset name,
then by the keys of its records):

* ``webgpt``: openai/webgpt_comparisons: ``question.full_text``, ``answer_0/1``, ``score_0/1``; the higher score
  is chosen, ties are dropped (they carry no preference) and counted.
* ``hh``: Anthropic/hh-rlhf (and full-hh-rlhf's ``chosen``/``rejected`` dialogues): ``"\\n\\nHuman: ...
  \\n\\nAssistant: ..."`` texts split into the shared prompt (up to and including the last ``Assistant:``) and each
  reply.
* ``chat``: preference mixtures whose ``chosen``/``rejected`` are whole conversations (lists of ``{role,
  content}`` messages, no prompt field): the shared messages before the last are the prompt, each last message the
  reply (rendered with ``--apply_chat_template``).
* ``plain``: the records as they are, read through ``--input_key``/``--output_key``/``--prompt_key``/... (chat
  message lists go through ``--apply_chat_template``).

A preset writes the prompt, chosen and rejected text under every key the task may read (``input_key``,
``output_key``, ``prompt_key``, ``chosen_key``, ``rejected_key``), so SFT trains on the chosen replies, RM / DPO on
the pairs and PPO takes the prompts.
"""
from __future__ import annotations

import logging
from typing import Any

from rlhf.data.sources import Record

log = logging.getLogger(__name__)

FORMATS = ("auto", "plain", "webgpt", "hh", "chat")
_WEBGPT_KEYS = {"question", "answer_0", "answer_1", "score_0", "score_1"}
_HH_TURN = "\n\nAssistant:"


def detect(name: str, records: list[Record]) -> str:
    """The preset of a dataset from its name, else from its first record's keys."""
    low = name.lower()
    if "webgpt_comparisons" in low:
        return "webgpt"
    if "hh-rlhf" in low or "hh_rlhf" in low:
        return "hh"
    first = next((r.data for r in records if r.data is not None), {})
    if _WEBGPT_KEYS <= set(first):
        return "webgpt"
    c, r = first.get("chosen"), first.get("rejected")
    if isinstance(c, str) and isinstance(r, str) and c.lstrip().startswith("Human:") and _HH_TURN in c:
        return "hh"
    if isinstance(c, list) and isinstance(r, list) and "prompt" not in first and len(c) > 1:
        return "chat"
    return "plain"


def _webgpt(d: dict[str, Any]) -> tuple[str, str, str] | None:
    q = d["question"]
    prompt = q.get("full_text") if isinstance(q, dict) else q
    if d["score_0"] == d["score_1"]:
        return None
    a, b = (d["answer_0"], d["answer_1"]) if d["score_0"] > d["score_1"] else (d["answer_1"], d["answer_0"])
    return prompt, a, b


def _split_hh(text: str) -> tuple[str, str]:
    i = text.rfind(_HH_TURN)
    if i < 0:
        raise ValueError(f"no '{_HH_TURN.strip()}' turn")
    return text[: i + len(_HH_TURN)], text[i + len(_HH_TURN):].lstrip()


def _hh(d: dict[str, Any]) -> tuple[str, str, str]:
    prompt, chosen = _split_hh(d["chosen"])
    prompt_r, rejected = _split_hh(d["rejected"])
    if prompt_r != prompt:
        raise ValueError("chosen and rejected dialogues differ before their last Assistant turn")
    return prompt, chosen, rejected


def _chat(d: dict[str, Any]) -> tuple[list, list, list]:
    c, r = d["chosen"], d["rejected"]
    if c[:-1] != r[:-1]:
        raise ValueError("chosen and rejected conversations differ before their last message")
    return list(c[:-1]), list(c[-1:]), list(r[-1:])


def apply(fmt: str, name: str, records: list[Record], cfg) -> list[Record]:
    """``records`` of dataset ``name`` rewritten by preset ``fmt`` (``auto``: detected) into ``cfg``'s keys."""
    fmt = detect(name, records) if fmt == "auto" else fmt
    if fmt == "plain":
        return records
    convert = {"webgpt": _webgpt, "hh": _hh, "chat": _chat}[fmt]
    out, ties = [], 0
    for r in records:
        if r.data is None:
            out.append(r)
            continue
        try:
            triple = convert(r.data)
        except (KeyError, ValueError, TypeError, AttributeError) as e:
            out.append(Record(None, r.path, r.index, r.unit, error=f"--dataset_format {fmt}: {type(e).__name__}: "
                                                                      f"{e}"))
            continue
        if triple is None:
            ties += 1
            continue
        out.append(Record(_keys(triple, cfg), r.path, r.index, r.unit))
    log.info("--dataset_format %s: %s -> %d prompt/chosen/rejected records%s", fmt, name, len(out),
             f" ({ties} ties dropped)" if ties else "")
    return out


def _keys(triple: tuple[str, str, str], cfg) -> dict[str, str]:
    prompt, chosen, rejected = triple
    full = cfg.prompt_key is None  # the reward model reads whole texts
    return {cfg.input_key: prompt, cfg.output_key or "output": chosen, cfg.prompt_key or "prompt": prompt,
            cfg.chosen_key: prompt + chosen if full else chosen, cfg.rejected_key: prompt + rejected if full
            else rejected}
