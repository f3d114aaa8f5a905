"""The ``strings`` task: a word operation. ``reverse abc?`` → ``cba``, ``sort cab?`` → ``abc``,
``double ab?`` → ``aabb``. Words are random lowercase strings of ``min_length``…``max_length``
letters, so answers vary in length; with ``lengths: lognormal`` most words are short and a few
are very long (``configs/bench-longtail.yaml``). ``copy`` repeats the word unchanged.

Partial credit (``partial_credit`` on): a wrong answer earns ``0.5 × matching positions /
max(len(answer), len(response))``, compared from the left; an empty answer 0.
"""

from __future__ import annotations

import math
import random
import string
from collections.abc import Callable

from stalebound.core.errors import ConfigError
from stalebound.tasks.base import Sample, Task, Turn, register_task
from stalebound.tasks.config import TaskConfig

__all__ = ["MAX_LOGNORMAL_LENGTH", "OPERATIONS", "StringsTask"]

MAX_LOGNORMAL_LENGTH = 200
"""The longest word ``lengths: lognormal`` may draw: prompt and answer together stay within the
embedded model's 512 positions."""


def _reverse(word: str) -> str:
    return word[::-1]


def _sort(word: str) -> str:
    return "".join(sorted(word))


def _copy(word: str) -> str:
    return word


def _double(word: str) -> str:
    return "".join(c + c for c in word)


OPERATIONS: dict[str, Callable[[str], str]] = {
    "copy": _copy,
    "reverse": _reverse,
    "sort": _sort,
    "double": _double,
}
"""The word operations by name."""


@register_task("strings")
class StringsTask(Task):
    """String manipulation on short random words; see the module docstring for the reward."""

    def __init__(self, config: TaskConfig) -> None:
        super().__init__(config)
        c = config.strings
        problems = []
        unknown = [op for op in c.operations if op not in OPERATIONS]
        if not c.operations or unknown:
            problems.append(
                f"task.strings.operations={list(c.operations)!r}: use a non-empty list of "
                f"{sorted(OPERATIONS)}"
            )
        longest = MAX_LOGNORMAL_LENGTH if c.lengths == "lognormal" else 16
        if not 1 <= c.min_length <= c.max_length <= longest:
            problems.append(
                f"task.strings.min_length={c.min_length}, max_length={c.max_length}: need "
                f"1 <= min_length <= max_length <= {longest} (lengths={c.lengths})"
            )
        if problems:
            raise ConfigError(problems)

    def generate(self, rng: random.Random, index: int) -> Sample:
        c = self.config.strings
        op = rng.choice(list(c.operations))
        if c.lengths == "lognormal":
            drawn = round(c.median_length * math.exp(c.sigma * rng.gauss(0.0, 1.0)))
            n = min(c.max_length, max(c.min_length, drawn))
        else:
            n = rng.randint(c.min_length, c.max_length)
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(n))
        return Sample(str(index), f"{op} {word}", OPERATIONS[op](word), {"op": op, "word": word})

    def prompt(self, sample: Sample) -> str:
        return f"{sample.question}?"

    def demonstration(self, sample: Sample) -> tuple[Turn, ...]:
        return (Turn(sample.answer),)

    def reward(self, sample: Sample, response: str) -> float:
        if response == sample.answer:
            return 1.0
        if not self.config.partial_credit or not response:
            return 0.0
        hits = sum(a == b for a, b in zip(sample.answer, response, strict=False))
        return 0.5 * hits / max(len(sample.answer), len(response))
