"""The ``arithmetic`` task: ``a+b=`` → ``a+b``, operands of ``min_digits``…``max_digits`` digits.

Answers vary in length (``7+5=`` → ``12``, ``3+4=`` → ``7``). Partial credit (``partial_credit``
on): a wrong all-digit answer earns ``0.5 × matching digits / max(len(answer), len(response))``,
digits compared aligned from the right (the ones digit with the ones digit); anything else 0.
"""

from __future__ import annotations

import random

from stalebound.core.errors import ConfigError
from stalebound.tasks.base import Sample, Task, Turn, register_task
from stalebound.tasks.config import TaskConfig

__all__ = ["ArithmeticTask", "digit_credit"]


def digit_credit(answer: str, response: str) -> float:
    """The fraction of digits that match, aligned from the right, over the longer string; 0 if
    ``response`` is empty or not all digits."""
    if not response.isdigit():
        return 0.0
    hits = sum(a == b for a, b in zip(reversed(answer), reversed(response), strict=False))
    return hits / max(len(answer), len(response))


@register_task("arithmetic")
class ArithmeticTask(Task):
    """Integer arithmetic on short numbers; see the module docstring for the reward."""

    def __init__(self, config: TaskConfig) -> None:
        super().__init__(config)
        c = config.arithmetic
        problems = []
        if not 1 <= c.min_digits <= c.max_digits <= 6:
            problems.append(
                f"task.arithmetic.min_digits={c.min_digits}, max_digits={c.max_digits}: need "
                "1 <= min_digits <= max_digits <= 6"
            )
        if not c.operators or set(c.operators) - set("+-*"):
            problems.append(
                f"task.arithmetic.operators={c.operators!r}: use a non-empty string of + - *"
            )
        if problems:
            raise ConfigError(problems)

    def _operand(self, rng: random.Random) -> int:
        c = self.config.arithmetic
        digits = rng.randint(c.min_digits, c.max_digits)
        low = 0 if digits == 1 else 10 ** (digits - 1)
        return rng.randint(low, 10**digits - 1)

    def generate(self, rng: random.Random, index: int) -> Sample:
        op = rng.choice(self.config.arithmetic.operators)
        a, b = self._operand(rng), self._operand(rng)
        if op == "-" and b > a:
            a, b = b, a
        value = a + b if op == "+" else a - b if op == "-" else a * b
        return Sample(str(index), f"{a}{op}{b}", str(value))

    def prompt(self, sample: Sample) -> str:
        return f"{sample.question}="

    def demonstration(self, sample: Sample) -> tuple[Turn, ...]:
        return (Turn(sample.answer),)

    def reward(self, sample: Sample, response: str) -> float:
        if response == sample.answer:
            return 1.0
        return 0.5 * digit_credit(sample.answer, response) if self.config.partial_credit else 0.0
