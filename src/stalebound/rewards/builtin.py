"""Verifiers users expect out of the box: exact match, numeric match, regular expression.

Each is a plain reward function, ``reward(prompt, completion, answer, **columns)``, the same
interface a user's own reward has; name them as ``task.reward=exact``, ``numeric`` or ``regex``.
"""

from __future__ import annotations

import math
import re
from typing import Any

__all__ = ["exact_match", "extract_answer", "numeric_match", "parse_number", "regex_match"]

_BOXED = "\\boxed{"
_HASHES = re.compile(r"####\s*([^\n]+)")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*([^\n]+)", re.IGNORECASE)
_NUMBER = re.compile(r"[-−]?\$?\d[\d,]*(?:\.\d+)?%?|[-−]?\.\d+")


def _boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}``, braces balanced."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(_BOXED)
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def extract_answer(text: str) -> str:
    """The final answer a completion states: the last ``\\boxed{...}``, else what follows GSM8K's
    ``####``, else what follows "the answer is", else the whole text (stripped)."""
    boxed = _boxed(text)
    if boxed is not None:
        return boxed.strip()
    for pattern in (_HASHES, _ANSWER_IS):
        found = pattern.findall(text)
        if found:
            return str(found[-1]).strip()
    return text.strip()


def parse_number(text: str) -> float | None:
    """The last number in ``text`` (``1,234``, ``$5``, ``12.5%``, ``-3``, ``−3``), or ``None``."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    raw = found[-1].replace(",", "").replace("$", "").replace("%", "").replace("−", "-")
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def exact_match(prompt: Any, completion: str, answer: str, **_: Any) -> float:
    """1.0 when the completion, stripped, equals the reference answer, else 0.0."""
    return 1.0 if completion.strip() == str(answer).strip() else 0.0


def numeric_match(prompt: Any, completion: str, answer: str, **_: Any) -> dict[str, float]:
    """1.0 when the completion's final number equals the reference's (relative tolerance 1e-6).

    Both sides go through :func:`extract_answer` then :func:`parse_number`, so a GSM8K reference
    (``...#### 72``) and a completion ending ``\\boxed{72}`` or ``The answer is 72.`` compare as
    72. ``parsed`` (also logged) says whether the completion stated a number at all."""
    expected = parse_number(extract_answer(str(answer)))
    got = parse_number(extract_answer(completion))
    if got is None:
        return {"reward": 0.0, "parsed": 0.0}
    ok = expected is not None and math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-9)
    return {"reward": 1.0 if ok else 0.0, "parsed": 1.0}


def regex_match(prompt: Any, completion: str, answer: str, **_: Any) -> float:
    """1.0 when the reference answer, read as a regular expression, matches the whole stripped
    completion, else 0.0."""
    return 1.0 if re.fullmatch(str(answer), completion.strip(), flags=re.DOTALL) else 0.0
