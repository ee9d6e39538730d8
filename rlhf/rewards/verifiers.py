"""Verifiable rewards: the answer of a reply, checked against a reference answer (``--label_key``).

    --reward_fn rlhf.rewards.verifiers:math_reward --label_key answer

* ``extract_boxed_answer(text)``: the content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces
  included; ``extract_last_number(text)``: the last number written in the text (``-3``, ``1,234``, ``0.5``, ``3/4``).
* ``grade_answer(given, truth)``: equal as strings after light normalisation, equal as numbers, or equal as
  mathematical expressions through HF's math-verify (numeric and symbolic equivalence: ``\\frac{1}{2}`` = ``0.5``,
  ``2x+1`` = ``1+2x``). math-verify is maintained (TRL and open-r1 use it), pure Python and installs here; its
  own timeouts use SIGALRM, so they are on only in the main thread. Without the package the string and numeric
  checks remain (logged once).
* ``math_reward(prompts, responses, labels)``: 1.0 when the reply's boxed answer (else its last number) grades equal
  to the label, else 0.0; a ``--reward_fn`` that takes labels.

OpenRLHF's reward files that import ``extract_boxed_answer, grade_answer`` from ``openrlhf.utils`` run here with
that import line changed to ``from rlhf.rewards.verifiers import extract_boxed_answer, grade_answer``.
"""
from __future__ import annotations

import logging
import re
import threading
from typing import Sequence

log = logging.getLogger(__name__)
_warned = False


def extract_boxed_answer(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` / ``\\fbox{...}`` of ``text`` (braces balanced), or None."""
    if not isinstance(text, str):
        return None
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        tail = text[start:].split(maxsplit=1)  # "\boxed 5"
        return tail[1].split()[0].rstrip(".$") if len(tail) > 1 and tail[0] == "\\boxed" else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j].strip()
    return None


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def extract_last_number(text: str) -> str | None:
    """The last number written in ``text`` (thousands separators dropped), or None."""
    found = _NUMBER.findall(text or "")
    if not found:
        return None
    return found[-1].replace(",", "").rstrip(".")


def _normalize(s: str) -> str:
    s = str(s).strip().strip("$").strip()
    for a, b in (("\\!", ""), ("\\left", ""), ("\\right", ""), ("dfrac", "frac"), ("tfrac", "frac"),
                 ("^{\\circ}", ""), ("^\\circ", ""), ("\\%", ""), ("%", ""), ("\\$", ""), (" ", "")):
        s = s.replace(a, b)
    s = re.sub(r"\\text\{\s*([^}]*)\}", r"\1", s)
    return s.rstrip(".")


def _as_number(s: str) -> float | None:
    s = s.replace(",", "")
    m = re.fullmatch(r"(-?\d+(?:\.\d+)?)/(\d+)", s)
    if m:
        return float(m.group(1)) / float(m.group(2)) if float(m.group(2)) else None
    m = re.fullmatch(r"\\frac\{(-?\d+(?:\.\d+)?)\}\{(\d+)\}", s)
    if m:
        return float(m.group(1)) / float(m.group(2)) if float(m.group(2)) else None
    try:
        return float(s)
    except ValueError:
        return None


def grade_answer(given_answer: str | None, ground_truth: str | None) -> bool:
    """Whether ``given_answer`` (already extracted) equals ``ground_truth``: as normalised strings, as numbers
    (relative 1e-6), or through math-verify's symbolic and numeric equivalence."""
    global _warned
    if given_answer is None or ground_truth is None:
        return False
    g, t = _normalize(given_answer), _normalize(ground_truth)
    if not g:
        return False
    if g == t:
        return True
    gn, tn = _as_number(g), _as_number(t)
    if gn is not None and tn is not None:
        return abs(gn - tn) <= 1e-6 * max(1.0, abs(tn))
    try:
        from math_verify import parse, verify
    except ImportError:
        if not _warned:
            log.warning("math-verify is not installed: answers are compared as strings and numbers only "
                        "(pip install math-verify)")
            _warned = True
        return False
    main = threading.current_thread() is threading.main_thread()  # its timeouts use SIGALRM
    kw = {} if main else {"parsing_timeout": None}
    gold, pred = parse(f"${t}$", **kw), parse(f"${g}$", **kw)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, **({} if main else {"timeout_seconds": None})))


def answer_of(response: str) -> str | None:
    """A reply's answer: its last boxed expression, else its last number."""
    boxed = extract_boxed_answer(response)
    return boxed if boxed is not None else extract_last_number(response)


def math_reward(prompts: Sequence[str], responses: Sequence[str], labels: Sequence) -> list[float]:
    """1.0 for a reply whose answer (``answer_of``) grades equal to its label, else 0.0 (``--reward_fn
    rlhf.rewards.verifiers:math_reward --label_key <the answer field>``)."""
    if labels is None or any(lb is None for lb in labels):
        raise ValueError("rlhf.rewards.verifiers:math_reward needs each prompt's answer: set --label_key")
    return [1.0 if grade_answer(answer_of(r), str(lb)) else 0.0 for r, lb in zip(responses, labels)]
