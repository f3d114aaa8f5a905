"""The ``strings`` task: a word operation. ``reverse abc?`` → ``cba``, ``sort cab?`` → ``abc``,
``double ab?`` → ``aabb``. Words are random lowercase strings of ``min_length``…``max_length``
letters, so answers vary in length.

Partial credit (``partial_credit`` on): a wrong answer earns ``0.5 × matching positions /
max(len(answer), len(response))``, compared from the left; an empty answer 0.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable

from stalebound.core.errors import ConfigError
from stalebound.tasks.base import Sample, Task, Turn, register_task
from stalebound.tasks.config import TaskConfig

__all__ = ["OPERATIONS", "StringsTask"]


def _reverse(word: str) -> str:
    return word[::-1]


def _sort(word: str) -> str:
    return "".join(sorted(word))


def _double(word: str) -> str:
    return "".join(c + c for c in word)


OPERATIONS: dict[str, Callable[[str], str]] = {
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
        if not 1 <= c.min_length <= c.max_length <= 16:
            problems.append(
                f"task.strings.min_length={c.min_length}, max_length={c.max_length}: need "
                "1 <= min_length <= max_length <= 16"
            )
        if problems:
            raise ConfigError(problems)

    def generate(self, rng: random.Random, index: int) -> Sample:
        c = self.config.strings
        op = rng.choice(list(c.operations))
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
